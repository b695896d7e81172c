"""Pallas FP4 GEMM (interpret mode) vs dequantize-then-matmul in float32 HIGHEST; bit-placement decode vs NumPy;
split-K; cuda lowering (jax 0.10 and 0.11); bad operands.

The kernel's products are exact (code * scale fits bf16) and only the float32 summation order differs, so each
output is compared within 1e-5 of sum_k |a_mk| |b_kn| (the magnitude of what was summed).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp4jax
import reference
from pallas_kernels import fp4_matmul
from pallas_kernels import matmul as matmul_lib
from pallas_kernels import numerics
from pallas_kernels import platform
from pallas_kernels import quantize_nvfp4

HIGHEST = jax.lax.Precision.HIGHEST


def _input(shape, seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray((rng.standard_normal(shape) * np.exp(rng.standard_normal(shape)) * scale).astype(np.float32))


def _dims(contract):
  return (((contract[0],), (contract[1],)), ((), ()))


def _reference(a, b, contract):
  da, db = fp4jax.dequantize(a), fp4jax.dequantize(b)
  ref = jax.lax.dot_general(da, db, _dims(contract), precision=HIGHEST)
  bound = jax.lax.dot_general(jnp.abs(da), jnp.abs(db), _dims(contract), precision=HIGHEST)
  return ref, bound


def _q(x, fmt="nvfp4", **kw):
  """A quantization recipe for one operand, applied inside the test's jit: (x, fmt, kwargs)."""
  return (x, fmt, kw)


def _make(spec):
  x, fmt, kw = spec
  if fmt == "pallas":
    return quantize_nvfp4(x, interpret=True, **kw)
  return fp4jax.quantize(x, fmt, **kw)


def _check_group(cases):
  """cases: (label, a spec, b spec, contract, tiles[, split_k]). Quantization, kernels and references in one jit."""
  cases = [c if len(c) == 6 else (*c, None) for c in cases]

  def run(inputs):
    out = []
    for (xa, xb), (_, (_, fa, ka), (_, fb, kb), c, t, split) in zip(inputs, cases):
      a, b = _make((xa, fa, ka)), _make((xb, fb, kb))
      out.append((fp4_matmul(a, b, contract=c, tiles=t, split_k=split, interpret=True), *_reference(a, b, c)))
    return out

  results = jax.jit(run)([(sa[0], sb[0]) for _, sa, sb, *_ in cases])
  for (label, *_), (out, ref, bound) in zip(cases, results):
    assert out.dtype == jnp.float32, label
    assert out.shape == ref.shape, (label, out.shape, ref.shape)
    assert float(jnp.max(bound)) > 0, f"{label}: operands quantized to all zeros would prove nothing"
    err = np.abs(np.asarray(out) - np.asarray(ref))
    tol = 1e-5 * np.asarray(bound) + 1e-30
    assert np.all(err <= tol), f"{label}: max err / bound {np.max(err / tol) * 1e-5:.2e}"


def test_nvfp4_layouts():
  x, w = _input((48, 96), 0), _input((96, 80), 1)
  cases = [
      ("a[M,K] @ b[K,N], padded M/N/K", _q(x, axis=1), _q(w, axis=0), (1, 0), None),
      ("grid 3x5, 3 K steps", _q(x, axis=1), _q(w, axis=0), (1, 0), (16, 16, 32)),
      ("b 2D packed along K", _q(x, axis=1), _q(w, axis=0, block_2d=True), (1, 0), None),
      ("b 2D packed along N (Dgrad reuse)", _q(x, axis=1), _q(w, axis=1, block_2d=True), (1, 0), (16, 16, 32)),
      ("b given as [N, K]", _q(x, axis=1), _q(w.T, axis=1), (1, 1), None),
      ("a given as [K, M] (Wgrad)", _q(x.T, axis=0), _q(w, axis=0), (0, 0), (16, 16, 32)),
      ("smallest: 1x16 @ 16x16", _q(_input((1, 16), 2)), _q(_input((16, 16), 3), axis=0), (1, 0), None),
      ("gradient-sized values", _q(_input((16, 64), 4, 1e-7)), _q(_input((64, 16), 5, 1e-6), axis=0), (1, 0), None),
  ]
  _check_group(cases)


