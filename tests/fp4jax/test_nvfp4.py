"""NVFP4 quantizer vs the independent NumPy reference: codes, scales, amax and dequantized values bit for bit."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
import reference as ref
from fp4jax import gemm
from fp4jax import nvfp4
from fp4jax.quantize import decoded_values
from op_by_op import op_by_op

FMT = fp4jax.NVFP4()
F32_MAX = np.finfo(np.float32).max
SIXTH = np.float32(1.0 / 6.0)


# ---------------------------------------------------------------- inputs
# Every case is a [4, 16, 64] tensor whose 16-blocks run along the last axis; tests move that axis
# to where they quantize, so a block-level construction stays a block-level construction.


def _rng(seed):
  return np.random.default_rng(seed)


def _rows(rows_RxC):
  """[64, 64] rows -> [4, 16, 64]."""
  return np.asarray(rows_RxC, np.float32).reshape(4, 16, 64)


def case_normal():
  return _rows(_rng(0).standard_normal((64, 64)))


def case_student_t():
  return _rows(_rng(1).standard_t(2, (64, 64)))


def case_zero_blocks():
  x = _rng(2).standard_normal((64, 64)).astype(np.float32)
  x[0, 16:32] = 0.0
  x[1, 32:48] = -0.0
  x[2, :] = 0.0
  x[3, ::2] = 0.0
  return _rows(x)


def case_all_zero():
  x = np.zeros((64, 64), np.float32)
  x[::3, ::5] = -0.0
  return _rows(x)


def case_underflow():
  """Tiny blocks next to a huge one: E4M3 block scales underflow to 0 or land on subnormals."""
  rng = _rng(3)
  x = (rng.standard_normal((64, 64)) * 1e-6).astype(np.float32)
  x[0, :16] = rng.standard_normal(16) * 1e4
  x[0, 0] = 2688.0  # amax: S_enc = 1, so c = f32(1/6) exactly and the boundaries below are known
  # Block amaxes putting amax_b * c around the E4M3 underflow boundary 2^-10 and the first subnormals.
  targets = [k * 2.0**-10 for k in (0.5, 0.99, 1.0, 1.01, 1.5, 2.0, 2.99, 3.0, 3.01, 5.0, 15.0, 16.5)]
  for i, t in enumerate(targets):
    row, blk = 1 + i // 4, i % 4
    amax_b = np.float32(t / float(SIXTH))
    x[row, 16 * blk:16 * blk + 16] = rng.uniform(-1, 1, 16).astype(np.float32) * amax_b
    x[row, 16 * blk] = -amax_b
  return _rows(x)


def case_saturation():
  """Block maxima whose E4M3 scale rounds down, so x * enc_b lands at and beyond 6."""
  rng = _rng(4)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  x[0, 0] = 2688.0
  # amax_b * f32(1/6) = t: E4M3 rounds t down (normal and subnormal scales), block max scales to 6 * t / s_b > 6.
  targets = [1.06, 1.0624, 1.93, 13.4, 300.0, 431.0, 1.49 * 2.0**-9, 2.49 * 2.0**-9, 4.45 * 2.0**-9]
  for i, t in enumerate(targets):
    row, blk = 1 + i // 4, i % 4
    s_b = ref.e4m3_rne(t)
    amax_b = np.float32(t / float(SIXTH))
    at_six = np.float32(6.0 * s_b)  # S_dec = 1, so x = 6 * s_b scales to exactly 6
    blk_x = np.linspace(-1, 1, 16) * amax_b
    blk_x[:6] = [amax_b, -amax_b, at_six, -at_six, np.float32(6.1 * s_b), np.float32(5.9 * s_b)]
    x[row, 16 * blk:16 * blk + 16] = blk_x.astype(np.float32)
  return _rows(x)


def case_ties():
  """Blocks with amax_b = 6 * 2^j: s_b = 2^j exactly, enc_b = 2^-j, so x * enc_b hits the E2M1 midpoints exactly."""
  rng = _rng(5)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  x[0, 0] = 2688.0  # S_enc = 1
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  blk = np.concatenate([[6.0], ties, -ties, [-6.0]])  # 16 values
  for i, j in enumerate([-8, -6, -3, -1, 0, 1, 3, 6, 8]):
    row, b = 1 + i // 4, i % 4
    x[row, 16 * b:16 * b + 16] = (rng.permutation(blk) * 2.0**j).astype(np.float32)
  return _rows(x)


def case_neg_zero():
  x = _rng(6).standard_normal((64, 64)).astype(np.float32)
  x[:, 1] = -0.0
  x[:, 2] = -1e-4  # rounds to zero with a negative sign: code 8
  x[:, 3] = 1e-4
  return _rows(x)


def case_scale_midpoints():
  """Block amaxes whose product amax_b * c lands on or a few ulp around E4M3 rounding midpoints."""
  rng = _rng(7)
  x = (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)
  x[0, 0] = 2688.0  # S_enc = 1, c = f32(1/6)
  e4m3 = np.unique(np.abs(ref.e4m3_rne(np.ldexp(np.arange(8, 16), -3)[None, :] * np.ldexp(1.0, np.arange(-6, 9))[:, None])))
  mids = (e4m3[1:] + e4m3[:-1]) / 2
  mids = np.concatenate([np.arange(1, 8) * 2.0**-9 + 2.0**-10, mids[mids > 2.0**-6]])
  picks = rng.choice(mids, 50, replace=False)
  blocks = []
  for m in picks:
    a = np.float32(m / float(SIXTH))
    for k in range(-2, 3):
      b = a
      for _ in range(abs(k)):
        b = np.nextafter(b, np.float32(np.inf if k > 0 else 0), dtype=np.float32)
      blocks.append(b)
  blocks = blocks[:4 * 63]
  for i, a in enumerate(blocks):
    row, b = 1 + i // 4, i % 4
    v = rng.uniform(-1, 1, 16).astype(np.float32) * a
    v[rng.integers(16)] = a
    x[row, 16 * b:16 * b + 16] = v
  return _rows(x)


SCALE_ORDER_AMAX = np.float32(1000.3)  # S_enc = 2688 / amax with a full mantissa (S_enc = 1 hides the order)


def _scale_order_products():
  """(S_enc, block amaxes whose scale product rounds to another E4M3 value if computed as (amax_b * S_enc) * (1/6)
  instead of the specification's amax_b * (S_enc * (1/6)))."""
  s_enc = np.float32(np.float32(2688.0) / SCALE_ORDER_AMAX)
  c = np.float32(s_enc * SIXTH)
  e4m3 = np.unique(np.abs(ref.e4m3_rne(np.ldexp(np.arange(8, 16), -3)[None, :] * np.ldexp(1.0, np.arange(-6, 9))[:, None])))
  mids = (e4m3[1:] + e4m3[:-1]) / 2
  found = []
  for m in mids[(mids > 2.0**-6) & (mids < 400)]:
    b = np.float32(m / float(c))
    for b in [b] + [np.nextafter(b, np.float32(d * np.inf), dtype=np.float32) for d in (-1, 1)]:
      spec, other = np.float32(b * c), np.float32(np.float32(b * s_enc) * SIXTH)
      if ref.e4m3_rne(np.float64(spec)) != ref.e4m3_rne(np.float64(other)):
        found.append(b)
  return s_enc, np.asarray(found, np.float32)


def case_scale_order():
  """Block amaxes on which the order of the block-scale product decides the E4M3 scale (one step apart)."""
  rng = _rng(10)
  x = (rng.standard_normal((64, 64)) * 0.01).astype(np.float32)
  x[0, 0] = SCALE_ORDER_AMAX
  for i, a in enumerate(_scale_order_products()[1][:4 * 63]):
    row, b = 1 + i // 4, i % 4
    v = rng.uniform(-1, 1, 16).astype(np.float32) * a
    v[rng.integers(16)] = a
    x[row, 16 * b:16 * b + 16] = v
  return _rows(x)


def case_wide_range():
  """Block magnitudes log-uniform over 8 decades: scales from 448 down to E4M3 subnormals and zero."""
  rng = _rng(8)
  mags = 10.0**rng.uniform(-8, 0, (64, 4))
  return _rows(rng.standard_normal((64, 64)) * np.repeat(mags, 16, axis=1))


CASES = {
    "normal": case_normal,
    "student_t": case_student_t,
    "zero_blocks": case_zero_blocks,
    "all_zero": case_all_zero,
    "underflow": case_underflow,
    "saturation": case_saturation,
    "ties": case_ties,
    "neg_zero": case_neg_zero,
    "scale_midpoints": case_scale_midpoints,
    "scale_order": case_scale_order,
    "wide_range": case_wide_range,
    "bf16": lambda: jnp.asarray(case_normal(), jnp.bfloat16),
    "bf16_heavy": lambda: jnp.asarray(case_student_t(), jnp.bfloat16),
    "fp16": lambda: jnp.asarray(case_normal(), jnp.float16),
}


# ---------------------------------------------------------------- helpers


@functools.cache
def _quantizer(axis, block_2d, jit):
  f = functools.partial(fp4jax.quantize, fmt=FMT, axis=axis, block_2d=block_2d)
  return jax.jit(f) if jit else op_by_op(f)


_dequantize_jit = jax.jit(fp4jax.dequantize, static_argnums=1)


def assert_matches_reference(q, x, axis, block_2d=False):
  """Codes (packed and unpacked), E4M3 scales, amax and dequantized values equal the reference exactly."""
  r = ref.nvfp4_quantize(x, axis=axis, block_2d=block_2d)
  codes = np.asarray(q.unpacked_codes())
  assert codes.dtype == np.uint8 and codes.shape == x.shape
  np.testing.assert_array_equal(codes.astype(np.int64), r["codes"].astype(np.int64))
  packed = np.asarray(q.codes)
  assert packed.dtype == np.uint8
  np.testing.assert_array_equal(packed, ref.pack_codes(r["codes"], axis))
  assert q.scales.dtype == jnp.float8_e4m3fn
  assert q.scales.shape == r["scales"].shape
  np.testing.assert_array_equal(ref.as_f64(q.scales), r["scales"])
  assert q.amax.dtype == jnp.float32 and q.amax.shape == ()
  np.testing.assert_array_equal(np.float64(q.amax), r["amax"])
  deq = np.asarray(fp4jax.dequantize(q))
  assert deq.dtype == np.float32 and deq.shape == x.shape
  want = ref.nvfp4_dequantize(r["codes"], r["scales"], r["amax"], axis=axis, block_2d=block_2d)
  ref.assert_same_bits(deq, want)
  return r


# ---------------------------------------------------------------- 1D blocks


def test_cases_hit_what_they_claim():
  """The adversarial constructions really produce ties, zero scales, saturation and E4M3 midpoints."""
  r = ref.nvfp4_quantize(case_ties())
  mags = np.abs(r["scaled"])
  for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
    assert np.sum(mags == t) >= 18, t
  r = ref.nvfp4_quantize(case_underflow())
  assert np.sum(r["scales"] == 0) > 100 and np.any((r["scales"] > 0) & (r["scales"] < 2.0**-6))
  r = ref.nvfp4_quantize(case_saturation())
  assert np.sum(np.abs(r["scaled"]) > 6.05) >= 27 and np.sum(np.abs(np.abs(r["scaled"]) - 6) < 1e-6) >= 18
  assert np.max(np.abs(r["scaled"])) > 8
  prod = ref.f32(np.abs(case_scale_midpoints().reshape(-1, 16)).max(-1) * float(SIXTH))
  up, down = ref.e4m3_rne(prod * (1 + 2.0**-20)), ref.e4m3_rne(prod * (1 - 2.0**-20))
  assert np.sum(up != down) > 100  # products within 2^-20 (a few float32 ulp) of an E4M3 rounding boundary
  r = ref.nvfp4_quantize(case_neg_zero())
  assert np.sum(r["codes"] == 8) >= 64 * 2
  s_enc, products = _scale_order_products()
  assert len(products) >= 40
  x = case_scale_order()
  amax_b = np.abs(x.reshape(-1, 16)).max(-1)
  other_order = ref.e4m3_rne(ref.f32(ref.f32(amax_b * float(s_enc)) * float(SIXTH)))
  assert np.sum(other_order != ref.nvfp4_quantize(x)["scales"].reshape(-1)) >= 40


@pytest.mark.parametrize("case", list(CASES))
def test_value_paths_equal_dequantize(case):
  """fake_quant, decoded_values and the bf16 GEMM unit round through the value path (grids.round_e2m1_magnitude),
  not the codes; on exact ties (and everywhere) they must equal dequantize(quantize(x)) bit for bit."""
  x = jnp.asarray(CASES[case]())
  d = fp4jax.dequantize(fp4jax.quantize(x, "nvfp4"))
  np.testing.assert_array_equal(np.asarray(fp4jax.fake_quant(x, "nvfp4")), np.asarray(d.astype(x.dtype)))
  values, _ = decoded_values(x, "nvfp4")
  np.testing.assert_array_equal(np.asarray(values), np.asarray(d))
  unit = gemm.unit_values(x, "nvfp4")
  np.testing.assert_array_equal(np.asarray(unit.values.astype(jnp.float32) * unit.factor), np.asarray(d))


def test_tiny_and_infinite_amax_scales_match_reference():
  """amax < 2688 / FLT_MAX: S_enc is clamped to FLT_MAX (unclamped, an all-zero block's scale became 0 * inf = NaN
  and a finite tensor dequantized to NaN rows). amax = inf: S_enc = 0 is taken as 1, so the stored scales are the
  reference's (448 for an infinite block), though the dequantized tensor is NaN."""
  tiny = np.zeros((4, 16, 64), np.float32)
  tiny[0, 0, :3] = [1e-36, -5e-37, 2e-37]
  q = _quantizer(-1, False, True)(jnp.asarray(tiny))
  # Scales only: below amax ~3.2e-35 XLA:CPU flushes 1 / S_enc and the codes saturate (docs/numerics.md).
  np.testing.assert_array_equal(ref.as_f64(q.scales), ref.nvfp4_quantize(tiny)["scales"])
  assert ref.as_f64(q.scales)[0, 0, 0] == 56.0 and np.all(ref.as_f64(q.scales).reshape(-1)[1:] == 0)
  for x_hat in (fp4jax.dequantize(q), fp4jax.fake_quant(jnp.asarray(tiny), "nvfp4")):
    assert np.all(np.isfinite(np.asarray(x_hat))) and np.all(np.asarray(x_hat)[tiny == 0] == 0)
  inf = np.asarray(case_normal())
  inf[0, 0, 3], inf[1, 2, 20] = np.inf, -np.inf
  q = _quantizer(-1, False, True)(jnp.asarray(inf))
  r = ref.nvfp4_quantize(inf)
  np.testing.assert_array_equal(ref.as_f64(q.scales), r["scales"])
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()).astype(np.int64), r["codes"].astype(np.int64))
  assert r["scales"][0, 0, 0] == 448.0 and r["scales"][1, 2, 1] == 448.0
  assert np.all(np.isnan(np.asarray(fp4jax.dequantize(q))))


