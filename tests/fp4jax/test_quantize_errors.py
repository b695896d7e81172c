"""Bad inputs raise ValueError naming the problem; pad=True; the NaN/inf policy (loud failure, never a silent +6)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.dot_general import derive_layer_keys
import reference as ref
from op_by_op import op_by_op

FORMATS = {
    "nvfp4": fp4jax.NVFP4(),
    "mxfp4": fp4jax.MXFP4(),
    "fp8_block": fp4jax.FP8(),
    "fp8_tensor": fp4jax.FP8(scaling="tensor"),
}


def _x(shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@functools.cache
def _jq(fmt, **kwargs):
  return jax.jit(functools.partial(fp4jax.quantize, fmt=fmt, **kwargs))


_jdq = jax.jit(fp4jax.dequantize)


# ---------------------------------------------------------------- divisibility and pad=True


@pytest.mark.parametrize("fmt,shape,kwargs", [
    (fp4jax.NVFP4(), (4, 40), {}),
    (fp4jax.NVFP4(), (40, 16), {"axis": 0}),
    (fp4jax.NVFP4(), (40, 32), {"block_2d": True}),
    (fp4jax.NVFP4(), (32, 40), {"block_2d": True, "axis": 0}),
    (fp4jax.MXFP4(), (4, 48), {}),
    (fp4jax.FP8(), (4, 200), {}),
    (fp4jax.FP8(), (128, 200), {"block_2d": True}),
])
def test_axis_not_divisible_by_block_size_raises(fmt, shape, kwargs):
  with pytest.raises(ValueError, match="pad=True"):
    fp4jax.quantize(_x(shape), fmt, **kwargs)


@pytest.mark.parametrize("fmt,shape,kwargs,padded", [
    (fp4jax.NVFP4(), (3, 40), {}, (3, 48)),
    (fp4jax.NVFP4(), (40, 3), {"axis": 0}, (48, 3)),
    (fp4jax.NVFP4(), (40, 20), {"block_2d": True}, (48, 32)),
    (fp4jax.MXFP4(), (3, 40), {}, (3, 64)),
    (fp4jax.FP8(), (3, 200), {}, (3, 256)),
])
def test_pad_true_pads_with_zeros_and_crops_back(fmt, shape, kwargs, padded):
  x = -jnp.abs(_x(shape, seed=1)) - 0.5  # all negative: padding zeros must not become the amax's sign or value
  q = _jq(fmt, pad=True, **kwargs)(x)
  assert q.shape == padded and q.orig_shape == shape
  np.testing.assert_array_equal(np.float32(q.amax), np.max(np.abs(np.asarray(x))))
  deq = _jdq(q)
  assert deq.shape == shape
  # Same values as quantizing the explicitly zero-padded tensor, then cropping.
  x_pad = jnp.pad(x, [(0, p - s) for s, p in zip(shape, padded)])
  q_pad = _jq(fmt, **kwargs)(x_pad)
  crop = tuple(slice(0, s) for s in shape)
  np.testing.assert_array_equal(np.asarray(deq), np.asarray(_jdq(q_pad))[crop])
  if isinstance(fmt, fp4jax.NVFP4):
    r = ref.nvfp4_quantize(np.asarray(x_pad), axis=kwargs.get("axis", -1), block_2d=kwargs.get("block_2d", False))
    np.testing.assert_array_equal(np.asarray(q.unpacked_codes()), r["codes"])
    pad_mask = np.ones(padded, bool)
    pad_mask[crop] = False
    assert np.all(r["codes"][pad_mask] == 0)


def test_pad_true_is_a_no_op_when_divisible():
  x = _x((4, 32))
  q, q_pad = _jq(fp4jax.NVFP4())(x), _jq(fp4jax.NVFP4(), pad=True)(x)
  assert q_pad.shape == q.shape == (4, 32)
  np.testing.assert_array_equal(np.asarray(q_pad.codes), np.asarray(q.codes))


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_unsupported_dtype_raises(dtype, fmt):
  x = jnp.ones((4, 256), dtype)
  with pytest.raises(ValueError, match="dtype"):
    fp4jax.quantize(x, FORMATS[fmt])
  with pytest.raises(ValueError, match="dtype"):
    fp4jax.fake_quant(x, FORMATS[fmt])


def test_float64_raises_under_x64():
  """float64 only exists with jax_enable_x64; the API accepts float32/bfloat16/float16 only."""
  with jax.enable_x64(True):
    x = jnp.ones((4, 32), jnp.float64)
    assert x.dtype == jnp.float64
    with pytest.raises(ValueError, match="dtype"):
      fp4jax.quantize(x, fp4jax.NVFP4())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_supported_dtypes_are_accepted(dtype):
  q = fp4jax.quantize(_x((4, 32), dtype=dtype), fp4jax.NVFP4())
  assert q.dtype == dtype and fp4jax.dequantize(q, dtype).dtype == dtype


# ---------------------------------------------------------------- options


def test_stochastic_without_key_raises():
  with pytest.raises(ValueError, match="key"):
    fp4jax.quantize(_x((4, 32)), fp4jax.NVFP4(), rounding="stochastic")
  with pytest.raises(ValueError, match="key"):
    fp4jax.fake_quant(_x((4, 32)), fp4jax.NVFP4(), rounding="stochastic")


@pytest.mark.parametrize("rounding", ["banana", "rne", "Stochastic", "", None])
def test_unknown_rounding_raises(rounding):
  with pytest.raises(ValueError, match="rounding"):
    fp4jax.quantize(_x((4, 32)), fp4jax.NVFP4(), rounding=rounding, key=jax.random.key(0))


@pytest.mark.parametrize("random_bits", [0, 7, 16, 64])
def test_unsupported_random_bits_raises(random_bits):
  with pytest.raises(ValueError, match="random_bits"):
    fp4jax.quantize(_x((4, 32)), fp4jax.NVFP4(), rounding="stochastic", key=jax.random.key(0),
                    random_bits=random_bits)


@pytest.mark.parametrize("name", ["nvfp5", "fp4", "", "NVFP4 "])
def test_unknown_format_name_raises(name):
  with pytest.raises(ValueError, match="format"):
    fp4jax.get_format(name)
  with pytest.raises(ValueError, match="format"):
    fp4jax.quantize(_x((4, 32)), name)


@pytest.mark.parametrize("fmt", [None, 42, "int4", jnp.float8_e4m3fn])
def test_not_a_format_raises(fmt):
  with pytest.raises(ValueError, match="format"):
    fp4jax.quantize(_x((4, 32)), fmt)


def test_bad_format_fields_raise():
  with pytest.raises(ValueError, match="scale_rule"):
    fp4jax.quantize(_x((4, 32)), fp4jax.MXFP4(scale_rule="round"))
  with pytest.raises(ValueError, match="scaling"):
    fp4jax.quantize(_x((4, 128)), fp4jax.FP8(scaling="channel"))


@pytest.mark.parametrize("shape,kwargs", [
    ((4, 32), {"axis": 2}),
    ((4, 32), {"axis": -3}),
    ((2, 32, 32), {"axis": 0, "block_2d": True}),
    ((32,), {"block_2d": True}),
])
def test_bad_axis_raises(shape, kwargs):
  with pytest.raises(ValueError, match="axis|block_2d"):
    fp4jax.quantize(_x(shape), fp4jax.NVFP4(), **kwargs)


def test_scalar_input_raises():
  with pytest.raises(ValueError):
    fp4jax.quantize(jnp.float32(1.0), fp4jax.NVFP4())


@pytest.mark.parametrize("axis", [None, 1.0, "1", True])
def test_axis_that_is_not_an_int_raises(axis):
  with pytest.raises(ValueError, match="axis must be an int"):
    fp4jax.quantize(_x((4, 32)), fp4jax.NVFP4(), axis=axis)
  assert fp4jax.quantize(_x((16, 32)), fp4jax.NVFP4(), axis=np.int64(0)).axis == 0


@pytest.mark.parametrize("kwargs", [{"block_2d": "false"}, {"block_2d": 1}, {"pad": "no"}, {"pad": None}])
def test_flags_that_are_not_bools_raise(kwargs):
  """A string flag is truthy: "false" quantized as block_2d=True, and "no" padded."""
  name = next(iter(kwargs))
  for fn in (fp4jax.quantize, fp4jax.fake_quant):
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
      fn(_x((16, 20)), fp4jax.NVFP4(), **kwargs)
  assert fp4jax.quantize(_x((16, 32)), fp4jax.NVFP4(), block_2d=np.bool_(True), pad=np.bool_(False)).block_2d


@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (0,)])
def test_empty_input_raises(shape):
  with pytest.raises(ValueError, match="empty"):
    fp4jax.quantize(jnp.zeros(shape), fp4jax.NVFP4())


@pytest.mark.parametrize("fn", [fp4jax.quantize, fp4jax.fake_quant])
def test_a_key_with_round_to_nearest_raises(fn):
  """A key means the caller wants stochastic rounding: never silently round to nearest instead."""
  with pytest.raises(ValueError, match="rounding='stochastic'"):
    fn(_x((4, 32)), fp4jax.NVFP4(), key=jax.random.key(1))


def test_keys_the_quantizer_cannot_use_raise_naming_the_argument():
  x = _x((4, 32))
  with pytest.raises(ValueError, match=r"key must be.*2 words"):  # rbg-width raw data under threefry
    fp4jax.quantize(x, fp4jax.NVFP4(), rounding="stochastic", key=jnp.zeros(4, jnp.uint32))
  with pytest.raises(ValueError, match=r"key must be.*LayerKeys.*derived from"):
    fp4jax.quantize(x, fp4jax.NVFP4(), rounding="stochastic", key=derive_layer_keys(jax.random.key(0)))
  raw = fp4jax.quantize(x, fp4jax.NVFP4(), rounding="stochastic", key=jax.random.PRNGKey(3))
  typed = fp4jax.quantize(x, fp4jax.NVFP4(), rounding="stochastic", key=jax.random.wrap_key_data(
      jax.random.PRNGKey(3)))
  np.testing.assert_array_equal(np.asarray(raw.codes), np.asarray(typed.codes))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.bool_, jnp.complex64])
def test_dequantize_to_a_non_float_dtype_raises(dtype):
  with pytest.raises(ValueError, match="floating-point"):
    fp4jax.dequantize(fp4jax.quantize(_x((4, 32)), fp4jax.NVFP4()), dtype)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_dequantize_to_an_8_bit_float_is_refused(dtype):
  """It passed the floating-point check, then failed inside the jitted body with a type-promotion error."""
  with pytest.raises(ValueError, match="float32, bfloat16, float16 or float64 values; got dtype=float8"):
    fp4jax.dequantize(fp4jax.quantize(_x((4, 32)), fp4jax.NVFP4()), dtype)


@pytest.mark.parametrize("shape,fmt,kwargs", [((40, 40), "nvfp4", {}), ((40, 40), "nvfp4", {"block_2d": True}),
                                              ((8, 40), "nvfp4", {"axis": 0}), ((3, 200), "fp8", {}),
                                              ((64, 96), "mxfp4", {"block_2d": True}), ((5, 64), "fp8_tensor", {})])
def test_num_blocks_is_the_scales_size_of_quantize(shape, fmt, kwargs):
  x = _x(shape)
  q = fp4jax.quantize(x, fmt, pad=True, **kwargs)
  assert fp4jax.num_blocks(shape, fmt, pad=True, **kwargs) == q.scales.size
  assert fp4jax.pad_to_blocks(x, fmt, **kwargs).shape == q.shape


def test_num_blocks_and_pad_to_blocks_check_shapes_as_quantize_does():
  with pytest.raises(ValueError, match="pad=True"):
    fp4jax.num_blocks((40, 40), "nvfp4")  # not whole blocks, as quantize without pad
  with pytest.raises(ValueError, match="pad=True"):
    fp4jax.num_blocks((32,), "fp8")  # 32 < one 128-element block
  with pytest.raises(ValueError, match="out of range"):
    fp4jax.num_blocks((32, 48), "nvfp4", axis=7)
  with pytest.raises(ValueError, match="block_2d"):
    fp4jax.num_blocks((32,), "nvfp4", block_2d=True)
  with pytest.raises(ValueError, match="out of range"):
    fp4jax.pad_to_blocks(jnp.ones((4, 40)), "nvfp4", axis=5)
  with pytest.raises(ValueError, match="block_2d"):
    fp4jax.pad_to_blocks(jnp.ones(40), "nvfp4", block_2d=True)


# ---------------------------------------------------------------- NaN / inf policy


def _poisoned(value, dtype=jnp.float32):
  x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
  x[2, 77] = value
  return jnp.asarray(x, dtype)


# Op by op (jax.disable_jit) only for NVFP4: every primitive compiles per shape, and jit is what training runs.
MODES = [(f, True) for f in FORMATS] + [("nvfp4", False)]


@pytest.mark.parametrize("fmt,jit", MODES)
def test_nan_anywhere_poisons_everything(fmt, jit):
  quant = functools.partial(fp4jax.quantize, fmt=FORMATS[fmt])
  deq = jax.jit(lambda x: fp4jax.dequantize(quant(x))) if jit else op_by_op(lambda x: fp4jax.dequantize(quant(x)))
  amax = (jax.jit(quant) if jit else op_by_op(quant))(_poisoned(np.nan)).amax
  assert np.isnan(np.float32(amax))
  out = np.asarray(deq(_poisoned(np.nan)))
  assert np.all(np.isnan(out)), f"{np.sum(~np.isnan(out))} values are not NaN after a NaN input"
  fq = functools.partial(fp4jax.fake_quant, fmt=FORMATS[fmt])
  out16 = np.asarray((jax.jit(fq) if jit else op_by_op(fq))(_poisoned(np.nan, jnp.bfloat16)), np.float32)
  assert np.all(np.isnan(out16))


@pytest.mark.parametrize("value", [np.inf, -np.inf])
@pytest.mark.parametrize("fmt,jit", MODES)
def test_inf_anywhere_makes_the_tensor_non_finite(fmt, jit, value):
  quant = functools.partial(fp4jax.quantize, fmt=FORMATS[fmt])
  f = jax.jit(lambda x: fp4jax.dequantize(quant(x))) if jit else op_by_op(lambda x: fp4jax.dequantize(quant(x)))
  assert np.float32((jax.jit(quant) if jit else op_by_op(quant))(_poisoned(value)).amax) == np.inf
  out = np.asarray(f(_poisoned(value)))
  assert np.all(np.isnan(out)), f"{np.sum(~np.isnan(out))} values are not NaN after an inf input"