def test_mxfp4_and_mixed_formats():
  x, w = _input((32, 128), 10), _input((128, 48), 11)
  cases = [
      ("mxfp4 x mxfp4", _q(x, "mxfp4", axis=1), _q(w, "mxfp4", axis=0), (1, 0), None),
      ("mxfp4(ceil) x mxfp4 32x32 packed along N", _q(x, "mxfp4_ceil", axis=1),
       _q(w[:, :32], "mxfp4", axis=1, block_2d=True), (1, 0), (16, 32, 64)),
      ("mxfp4 x nvfp4", _q(x, "mxfp4", axis=1), _q(w, "nvfp4", axis=0), (1, 0), None),
  ]
  _check_group(cases)


def test_column_blocked_operand_against_a_weight_packed_along_n():
  """a [K, M] with 16x1 blocks down K (packed along its contraction axis 0) against a 2D weight packed along N: no
  halves, so a's tile is nibble-joined and transposed, and its scaling blocks must be transposed with it (1x16)."""
  x, w = _input((64, 32), 14), _input((64, 48), 15)
  _check_group([("a[K,M] 1D x b 2D packed along N", _q(x, axis=0), _q(w, axis=1, block_2d=True), (0, 0),
                 (16, 16, 32))])


def test_split_k_odd_shapes():
  """K split across a grid axis (partial products summed in float32), with M, N, K that no tile divides."""
  x, w = _input((37, 208), 12), _input((208, 53), 13)
  cases = [
      ("nvfp4 split 2, 3 K steps per split", _q(x, axis=1), _q(w, axis=0), (1, 0), (16, 16, 32), 2),
      ("nvfp4 2D weight split 3, K padded to 3 x 96", _q(x, axis=1), _q(w, axis=0, block_2d=True, pad=True), (1, 0),
       (16, 16, 32), 3),
      ("Dgrad reuse split 2", _q(x, axis=1), _q(w.T, axis=1, block_2d=True, pad=True), (1, 1), (16, 16, 32), 2),
      ("Wgrad [K, M] split 4", _q(x.T, axis=0), _q(w, axis=0), (0, 0), (32, 64, 32), 4),
      ("mxfp4 split 2", _q(x, "mxfp4", axis=1, pad=True), _q(w, "mxfp4", axis=0, pad=True), (1, 0), (16, 16, 64), 2),
      ("mxfp4 x nvfp4 split 3", _q(x, "mxfp4", axis=1, pad=True), _q(w, axis=0, pad=True), (1, 0), (16, 64, 64), 3),
  ]
  _check_group(cases)


def test_default_split_k():
  # M=16 against a 8192 x 8192 weight: 128 programs of (16, 64) on 132 SMs -> 2 splits of 16 K steps.
  assert matmul_lib.default_split_k(16, 8192, 8192, (16, 64, 256), False, cores=132) == 2
  assert matmul_lib.default_split_k(16, 1024, 8192, (16, 64, 256), False, cores=132) == 16  # 2 K steps each
  assert matmul_lib.default_split_k(8192, 8192, 8192, (128, 128, 128), False, cores=132) == 1
  assert matmul_lib.default_split_k(16, 1024, 256 * 3, (16, 64, 256), False, cores=132) == 1  # no K padding
  assert matmul_lib.default_split_k(16, 1024, 8192, (16, 64, 256), True) == 1  # interpret mode


def test_default_split_k_counts_ragged_tiles_and_keeps_two_k_steps_per_split():
  """default_split_k counts the ragged last row/column tile as a program (M=40 at BM=32 is 2 row tiles, not 1) and
  never splits below 2 K steps per split (a single-program GEMM with 4 K steps gets 2 splits, not 4)."""
  assert matmul_lib.default_split_k(40, 4096, 8192, (32, 64, 256), False, cores=132) == 2  # 128 programs, not 64
  assert matmul_lib.default_split_k(16, 64, 1024, (16, 64, 256), False, cores=132) == 2  # 4 K steps: 2 per split


def test_default_tiles_compiled():
  """Compiled tiles: skinny M (up to 32 rows) gets BM = M rounded up, BN = 64, BK = 256 (long B slabs); larger M
  gets 128x128 output tiles with BK = 128."""
  assert matmul_lib.default_tiles(32, 4096, 4096, False) == (32, 64, 256)
  assert matmul_lib.default_tiles(5, 4096, 4096, False) == (16, 64, 256)
  assert matmul_lib.default_tiles(33, 4096, 4096, False) == (64, 128, 128)