def test_round_e4m3_saturates_at_448_and_global_range_is_6_times_448():
  v = np.array([447.0, 460.0, 464.0, 470.0, 500.0, 1e9, np.inf, -470.0, -np.inf], np.float32)
  got = np.asarray(fp4jax.grids.round_e4m3(jnp.asarray(v)), np.float64)
  np.testing.assert_array_equal(got, ref.e4m3_rne(v.astype(np.float64)))
  np.testing.assert_array_equal(got, [448.0] * 7 + [-448.0] * 2)
  assert fp4jax.nvfp4.GLOBAL_RANGE == fp4jax.NVFP4().global_range == 2688.0


def test_four_over_six_keeps_negative_zero():
  x = np.zeros((2, 32), np.float32)
  x[0, :16] = -0.0
  x[1, 0], x[1, 1] = 1.0, -0.0
  q = fp4jax.quantize(jnp.asarray(x), "nvfp4_4over6")
  codes = np.asarray(q.unpacked_codes())
  assert np.all(codes[0, :16] == 8) and codes[1, 1] == 8
  assert np.all(np.signbit(np.asarray(fp4jax.dequantize(q))[0, :16]))


def test_round_e2m1_nearest_ties_to_even_and_keeps_nan():
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.0], np.float32)
  got = np.asarray(fp4jax.rounding.round_e2m1_nearest(jnp.asarray(np.concatenate([ties, -ties]))))
  want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0], np.float32)
  np.testing.assert_array_equal(got, np.concatenate([want, -want]))
  assert np.all(np.signbit(got[9:]))  # -0.25 -> -0
  nan = np.asarray(fp4jax.rounding.round_e2m1_nearest(jnp.asarray([np.nan, -np.nan], jnp.float32)))
  assert np.all(np.isnan(nan)) and np.signbit(nan[1]) and not np.signbit(nan[0])


