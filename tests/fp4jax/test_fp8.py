"""FP8 E4M3 (per-tensor, 1x128 and 128x128 blocks) vs the NumPy reference, bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
import reference as ref
from op_by_op import op_by_op

FLT_MAX = np.float32(np.finfo(np.float32).max)


def _rng(seed):
  return np.random.default_rng(seed)


def _rows(rows):
  """[32, 256] rows (two 128-blocks each) -> [2, 16, 256]."""
  return np.asarray(rows, np.float32).reshape(2, 16, 256)


def case_normal():
  return _rows(_rng(0).standard_normal((32, 256)))


def case_student_t():
  return _rows(_rng(1).standard_t(2, (32, 256)))


def case_zero_blocks():
  x = _rng(2).standard_normal((32, 256)).astype(np.float32)
  x[0, :128] = 0.0
  x[3, 128:] = -0.0
  return _rows(x)


def case_all_zero():
  return _rows(np.zeros((32, 256)))


def case_wide_range():
  rng = _rng(3)
  mags = 10.0**rng.uniform(-6, 6, (32, 2))
  return _rows(rng.standard_normal((32, 256)) * np.repeat(mags, 128, axis=1))


def case_e4m3_ties():
  """Blocks with amax 448 (factor exactly 1) or 224 (factor 2): elements on E4M3 midpoints, subnormals included."""
  rng = _rng(4)
  allv = np.unique(np.abs(ref.e4m3_rne(np.ldexp(np.arange(0, 16), -9)[None, :] * np.ldexp(1.0, np.arange(0, 16))[:, None])))
  allv = allv[allv <= 448]
  mids = (allv[1:] + allv[:-1]) / 2
  x = rng.standard_normal((32, 256)).astype(np.float32)
  for i in range(16):
    top = 448.0 if i % 2 == 0 else 224.0
    v = rng.choice(mids[mids < top], 128) * rng.choice([-1, 1], 128)
    if top == 224.0:
      v = v / 2  # x * 2 is then a midpoint
    v[0] = top
    x[i // 2, 128 * (i % 2):128 * (i % 2) + 128] = v
  return _rows(x)


def case_underflow():
  """Elements far below the block amax: E4M3 subnormals and flush to zero."""
  rng = _rng(5)
  x = (rng.standard_normal((32, 256)) * 10.0**rng.uniform(-7, 0, (32, 256))).astype(np.float32)
  x[:, 0] = 3.0
  return _rows(x)


CASES = {
    "normal": case_normal,
    "student_t": case_student_t,
    "zero_blocks": case_zero_blocks,
    "all_zero": case_all_zero,
    "wide_range": case_wide_range,
    "e4m3_ties": case_e4m3_ties,
    "underflow": case_underflow,
    "bf16": lambda: jnp.asarray(case_student_t(), jnp.bfloat16),
}


@functools.cache
def _quantizer(scaling, axis, block_2d, jit):
  f = functools.partial(fp4jax.quantize, fmt=fp4jax.FP8(scaling=scaling), axis=axis, block_2d=block_2d)
  return jax.jit(f) if jit else op_by_op(f)


_dequantize_jit = jax.jit(fp4jax.dequantize)


def assert_matches_reference(q, x, scaling, axis, block_2d=False):
  r = ref.fp8_quantize(x, scaling=scaling, axis=axis, block_2d=block_2d)
  assert q.codes.dtype == jnp.float8_e4m3fn and q.codes.shape == x.shape
  codes = ref.as_f64(q.codes)
  np.testing.assert_array_equal(codes, r["codes"])
  np.testing.assert_array_equal(np.signbit(codes), np.signbit(r["codes"]))
  assert q.scales.dtype == jnp.float32 and q.scales.size == np.size(r["scales"])
  # Layout of the per-tensor scale is checked in test_per_tensor_scale_is_a_scalar; values here.
  np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float64).reshape(np.shape(r["scales"])), r["scales"])
  np.testing.assert_array_equal(np.float64(q.amax), r["amax"])
  want = ref.fp8_dequantize(r["codes"], r["scales"], scaling=scaling, axis=axis, block_2d=block_2d)
  ref.assert_same_bits(fp4jax.dequantize(q), want)
  ref.assert_same_bits(_dequantize_jit(q), want)


def test_ties_case_hits_midpoints():
  x = case_e4m3_ties()
  r = ref.fp8_quantize(x, axis=-1)
  v = ref.f32(x.reshape(-1, 128)[:16] * np.tile([1.0, 2.0], 8)[:, None])
  assert np.all(r["scales"].reshape(-1)[:16] == np.tile([1.0, 0.5], 8))
  lo, hi = ref.e4m3_rne(v * (1 - 2.0**-30)), ref.e4m3_rne(v * (1 + 2.0**-30))
  assert np.sum(lo != hi) > 1500  # almost every element sits exactly on a rounding boundary


@pytest.mark.parametrize("axis,jit", [(0, True), (1, True), (-1, True), (-1, False)],
                         ids=["axis0-jit", "axis1-jit", "axis-1-jit", "axis-1-eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_1x128_blocks_match_reference(case, axis, jit):
  x = jnp.moveaxis(jnp.asarray(CASES[case]()), -1, axis)
  q = _quantizer("block", axis, False, jit)(x)
  assert q.scales.shape == tuple(np.moveaxis(np.zeros((2, 16, 2)), -1, axis).shape)
  assert_matches_reference(q, np.asarray(x), "block", axis)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_per_tensor_matches_reference(case, jit):
  x = jnp.asarray(CASES[case]())
  q = _quantizer("tensor", -1, False, jit)(x)
  assert_matches_reference(q, np.asarray(x), "tensor", -1)


@pytest.mark.parametrize("case", ["normal", "student_t", "wide_range", "e4m3_ties", "bf16"])
def test_128x128_blocks_match_reference(case):
  x = jnp.asarray(CASES[case]()).reshape(128, 64)
  x = jnp.concatenate([x, x[:, ::-1] * 3], axis=1)[:, :128]
  x = jnp.concatenate([x, x * 1e-3], axis=0)  # [256, 128]: two 128x128 blocks of different scale
  for axis in (0, -1):
    q = _quantizer("block", axis, True, True)(x)
    assert q.scales.shape == (2, 1)
    assert_matches_reference(q, np.asarray(x), "block", axis, block_2d=True)


def test_per_tensor_scale_is_a_scalar():
  """core_api.md: FP8 "tensor" scales have shape ()."""
  q = _quantizer("tensor", -1, False, True)(jnp.asarray(case_normal()))
  assert q.scales.shape == ()


def test_scale_is_float32_division_not_reciprocal_multiply():
  """scale = f32(amax_blk / 448). XLA turns `x / c` (c a scalar or broadcast constant) into x * f32(1/c), which is
  off by one ulp for about half of all inputs; 64 random block maxima make a miss practically impossible."""
  amax = np.random.default_rng(11).uniform(0.5, 2.0, 64).astype(np.float32)
  x = np.zeros((64, 128), np.float32)
  x[:, 0] = amax
  for jit in (False, True):
    q = _quantizer("block", -1, False, jit)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(q.scales)[:, 0], amax / np.float32(448))


def test_formats_and_storage():
  assert fp4jax.get_format("fp8") == fp4jax.FP8() and fp4jax.get_format("fp8_tensor") == fp4jax.FP8("tensor")
  assert fp4jax.FP8().block_size == 128
  q = _quantizer("block", -1, False, True)(jnp.asarray(case_normal()))
  assert q.nbytes == 2 * 16 * 256 + 2 * 16 * 2 * 4 + 4


@pytest.mark.parametrize("scaling", ["block", "tensor"])
def test_fp8_tiny_amax_encode_factor_is_clamped_to_flt_max(scaling):
  """amax < 448 / FLT_MAX: the encode factor is FLT_MAX, not inf, so zeros stay 0 (not 0 * inf = NaN)."""
  x = np.zeros((2, 256), np.float32)
  x[0, :3] = [1e-37, -5e-38, 2e-38]
  _, encode = fp4jax.fp8.scales(jnp.asarray([np.float32(1e-37), np.float32(0.0)]))
  np.testing.assert_array_equal(np.asarray(encode), [FLT_MAX, 1.0])
  q = fp4jax.quantize(jnp.asarray(x), fp4jax.FP8(scaling=scaling))
  x_hat = np.asarray(fp4jax.dequantize(q))
  assert np.all(np.isfinite(np.asarray(q.codes, np.float32))) and np.all(np.isfinite(x_hat))
  assert np.all(x_hat[x == 0] == 0)


@pytest.mark.parametrize("block_size", [0, -128])
def test_fp8_non_positive_block_size_is_refused(block_size):
  """FP8 blocks hold at least one element: block_size 0 (or negative) is refused when the format is built, not left
  to fail (or divide by zero) in the quantizer's reshape."""
  with pytest.raises(ValueError, match=f"FP8 block_size must be a positive int; got {block_size}"):
    fp4jax.FP8(block_size=block_size)
  assert fp4jax.FP8(block_size=1).block_size == 1  # the smallest block is allowed


@pytest.mark.parametrize("block_size", [16, 64])
def test_mxfp8_block_size_other_than_32_is_refused(block_size):
  """OCP MXFP8 has one E8M0 scale per 32 elements: other block sizes are refused, not run as non-OCP blocks."""
  with pytest.raises(ValueError, match=f"MXFP8 uses 32-element blocks; got block_size={block_size}"):
    fp4jax.MXFP8(block_size=block_size)
  assert fp4jax.MXFP8(block_size=32) == fp4jax.MXFP8()