def test_decode_by_bit_placement_is_exact():
  """Every code byte (both nibbles) times every finite E4M3 scale, and E8M0 scales, as the kernel decodes them,
  equals the NumPy float64 product rounded to bf16 (which it must equal exactly: no rounding happens)."""
  codes = np.arange(256, dtype=np.int32)
  e4m3_bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.int32)
  e8m0_bits = np.arange(2, 255, dtype=np.int32)  # 2^-127, 2^-126 * 0.5: float32 subnormals, flushed by XLA on CPU

  @jax.jit
  def run(c, s4, s8):
    nv = matmul_lib.Operand(1, 1, (1, 16), "nvfp4")
    mx = matmul_lib.Operand(1, 1, (1, 32), "mxfp4")
    sc4 = matmul_lib._scale_values(s4.astype(jnp.uint8), nv)
    sc8 = matmul_lib._scale_values(s8.astype(jnp.uint8), mx)
    return tuple(matmul_lib._decode(n[:, None], s[None, :], op) for n in (c & 15, c >> 4)
                 for s, op in ((sc4, nv), (sc8, mx))) + (numerics.e2m1_half_bits(c & 15),)

  *decoded, half_bits = run(jnp.asarray(codes), jnp.asarray(e4m3_bits), jnp.asarray(e8m0_bits))
  s4 = e4m3_bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  s8 = e8m0_bits.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
  refs = [reference.e2m1_value(n)[:, None] * s[None, :] for n in (codes & 15, codes >> 4) for s in (s4, s8)]
  for got, want in zip(decoded, refs):  # 6 * 2^127 overflows to inf in both
    finite = np.abs(want) <= float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert np.array_equal(want[finite], want[finite].astype(ml_dtypes.bfloat16).astype(np.float64)), "not exact"
    got = np.asarray(got)
    assert got.dtype == jnp.bfloat16
    with np.errstate(over="ignore"):
      want_bits = want.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(got.view(np.uint16), want_bits)
  # The half pattern itself: value(code) * 2^-14, code 1 on the half subnormal 2^-15.
  halves = np.asarray(half_bits).astype(np.uint16).view(np.float16).astype(np.float64)
  np.testing.assert_array_equal(halves, reference.e2m1_value(codes & 15) * 2.0**-14)


def test_operands_from_the_pallas_quantizer():
  """The paper's three GEMMs with kernel-quantized operands (Fprop 2D weight, Dgrad reuse, Wgrad RHT + SR)."""
  x, w, dy = _input((32, 64), 20).astype(jnp.bfloat16), _input((64, 48), 21), _input((32, 48), 22, 1e-4)
  key = jax.random.key(0)
  wq = _q(w, "pallas", axis=0, block_2d=True)
  cases = [
      ("fprop", _q(x, "pallas"), wq, (1, 0), None),
      ("dgrad", _q(dy, "pallas", rounding="stochastic", key=key), wq, (1, 1), None),
      ("wgrad", _q(x, "pallas", axis=0, rht_size=16),
       _q(dy, "pallas", axis=0, rht_size=16, rounding="stochastic", key=key), (0, 0), None),
  ]
  _check_group(cases)


@jax.jit
def _padded_and_nonfinite(x, w, x_inf, w2):
  a = fp4jax.quantize(x, "nvfp4", axis=1, pad=True)
  b = fp4jax.quantize(w, "nvfp4", axis=0, pad=True)
  bad = fp4jax.quantize(x_inf, "nvfp4", axis=1)
  good = fp4jax.quantize(w2, "nvfp4", axis=0)
  zero = fp4jax.quantize(jnp.zeros_like(x_inf), "nvfp4", axis=1)
  return (fp4_matmul(a, b), fp4jax.dequantize(a) @ fp4jax.dequantize(b), fp4_matmul(bad, good),
          fp4_matmul(zero, good))


def test_padded_qarrays_and_nonfinite():
  out, ref, nonfinite, zero = _padded_and_nonfinite(
      _input((20, 40), 30), _input((40, 24), 31), _input((16, 32), 32).at[0, 0].set(jnp.inf), _input((32, 16), 33))
  assert out.shape == (20, 24)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
  assert np.all(np.isnan(np.asarray(nonfinite)))
  np.testing.assert_array_equal(np.asarray(zero), 0.0)