# Eager runs only on the [4, 16, 64] layout: each new shape costs eager compiles of every primitive.
@pytest.mark.parametrize("axis,jit", [(0, True), (1, True), (-1, True), (-1, False)],
                         ids=["axis0-jit", "axis1-jit", "axis-1-jit", "axis-1-eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_1d_blocks_match_reference(case, axis, jit):
  x = CASES[case]()
  x = jnp.moveaxis(jnp.asarray(x), -1, axis)
  q = _quantizer(axis, False, jit)(x)
  assert q.axis == axis % 3 and q.orig_shape == x.shape and not q.block_2d
  assert q.dtype == x.dtype
  assert_matches_reference(q, np.asarray(x), axis)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_all_float32_max(jit):
  x = np.full((4, 16, 64), F32_MAX, np.float32)
  x[1, ::3] = -F32_MAX
  q = _quantizer(-1, False, jit)(jnp.asarray(x))
  r = assert_matches_reference(q, x, -1)
  assert np.all(r["scales"] == 448.0)
  deq = np.asarray(fp4jax.dequantize(q))
  assert np.all(np.isfinite(deq))
  np.testing.assert_array_equal(deq, x)  # 6 * 448 * f32(FLT_MAX / 2688) happens to round back to FLT_MAX


@pytest.mark.parametrize("magnitude", [1e-6, 1e-7, 1e-8])
def test_gradient_sized_inputs(magnitude):
  """Per-element gradients ~1e-6..1e-8: the per-tensor scale keeps block scales in E4M3's normal range."""
  x = (_rng(9).standard_normal((4, 16, 64)) * magnitude).astype(np.float32)
  q = _quantizer(-1, False, True)(jnp.asarray(x))
  assert_matches_reference(q, x, -1)
  s = ref.as_f64(q.scales)
  assert np.all(s >= 2.0**-6) and np.all(s <= 448)
  zero_frac = np.mean(np.asarray(q.unpacked_codes()) % 8 == 0)
  # Same statistic at unit scale (scale invariance): ~7% of Gaussian entries fall below amax_b / 24.
  unit = np.mean(np.asarray(_quantizer(-1, False, True)(jnp.asarray(x / np.float32(magnitude))).unpacked_codes()) % 8 == 0)
  assert zero_frac < 0.12, zero_frac
  assert abs(zero_frac - unit) < 0.01
  rel = np.linalg.norm(np.asarray(fp4jax.dequantize(q)) - x) / np.linalg.norm(x)
  assert rel < 0.15, rel


# ---------------------------------------------------------------- 2D blocks


@pytest.mark.parametrize("axis,jit", [(0, True), (-1, True), (-1, False)], ids=["axis0-jit", "axis-1-jit", "axis-1-eager"])
@pytest.mark.parametrize("case", ["normal", "student_t", "underflow", "ties", "wide_range", "bf16"])
def test_2d_blocks_match_reference(case, axis, jit):
  x = jnp.asarray(CASES[case]()).reshape(64, 64)[:, :48]
  q = _quantizer(axis, True, jit)(x)
  assert q.block_2d and q.scales.shape == (4, 3)
  assert_matches_reference(q, np.asarray(x), axis, block_2d=True)


def test_2d_blocks_with_batch_axis():
  x = jnp.asarray(case_student_t()).reshape(2, 32, 64)
  for axis in (1, 2):
    q = _quantizer(axis, True, True)(x)
    assert q.scales.shape == (2, 2, 4)
    assert_matches_reference(q, np.asarray(x), axis, block_2d=True)


@pytest.mark.parametrize("jit", [True])
def test_2d_transpose_equals_quantizing_transpose(jit):
  """W [64, 48] with 16x16 blocks: transposed codes + scales == quantize(W^T); the Dgrad weight is an exact transpose."""
  w = np.asarray(case_student_t()).reshape(64, 64)[:, :48]
  q = _quantizer(-1, True, jit)(jnp.asarray(w))
  qt = _quantizer(-1, True, jit)(jnp.asarray(w.T))
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()).T, np.asarray(qt.unpacked_codes()))
  np.testing.assert_array_equal(ref.as_f64(q.scales).T, ref.as_f64(qt.scales))
  np.testing.assert_array_equal(np.float32(q.amax), np.float32(qt.amax))
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q)).T, np.asarray(fp4jax.dequantize(qt)))
  # Packed along axis 0 for W is byte-for-byte the transpose of packed along the last axis for W^T.
  q0 = _quantizer(0, True, jit)(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(q0.codes).T, np.asarray(qt.codes))


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("case", ["normal", "student_t", "saturation", "ties", "bf16", "neg_zero"])
def test_quantize_dequantize_idempotent(case):
  x = jnp.asarray(CASES[case]())
  quant = _quantizer(-1, False, True)
  d1 = fp4jax.dequantize(quant(x))
  d2 = fp4jax.dequantize(quant(d1))
  np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(quant(d2))), np.asarray(d2))


