"""MXFP4 (E2M1 + E8M0 scale per 32) vs the NumPy reference, both scale rules, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
import reference as ref
import reference_recipes as rref
from op_by_op import op_by_op

F32_MAX = np.finfo(np.float32).max
RULES = ["floor", "ceil"]


def _rng(seed):
  return np.random.default_rng(seed)


def _rows(rows):
  """[64, 64] rows (two 32-blocks each) -> [4, 16, 64]."""
  return np.asarray(rows, np.float32).reshape(4, 16, 64)


def _set_block(x, i, values):
  x[i // 2, 32 * (i % 2):32 * (i % 2) + 32] = np.asarray(values, np.float32)


def case_normal():
  return _rows(_rng(0).standard_normal((64, 64)))


def case_student_t():
  return _rows(_rng(1).standard_t(2, (64, 64)))


def case_zero_blocks():
  x = _rng(2).standard_normal((64, 64)).astype(np.float32)
  x[0, :32] = 0.0
  x[1, 32:] = -0.0
  x[5] = 0.0
  return _rows(x)


def case_wide_range():
  """Per-block magnitudes over 60 decades (all float32 values stay normal)."""
  rng = _rng(3)
  mags = 10.0**rng.uniform(-30, 30, (64, 2))
  return _rows(rng.uniform(0.1, 1, (64, 64)) * rng.choice([-1, 1], (64, 64)) * np.repeat(mags, 32, axis=1))


def case_pow2_boundaries():
  """Block amaxes on and one float32 ulp around 2^k and 6 * 2^k, where floor/ceil of log2 change."""
  rng = _rng(4)
  x = (rng.uniform(-0.2, 0.2, (64, 64))).astype(np.float32)
  i = 0
  for k in rng.choice(np.arange(-60, 61), 20, replace=False):
    for base in (1.0, 6.0):
      a = np.float32(base * 2.0**k)
      for b in (np.nextafter(a, np.float32(0)), a, np.nextafter(a, np.float32(np.inf))):
        if i < 128:
          v = rng.uniform(-1, 1, 32).astype(np.float32) * b
          v[rng.integers(32)] = -b if i % 3 else b
          _set_block(x, i, v)
          i += 1
  return _rows(x)


def case_ties():
  """Blocks [6, ties...] * 2^j: both rules give scale 2^j, so x / scale hits the E2M1 midpoints exactly."""
  rng = _rng(5)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  blk = np.concatenate([[6.0, -6.0], ties, -ties, ties, -ties, [-0.0, 0.0]])  # 32 values
  for i, j in enumerate(range(-40, 41, 5)):
    _set_block(x, i, rng.permutation(blk) * 2.0**j)
  return _rows(x)


def case_saturation():
  """Floor rule: amax_b in (6, 8) * 2^j scales to above 6 and saturates; also a float32-max block."""
  rng = _rng(6)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  for i, t in enumerate([6.01, 6.5, 7.0, 7.5, 7.99]):
    v = rng.uniform(-1, 1, 32) * t
    v[:4] = [t, -t, 6.0, -6.0]
    _set_block(x, i, v * 2.0**(3 * i - 6))
  _set_block(x, 10, np.full(32, F32_MAX) * rng.choice([-1, 1], 32))
  return _rows(x)


def case_clamp():
  """amax_b in [2^-126, 2^-125): floor(log2) - 2 = -128 and ceil(log2(/6)) = -128, both clamped to -127.

  Elements stay >= 2^-126 (normal) because XLA on CPU flushes float32 subnormals."""
  rng = _rng(7)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  for i in range(8):
    v = rng.choice([1.0, 1.25, 1.5, 1.75, 1.9], 32) * rng.choice([-1, 1], 32) * 2.0**-126
    _set_block(x, i, v)
  return _rows(x)


CASES = {
    "normal": case_normal,
    "student_t": case_student_t,
    "zero_blocks": case_zero_blocks,
    "wide_range": case_wide_range,
    "pow2_boundaries": case_pow2_boundaries,
    "ties": case_ties,
    "saturation": case_saturation,
    "clamp": case_clamp,
    "bf16": lambda: jnp.asarray(case_student_t(), jnp.bfloat16),
}


@functools.cache
def _quantizer(rule, axis, block_2d, jit):
  f = functools.partial(fp4jax.quantize, fmt=fp4jax.MXFP4(scale_rule=rule), axis=axis, block_2d=block_2d)
  return jax.jit(f) if jit else op_by_op(f)


_dequantize_jit = jax.jit(fp4jax.dequantize)


def assert_matches_reference(q, x, axis, rule, block_2d=False, check_dequant=True):
  r = ref.mxfp4_quantize(x, axis=axis, block_2d=block_2d, rule=rule)
  codes = np.asarray(q.unpacked_codes())
  assert codes.dtype == np.uint8 and codes.shape == x.shape
  np.testing.assert_array_equal(codes.astype(np.int64), r["codes"].astype(np.int64))
  np.testing.assert_array_equal(np.asarray(q.codes), ref.pack_codes(r["codes"], axis))
  assert q.scales.dtype == jnp.float8_e8m0fnu and q.scales.shape == r["scales"].shape
  np.testing.assert_array_equal(ref.as_f64(q.scales), r["scales"])
  np.testing.assert_array_equal(np.float64(q.amax), r["amax"])
  if check_dequant:
    s = ref.expand(r["scales"], 32, axis % x.ndim, block_2d)
    want = ref.f32(ref.e2m1_value(r["codes"]) * s)
    ref.assert_same_bits(fp4jax.dequantize(q), want)
    ref.assert_same_bits(_dequantize_jit(q), want)
  return r


def test_cases_hit_what_they_claim():
  for rule in RULES:
    r = ref.mxfp4_quantize(case_ties(), rule=rule)
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
      assert np.sum(np.abs(r["scaled"]) == t) >= 34, (rule, t)
    assert np.sum(ref.mxfp4_quantize(case_clamp(), rule=rule)["exponents"] == -127) == 8
  r = ref.mxfp4_quantize(case_saturation(), rule="floor")
  assert np.sum(np.abs(r["scaled"]) > 6) > 20
  # The boundary blocks really straddle a change of exponent for each rule.
  # Triplets (prev, on, next float32) alternate base 2^k (floor changes) and 6 * 2^k (ceil changes).
  for rule, base in (("floor", 0), ("ceil", 1)):
    e = ref.mxfp4_quantize(case_pow2_boundaries(), rule=rule)["exponents"].reshape(-1)[:120].reshape(-1, 3)
    assert np.all(e[base::2, 0] != e[base::2, 2]) and np.all(e[base::2, 1] == e[base::2, 0] + (rule == "floor"))
    assert np.all(e[1 - base::2, 0] == e[1 - base::2, 2])


@pytest.mark.parametrize("axis,jit", [(0, True), (1, True), (-1, True), (-1, False)],
                         ids=["axis0-jit", "axis1-jit", "axis-1-jit", "axis-1-eager"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rule", RULES)
def test_1d_blocks_match_reference(rule, case, axis, jit):
  x = jnp.moveaxis(jnp.asarray(CASES[case]()), -1, axis)
  q = _quantizer(rule, axis, False, jit)(x)
  # 2^-127 * code is a float32 subnormal, which XLA on CPU flushes to zero: skip dequant for the clamp case.
  assert_matches_reference(q, np.asarray(x), axis, rule, check_dequant=(case != "clamp" and jit))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", ["normal", "wide_range", "ties", "bf16"])
def test_2d_blocks_match_reference(rule, case):
  x = jnp.asarray(CASES[case]()).reshape(64, 64)
  for axis in (0, 1):
    q = _quantizer(rule, axis, True, True)(x)
    assert q.scales.shape == (2, 2)
    assert_matches_reference(q, np.asarray(x), axis, rule, block_2d=True)


def test_rules_differ_as_documented():
  """floor: scale 2^(floor(log2 amax_b) - 2), may saturate; ceil: 2^ceil(log2(amax_b / 6)), never above 6."""
  x = jnp.asarray(case_normal())
  qf = _quantizer("floor", -1, False, True)(x)
  qc = _quantizer("ceil", -1, False, True)(x)
  sf, sc = ref.as_f64(qf.scales), ref.as_f64(qc.scales)
  assert np.all((sc == sf) | (sc == 2 * sf))
  amax_b = np.abs(case_normal()).reshape(4, 16, 2, 32).max(-1)
  assert np.all(amax_b / sc <= 6) and np.all(amax_b / sf >= 4) and np.all(amax_b / sf < 8)
  assert fp4jax.get_format("mxfp4") == fp4jax.MXFP4() and fp4jax.get_format("mxfp4_ceil") == fp4jax.MXFP4("ceil")
  assert fp4jax.MXFP4().block_size == 32


def test_zero_block_scale_is_two_to_minus_127():
  x = np.zeros((2, 64), np.float32)
  x[1, :32] = 1.0
  q = _quantizer("floor", -1, False, True)(jnp.asarray(x))
  np.testing.assert_array_equal(ref.as_f64(q.scales), [[2.0**-127, 2.0**-127], [1.0 / 4, 2.0**-127]])
  assert np.all(np.asarray(fp4jax.dequantize(q))[0] == 0)


def test_storage_is_4_25_bits():
  q = _quantizer("floor", -1, False, True)(jnp.asarray(case_normal()))
  assert q.codes.shape == (4, 16, 32) and q.codes.dtype == jnp.uint8
  assert q.nbytes == 4 * 16 * 32 + 4 * 16 * 2 + 4


def _near_max_reference(name, x):
  """(dequantized values, scales) of the float64 reference for the E8M0-scaled format `name`."""
  if name in ("mxfp4", "mxfp4_ceil"):
    r = ref.mxfp4_quantize(x, rule="ceil" if name == "mxfp4_ceil" else "floor")
    return ref.f32(ref.e2m1_value(r["codes"]) * ref.expand(r["scales"], 32, 1, False)), r["scales"]
  if name == "mxfp8":
    r = ref.mxfp8_quantize(x)
    return r["values"], np.ldexp(1.0, r["exponents"])
  r = (rref.mxfp4_quest if name == "mxfp4_quest" else rref.mxfp4_tseng)(x)
  return r["dequant"], r["scales"]


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_ceil", "mxfp4_quest", "mxfp4_tseng", "mxfp8"])
def test_blocks_near_float32_max_stay_finite(name):
  """Blocks with amax above ~2.98e38 (2.84e38 for "tseng", 3.3e38 for MXFP8) decoded to inf: their scale put the
  grid's top past float32 (ceil: 4 * 2^126 = 2^128). Each rule's exponent is capped where the top is finite, so the
  block saturates there, as the reference says; "floor" never reached the cap and keeps its bits."""
  rng = _rng(8)
  x = rng.standard_normal((4, 64)).astype(np.float32)  # rows 2 and 3: ordinary blocks
  for i, a in enumerate([2.6e38, 2.98e38, 3.3e38, F32_MAX]):
    v = rng.uniform(0.3, 1.0, 32) * np.float64(a) * np.resize([1.0, -1.0], 32)  # signs alternate: sigma ~ amax
    v[:2] = [a, -a]
    _set_block(x, i, v)
  want, scales = _near_max_reference(name, x)
  assert np.all(np.isfinite(want))
  fmt = fp4jax.get_format(name)
  q = jax.jit(functools.partial(fp4jax.quantize, fmt=fmt))(jnp.asarray(x))
  np.testing.assert_array_equal(ref.as_f64(q.scales), scales)
  ref.assert_same_bits(_dequantize_jit(q), want)
  ref.assert_same_bits(jax.jit(functools.partial(fp4jax.fake_quant, fmt=fmt))(jnp.asarray(x)), want)


@pytest.mark.parametrize("name, value", [("mxfp4_ceil", 61000.0), ("mxfp4_tseng", 61000.0), ("mxfp8", 65504.0)])
def test_float16_blocks_near_its_max_saturate_in_float16(name, value):
  """A float16 block near 65504 decodes to 65536 (ceil: scale 2^14, top 4 x 2^14; tseng and MXFP8 alike), which
  float16 cannot hold: fake_quant (x's dtype) and dequantize(q, float16) gave inf from finite input. They saturate
  at 65504 now; float32 keeps 65536, and a NaN still poisons the tensor."""
  x = np.full((2, 32), value, np.float16)
  x[1] = -x[1]
  q = fp4jax.quantize(jnp.asarray(x), name)
  wide = np.asarray(fp4jax.dequantize(q))
  assert np.max(np.abs(wide)) == 65536.0  # the format's value, past float16's range
  want = np.clip(wide, -65504.0, 65504.0).astype(np.float16)
  for got in (fp4jax.fake_quant(jnp.asarray(x), name), fp4jax.dequantize(q, jnp.float16)):
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
  x[0, 3] = np.nan
  assert np.all(np.isnan(np.asarray(fp4jax.fake_quant(jnp.asarray(x), name))))