@jax.jit
def _extreme_amax(x_tiny, w_tiny, x_huge, w_huge):
  q = lambda v, axis: fp4jax.quantize(v, "nvfp4", axis=axis)
  recipe = fp4jax.recipes.get_recipe("nvfp4").replace(gemm_mode="bf16")  # gemm.scale_output's epilogue
  pairs = ((q(x_tiny, 1), q(w_tiny, 0)), (q(x_huge, 1), q(w_huge, 0)))
  return [(fp4_matmul(a, b), fp4jax.gemm.gemm(a, b, (1, 0), recipe)) for a, b in pairs]


def test_tiny_and_huge_amax_apply_the_tensor_scales_one_at_a_time():
  """amax_a * amax_b / 2688^2 underflows float32 below amax ~ 1e-19 and overflows above ~ 1e22 where the outputs
  do not: applied as one product, all-1e-20 operands gave 0 for outputs of 2.6e-37 and zero rows of 1e23-operands
  gave NaN (0 * inf). Now both factors are applied one at a time, as the XLA path's gemm.scale_output."""
  tiny = jnp.full((16, 256), 3e-20, jnp.float32)
  huge_x = (_input((16, 64), 60) * 1e23).at[0].set(0.0)
  (out_t, ref_t), (out_h, ref_h) = _extreme_amax(tiny, tiny.T, huge_x, _input((64, 16), 61) * 1e23)
  deq = np.float64(fp4jax.dequantize(fp4jax.quantize(tiny, "nvfp4"))[0, 0])
  np.testing.assert_allclose(np.asarray(out_t, np.float64), 256 * deq * deq, rtol=1e-6)  # ~2.3e-37, not 0
  np.testing.assert_allclose(np.asarray(out_t), np.asarray(ref_t), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(out_h)[0], 0.0)  # a zero row stays 0, not NaN
  np.testing.assert_array_equal(np.isinf(np.asarray(out_h)), np.isinf(np.asarray(ref_h)))
  assert not np.any(np.isnan(np.asarray(out_h)))


def _abstract(shape, fmt="nvfp4", **kw):
  """A QArray of ShapeDtypeStructs: enough to trace, validate and lower without computing anything."""
  return jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, **kw), jax.ShapeDtypeStruct(shape, jnp.float32))


def test_bad_operands_raise():
  a, b = _abstract((16, 32), axis=1), _abstract((32, 16), axis=0)

  def call(a, b, **kw):
    return jax.eval_shape(lambda a, b: fp4_matmul(a, b, interpret=True, **kw), a, b)

  with pytest.raises(ValueError, match="1D blocks must run along the contraction axis"):
    call(a, _abstract((32, 16), axis=1))
  with pytest.raises(ValueError, match="contraction lengths differ"):
    call(a, _abstract((48, 16), axis=0))
  with pytest.raises(ValueError, match="NVFP4 or MXFP4"):
    call(a, _abstract((32, 16), "fp8", axis=0, pad=True))
  with pytest.raises(ValueError, match="2D"):
    call(_abstract((2, 16, 32)), b)
  with pytest.raises(ValueError, match="QArray"):
    call(jnp.ones((16, 32)), b)
  with pytest.raises(ValueError, match="power of two"):
    call(a, b, tiles=(24, 16, 32))
  with pytest.raises(ValueError, match="block size"):
    call(_abstract((16, 64), "mxfp4", axis=1), _abstract((64, 32), "mxfp4", axis=1, block_2d=True),
         tiles=(16, 16, 32))
  with pytest.raises(ValueError, match=r"contract is \(a's contraction axis, b's\)"):  # was a bare IndexError
    call(a, b, contract=(1,))
  with pytest.raises(ValueError, match="split_k must be a positive int"):
    call(a, b, split_k=0)
  for tiles in ((16, 16), (16.0, 16, 32), (16, True, 32), 16):  # were unpacking and operator TypeErrors
    with pytest.raises(ValueError, match=r"tiles must be None or \(BM, BN, BK\)"):
      call(a, b, tiles=tiles)
  assert call(a, b).shape == (16, 16) and call(a, b, split_k=np.int64(1)).shape == (16, 16)
  assert call(a, b, tiles=[16, np.int64(16), 32]).shape == (16, 16)