@pytest.mark.parametrize("case", ["wide_range", "underflow"])
def test_idempotent_except_subnormal_scale_blocks(case):
  """Spec-level exception (the reference does the same): a block whose E4M3 scale is subnormal can round up by far
  more than 1/16, so its max lands below code 6 (e.g. amax_b * c = 0.56 * 2^-9 -> s_b = 2^-9, max code 3). The
  second pass then picks a different scale (there: 3/6 * 2^-9 = 2^-10, a tie RNE sends to 0). Normal-range scales
  round by at most 1/16, the block max always encodes to 6, and those blocks are idempotent."""
  x = jnp.asarray(CASES[case]())
  quant = _quantizer(-1, False, True)
  q1 = quant(x)
  d1 = fp4jax.dequantize(q1)
  q2 = quant(d1)
  assert_matches_reference(q2, np.asarray(d1), -1)
  d2 = np.asarray(fp4jax.dequantize(q2))
  s1 = ref.as_f64(q1.scales)
  max_code = (np.asarray(q1.unpacked_codes()) % 8).reshape(4, 16, 4, 16).max(-1)
  off_six = (max_code != 7) & (s1 > 0)
  assert np.all(s1[off_six] < 2.0**-6)
  changed = (np.asarray(d1) != d2).reshape(4, 16, 4, 16).any(-1)
  assert not np.any(changed & ~off_six)
  if case == "wide_range":  # this seed contains such blocks, including the tie-to-zero one
    assert np.any(changed) and np.any(ref.as_f64(q2.scales)[changed] == 0)