def test_scale_rules_beyond_nvidias():
  """4/6 (E4M3 bound 256), unbiased-SR "up", 16/17 headroom and MS-EDEN tensor scales (amax / the format's range),
  and Tseng's 4/3 MXFP4 factor: the epilogue's per-tensor factor is the format's (NVIDIA's amax / 2688 gave 4/6
  products 67 % off)."""
  x, w = _input((32, 128), 40), _input((128, 48), 41)
  four_six, up = fp4jax.NVFP4(scale_rule="4over6"), fp4jax.NVFP4(scale_rule="up", headroom=True)
  eden = fp4jax.NVFP4(scale_rule="eden", eden_group=32)
  tseng = fp4jax.MXFP4(scale_rule="tseng")
  cases = [
      ("4/6 x 4/6 2D", _q(x, four_six, axis=1), _q(w, four_six, axis=0, block_2d=True), (1, 0), None),
      ("up+16/17 (SR) x nvfp4", _q(x, up, axis=1, rounding="stochastic", key=jax.random.key(0)),
       _q(w, "nvfp4", axis=0), (1, 0), None),
      ("MS-EDEN x 4/6", _q(x, eden, axis=1), _q(w, four_six, axis=0), (1, 0), None),
      ("tseng x tseng", _q(x, tseng, axis=1), _q(w, tseng, axis=0), (1, 0), None),
  ]
  _check_group(cases)


def _grouped_input(shape, seed, axis):
  """_input with each 128-run along `axis` scaled by its own power of 16 (1, 16^-3, 16^2, ...), so that the 1x128
  group amaxes differ by orders of magnitude and a group factor applied to the wrong group shows."""
  x = np.asarray(_input(shape, seed))
  groups = np.arange(shape[axis]) // 128
  gain = 16.0 ** np.array([0, -3, 2, -1, 3, -2])[groups % 6]
  return jnp.asarray(x * np.expand_dims(gain, 1 - axis).astype(np.float32))


DOUBLE = fp4jax.NVFP4(double_block=True)


def test_double_block_layouts():
  """NVFP4 double-block (TetraJet-v2: an FP32 scale per 1x128 group): each K step is one group, scaled by both
  operands' group factors. Fprop, Wgrad (both contracted on axis 0), b as [N, K] with a partial last group, mixed
  with NVFP4 2D blocks and with MXFP4 (a tensor factor per step), and split-K with K padded to whole groups."""
  x, w = _grouped_input((48, 384), 50, 1), _grouped_input((384, 40), 51, 0)
  x_t = _grouped_input((384, 48), 52, 0)
  x_p, w_nk = _grouped_input((24, 208), 54, 1), _grouped_input((40, 208), 55, 1)
  cases = [
      ("a[M,K] @ b[K,N], 3 groups", _q(x, DOUBLE, axis=1), _q(w, DOUBLE, axis=0), (1, 0), None),
      ("Wgrad: a[K,M], b[K,N]", _q(x_t, DOUBLE, axis=0), _q(w, DOUBLE, axis=0), (0, 0), (16, 16, 128)),
      ("b[N,K], K = 208: a partial second group", _q(x_p, DOUBLE, axis=1), _q(w_nk, DOUBLE, axis=1), (1, 1), None),
      ("nvfp4 2D x double-block", _q(x, "nvfp4", axis=1, block_2d=True), _q(w, DOUBLE, axis=0), (1, 0), None),
      ("double-block x mxfp4", _q(x, DOUBLE, axis=1), _q(w, "mxfp4", axis=0), (1, 0), None),
      ("split-K 3 (K padded to 3 x 128)", _q(x, DOUBLE, axis=1), _q(w, DOUBLE, axis=0), (1, 0), (16, 32, 128), 3),
  ]
  _check_group(cases)


def test_double_block_matches_the_xla_grouped_gemm():
  """The kernel computes what the XLA path's gemm.grouped_gemm computes (per group: the exact products summed in
  float32, times a's then b's group factor, added in group order); only the order within a group differs."""
  from fp4jax import gemm
  x, w = _grouped_input((32, 512), 56, 1), _grouped_input((512, 48), 57, 0)

  @jax.jit
  def both(x, w):
    a, b = fp4jax.quantize(x, DOUBLE, axis=1), fp4jax.quantize(w, DOUBLE, axis=0)
    grouped = gemm.grouped_gemm(gemm.bf16_values(a), gemm.bf16_values(b), (1, 0))
    return fp4_matmul(a, b, interpret=True), grouped, *_reference(a, b, (1, 0))

  out, grouped, ref, bound = (np.asarray(v) for v in both(x, w))
  assert np.all(np.abs(out - grouped) <= 1e-6 * bound)
  # Against the dequantized reference the two differ by about as much: neither is the other's rounding of it.
  assert np.max(np.abs(out - ref) / bound) < 1e-6 and np.max(np.abs(grouped - ref) / bound) < 1e-6


def test_double_block_nonfinite_group_poisons_the_output():
  """A non-finite 1x128 group amax makes the whole output NaN (dequantize poisons the whole tensor); a zero group
  (amax 0, factor 0) contributes 0."""
  x, w = np.asarray(_grouped_input((16, 256), 58, 1)), _grouped_input((256, 32), 59, 0)
  x_inf, x_zero = x.copy(), x.copy()
  x_inf[3, 200] = np.inf
  x_zero[:, 128:] = 0.0

  @jax.jit
  def run(x_inf, x_zero, w):
    b = fp4jax.quantize(w, DOUBLE, axis=0)
    a_inf, a_zero = fp4jax.quantize(x_inf, DOUBLE, axis=1), fp4jax.quantize(x_zero, DOUBLE, axis=1)
    return fp4_matmul(a_inf, b, interpret=True), fp4_matmul(a_zero, b, interpret=True), *_reference(a_zero, b, (1, 0))

  poisoned, zero_group, ref, bound = (np.asarray(v) for v in run(jnp.asarray(x_inf), jnp.asarray(x_zero), w))
  assert np.all(np.isnan(poisoned))
  assert np.all(np.abs(zero_group - ref) <= 1e-6 * bound)


def test_double_block_needs_one_k_step_per_group():
  a, b = _abstract((16, 256), DOUBLE, axis=1), _abstract((256, 16), DOUBLE, axis=0)
  with pytest.raises(ValueError, match="BK = 128"):
    jax.eval_shape(lambda a, b: fp4_matmul(a, b, interpret=True, tiles=(16, 16, 256)), a, b)
  with pytest.raises(ValueError, match="1D blocks must run along the contraction axis"):
    jax.eval_shape(lambda a, b: fp4_matmul(a, b, interpret=True), a, _abstract((256, 16), DOUBLE, axis=1))


@pytest.mark.parametrize("kind", ["nvfp4_1d", "nvfp4_2d_dgrad", "wgrad_transposed", "mxfp4", "double_block",
                                  "double_block_wgrad"])
def test_lowers_for_cuda(kind):
  if kind == "double_block":  # split into 2: the group factors' blocks follow the split
    a, b, c = _abstract((256, 512), DOUBLE, axis=1), _abstract((512, 128), "nvfp4", axis=0), (1, 0)
  elif kind == "double_block_wgrad":
    a, b, c = _abstract((384, 256), DOUBLE, axis=0), _abstract((384, 128), DOUBLE, axis=0), (0, 0)
  elif kind == "nvfp4_1d":
    a, b, c = _abstract((256, 192), axis=1), _abstract((192, 128), axis=0), (1, 0)
  elif kind == "nvfp4_2d_dgrad":
    a, b, c = _abstract((256, 128), axis=1), _abstract((192, 128), axis=0, block_2d=True), (1, 1)
  elif kind == "wgrad_transposed":
    a, b, c = _abstract((192, 256), axis=0), _abstract((192, 128), axis=0), (0, 0)
  else:
    a, b, c = _abstract((256, 192), "mxfp4", axis=1), _abstract((192, 128), "mxfp4", axis=0), (1, 0)
  split = 2 if kind in ("nvfp4_1d", "double_block") else None
  f = lambda a, b: fp4_matmul(a, b, contract=c, interpret=False, use_blackwell=False, split_k=split)
  text = platform.lower_for_cuda(f, a, b).as_text()  # jax 0.11 needs an abstract GPU here: see lower_for_cuda
  assert text.count("xla.gpu.triton") == 1


def test_compiled_launch_uses_8_warps_from_128x128_tiles():
  """num_warps defaults to 8 on output tiles of at least 128x128 (the in-register decode of two tiles needs the
  threads) and 4 below; num_stages to 3. Read off the Triton call lowered for cuda."""
  a, b = _abstract((256, 256), axis=1), _abstract((256, 256), axis=0)
  for tiles, warps in (((128, 128, 128), 8), ((64, 128, 128), 4)):
    f = lambda a, b, t=tiles: fp4_matmul(a, b, interpret=False, use_blackwell=False, tiles=t)
    text = platform.lower_for_cuda(f, a, b).as_text()
    assert f"num_warps = {warps} : i32" in text and "num_stages = 3 : i32" in text, tiles