@pytest.mark.parametrize("case", ["normal", "student_t", "ties", "scale_midpoints", "wide_range"])
def test_dequantize_is_code_times_scale_times_global(case):
  """From the QArray's own fields: dequantized == f32(f32(code_value * s_b) * f32(amax / 2688))."""
  q = _quantizer(-1, False, True)(jnp.asarray(CASES[case]()))
  cv = ref.e2m1_value(np.asarray(q.unpacked_codes()))
  s = np.repeat(ref.as_f64(q.scales), 16, axis=-1)
  amax = np.float32(q.amax)
  want = (cv.astype(np.float32) * s.astype(np.float32)) * (amax / np.float32(2688.0))
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q)), want)


@pytest.mark.parametrize("seed", range(4))
def test_dequantize_under_jit_is_exact(seed):
  """Under jit XLA may rewrite `amax / 2688` as `amax * f32(1/2688)`, which is not the reference rounding."""
  rng = _rng(100 + seed)
  x = (rng.standard_normal((16, 4, 64)) * 10.0**rng.uniform(-4, 4, (16, 1, 1))).astype(np.float32)
  for x_i in x:  # 16 tensors, 16 different amax values, one compile
    q = _quantizer(-1, False, True)(jnp.asarray(x_i))
    r = ref.nvfp4_quantize(x_i)
    want = ref.nvfp4_dequantize(r["codes"], r["scales"], r["amax"])
    np.testing.assert_array_equal(np.asarray(_dequantize_jit(q)), want)
    np.testing.assert_array_equal(np.asarray(_dequantize_jit(q)), np.asarray(fp4jax.dequantize(q)))