def test_blackwell_path_applies_both_global_scales(monkeypatch):
  """fp4_matmul's Blackwell branch around an XLA stand-in for scaled_matmul (code x block scale products, no global
  scales): the epilogue must apply a's and b's amax / 2688 once each (operands 1e5 apart expose a lost or doubled
  factor). The branch itself runs only on compute capability >= 10."""
  def stand_in(a, b, op_a, op_b):
    (lhs, ls), (rhs, rs) = matmul_lib.blackwell_operand(a, op_a), matmul_lib.blackwell_operand(b, op_b)
    scaled = lambda v, s: v[0].astype(jnp.float32) * jnp.repeat(s[0].astype(jnp.float32), 16, axis=-1)
    return jnp.dot(scaled(lhs, ls), scaled(rhs, rs).T, precision=HIGHEST)

  monkeypatch.setattr(matmul_lib, "blackwell_matmul", stand_in)
  a = fp4jax.quantize(_input((32, 64), 42) * 1e3, "nvfp4", axis=1)
  b = fp4jax.quantize(_input((64, 48), 43) * 1e-2, "nvfp4", axis=0)
  out = fp4_matmul(a, b, interpret=True, use_blackwell=True)
  ref = jnp.dot(fp4jax.dequantize(a), fp4jax.dequantize(b), precision=HIGHEST)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_blackwell_path_takes_only_1d_nvfp4_without_group_scales(monkeypatch):
  """use_blackwell=True sends only NVFP4 x NVFP4 with 1D blocks and one tensor amax to scaled_matmul: double-block
  (1x128 group) operands have no per-tensor factor for its epilogue, and stay on the Pallas kernel."""
  def refuse(*_):
    raise AssertionError("the Blackwell path took an operand it does not cover")

  monkeypatch.setattr(matmul_lib, "blackwell_matmul", refuse)

  @jax.jit
  def run(x, w):
    a, b = fp4jax.quantize(x, DOUBLE, axis=1), fp4jax.quantize(w, DOUBLE, axis=0)
    return fp4_matmul(a, b, interpret=True, use_blackwell=True), *_reference(a, b, (1, 0))

  out, ref, bound = (np.asarray(v) for v in run(_grouped_input((16, 256), 62, 1), _grouped_input((256, 16), 63, 0)))
  assert np.all(np.abs(out - ref) <= 1e-5 * bound)


def test_blackwell_path_lowers_and_its_operands_are_exact():
  """The cc >= 10 path (jax.nn.scaled_matmul) cannot run here: check it lowers for cuda to the block-scaled dot,
  and that the operands it builds give the reference product under scaled_matmul's documented semantics."""
  op_a, op_b = matmul_lib.Operand(1, 1, (1, 16), "nvfp4"), matmul_lib.Operand(0, 0, (16, 1), "nvfp4")
  a_abs, b_abs = _abstract((32, 64), axis=1), _abstract((64, 48), axis=0)
  text = platform.lower_for_cuda(lambda a, b: matmul_lib.blackwell_matmul(a, b, op_a, op_b), a_abs, b_abs).as_text()
  assert "block_scaled_dot" in text or "scaled_matmul" in text

  @jax.jit
  def emulate(x, w):
    a, b = fp4jax.quantize(x, "nvfp4", axis=1), fp4jax.quantize(w, "nvfp4", axis=0)
    (lhs, ls), (rhs, rs) = matmul_lib.blackwell_operand(a, op_a), matmul_lib.blackwell_operand(b, op_b)
    assert lhs.dtype == jnp.float4_e2m1fn and ls.dtype == jnp.float8_e4m3fn and lhs.shape == (1, 32, 64)
    scaled = lambda v, s: v[0].astype(jnp.float32) * jnp.repeat(s[0].astype(jnp.float32), 16, axis=-1)
    out = jnp.dot(scaled(lhs, ls), scaled(rhs, rs).T, precision=HIGHEST) * (a.amax / 2688) * (b.amax / 2688)
    return out, jnp.dot(fp4jax.dequantize(a), fp4jax.dequantize(b), precision=HIGHEST)

  out, ref = emulate(_input((32, 64), 40), _input((64, 48), 41))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