def test_dequantize_dtype_and_fake_quant():
  x = jnp.asarray(case_student_t(), jnp.bfloat16)
  q = _quantizer(-1, False, True)(x)
  d32 = fp4jax.dequantize(q)
  d16 = fp4jax.dequantize(q, jnp.bfloat16)
  assert d16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(d16), np.asarray(d32.astype(jnp.bfloat16)))
  fq = jax.jit(functools.partial(fp4jax.fake_quant, fmt=FMT))(x)
  assert fq.dtype == jnp.bfloat16 and fq.shape == x.shape
  np.testing.assert_array_equal(np.asarray(fq), np.asarray(d16))


def test_round_to_nearest_block_max_encodes_to_six():
  q = _quantizer(-1, False, True)(jnp.asarray(case_normal()))
  codes = np.asarray(q.unpacked_codes()).reshape(-1, 16)
  x = case_normal().reshape(-1, 16)
  at_max = codes[np.arange(len(x)), np.argmax(np.abs(x), axis=-1)]
  assert np.all(at_max % 8 == 7)


def test_qarray_metadata_and_storage():
  x = jnp.asarray(case_normal())
  q = _quantizer(1, False, True)(x)
  assert q.codes.shape == (4, 8, 64) and q.scales.shape == (4, 1, 64)
  assert q.shape == q.orig_shape == (4, 16, 64) and q.axis == 1
  assert q.nbytes == 4 * 8 * 64 + 4 * 64 + 4  # 4.5 bits per element + the float32 amax
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 3
  q2 = jax.tree_util.tree_unflatten(treedef, leaves)
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q2)), np.asarray(fp4jax.dequantize(q)))
  assert fp4jax.get_format("nvfp4") == FMT and hash(FMT) == hash(fp4jax.NVFP4())
  assert FMT.block_size == 16 and FMT.name == "nvfp4"


def test_misspelt_format_names_get_the_closest_one():
  assert fp4jax.get_format("NVFP4") == FMT  # names are case-insensitive
  with pytest.raises(ValueError, match=r"Unknown format 'nvpf4' \(did you mean 'nvfp4'\?\); expected one of"):
    fp4jax.get_format("nvpf4")
  with pytest.raises(ValueError, match=r"'MXFP4-ceil' \(did you mean 'mxfp4_ceil'\?\)"):
    fp4jax.get_format("MXFP4-ceil")
  with pytest.raises(ValueError, match=r"Unknown format 'xyz'; expected"):  # nothing close: no guess
    fp4jax.get_format("xyz")
  with pytest.raises(ValueError, match=r"Unknown format 4; expected"):
    fp4jax.get_format(4)


def test_double_block_storage_counts_one_float32_amax_per_128_elements():
  q = fp4jax.quantize(jnp.ones((64, 256), jnp.float32), fp4jax.NVFP4(double_block=True))
  assert q.amax.shape == (64, 2)
  assert q.nbytes == 64 * 128 + 64 * 16 + 64 * 2 * 4
  assert q.bits_per_element == 4.75


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_block_encode_scale_is_one_over_s_b_times_s_dec_in_float32(jit):
  """enc_b = f32(1 / f32(s_b * f32(1 / S_enc))), the reference's roundings in its order, bit for bit.

  Eager too: under jit XLA:CPU rewrites (1 / s_b) / s_dec into 1 / (s_b * s_dec), which hides that wrong order on the
  CPU (a GPU's divide_in_float64 would not)."""
  rng = np.random.default_rng(0)
  amax = np.float32(10.0) ** rng.uniform(-3, 3, 4096).astype(np.float32)
  s_enc = (np.float32(2688.0) / amax).astype(np.float32)
  s_b = np.asarray(ref.e4m3_rne(rng.uniform(2.0**-6, 448.0, 4096)), np.float32)
  s_dec = (np.float32(1.0) / s_enc).astype(np.float32)
  want = np.minimum(np.float32(1.0) / (s_b * s_dec).astype(np.float32), F32_MAX).astype(np.float32)
  f = jax.jit(nvfp4.block_encode_scale) if jit else nvfp4.block_encode_scale
  got = np.asarray(f(jnp.asarray(s_b), jnp.asarray(s_enc)))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_double_block_with_a_partial_last_group_round_trips():
  """A blocked axis of 48 elements (3 blocks) holds one partial 1x128 group: one amax per row, and dequantize's
  field check accepts the QArray quantize made."""
  x = jax.random.normal(jax.random.key(0), (4, 48), jnp.float32)
  q = fp4jax.quantize(x, fp4jax.NVFP4(double_block=True))
  assert q.amax.shape == (4, 1)
  y = fp4jax.dequantize(q)
  assert y.shape == (4, 48) and bool(jnp.all(jnp.isfinite(y)))


def test_headroom_block_maxima_near_float32_max_saturate():
  """With headroom a block maximum lands at 6 x 16/17 and rounds to 6: it decodes to ~17/16 of the tensor amax,
  past FLT_MAX from 3.2e38, and came out inf from finite input. It saturates at FLT_MAX (float16: 65504) now; an
  ordinary tensor keeps its bits (the 17/16 overshoot of round-to-nearest is headroom's, not an overflow)."""
  headroom = fp4jax.NVFP4(headroom=True)
  x = np.full((2, 16), 3.3e38, np.float32)
  x[1] = -x[1]
  got = np.asarray(fp4jax.fake_quant(jnp.asarray(x), headroom))
  np.testing.assert_array_equal(got, np.where(x > 0, F32_MAX, -F32_MAX).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(fp4jax.quantize(jnp.asarray(x), headroom))), got)
  half = np.asarray(fp4jax.fake_quant(jnp.full((1, 16), 65504.0, jnp.float16), headroom))
  assert half.dtype == np.float16 and np.all(half == 65504.0)
  assert float(fp4jax.fake_quant(jnp.ones((1, 16)), headroom)[0, 0]) == 1.0625


def test_saturation_runs_only_where_decoded_values_can_pass_the_dtype():
  """The saturating pass costs ~20 % of a float32 q+dq (a compute-bound loop): it runs for narrower outputs and for
  the formats that decode past their amax, not for plain float32 NVFP4/MXFP4/FP8, which stay within it."""
  pass_dtype = importlib.import_module("fp4jax.quantize").may_pass_dtype
  for fmt in (fp4jax.NVFP4(), fp4jax.NVFP4(scale_rule="4over6"), fp4jax.get_format("mxfp4"), fp4jax.get_format("fp8")):
    assert not pass_dtype(fmt, jnp.float32) and pass_dtype(fmt, jnp.bfloat16) and pass_dtype(fmt, jnp.float16)
  assert pass_dtype(fp4jax.NVFP4(headroom=True), jnp.float32) and pass_dtype(fp4jax.NVFP4(scale_rule="eden"),
                                                                             jnp.float32)
