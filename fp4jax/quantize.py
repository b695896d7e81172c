"""quantize / dequantize / fake_quant: the public functional quantizers for NVFP4, MXFP4 and FP8.

A tensor is split into scaling blocks (1D along `axis`, or 2D tiles over the last two axes); the format computes
its block scales (`fmt.scaling_from_amax`, see formats.py and formats_fp8.py); elements are scaled and rounded onto the
element grid; the format stores them (`fmt.pack`: FP4 codes two per byte).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp4jax import formats
from fp4jax import eden
from fp4jax import four_over_six
from fp4jax import grids
from fp4jax import keys
from fp4jax import mxfp4
from fp4jax import prng
from fp4jax import rounding as rounding_lib
from fp4jax import qarray as qarray_lib
from fp4jax.qarray import QArray, block_shape

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# --- validation ---------------------------------------------------------------------------------------------------

def _check_input(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits="hash"):
  if key is not None:
    keys.check_key(key, "key")
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise ValueError(f"quantize supports float32, bfloat16 and float16 inputs; got dtype {jnp.dtype(x.dtype).name}.")
  if x.ndim < 1 or (block_2d and x.ndim < 2):
    raise ValueError(f"cannot quantize an array of shape {x.shape} with block_2d={block_2d}.")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}.")
  axis = axis % x.ndim
  if block_2d and axis < x.ndim - 2:
    raise ValueError(f"block_2d blocks span the last two axes; axis must be one of them, got axis={axis}.")
  if rounding not in rounding_lib.ROUNDING_MODES:
    raise ValueError(f"rounding must be one of {rounding_lib.ROUNDING_MODES}; got {rounding!r}.")
  if rounding == "stochastic":
    if key is None:
      raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...).")
    if not fmt.is_fp4:
      raise ValueError(f"stochastic rounding is implemented for the FP4 formats; got {fmt.name}.")
  if random_bits not in rounding_lib.RANDOM_BITS:
    raise ValueError(f"random_bits must be one of {rounding_lib.RANDOM_BITS}; got {random_bits!r}.")
  prng.check_sr_bits(sr_bits)
  return axis


def _blocked_axes(fmt, ndim, axis, block_2d):
  if fmt.per_tensor:
    return ()
  return (ndim - 2, ndim - 1) if block_2d else (axis,)


def _padded_shape(shape, fmt, blocked_axes, pad):
  padded = list(shape)
  for a in blocked_axes:
    n, b = shape[a], fmt.block_size
    if n % b:
      if not pad:
        raise ValueError(f"axis {a} has length {n}, not a multiple of the {fmt.name} block size {b} "
                         f"(shape {tuple(shape)}); pass pad=True to zero-pad it, or use fp4jax.pad_to_blocks.")
      padded[a] = -(-n // b) * b
  return tuple(padded)


def pad_to_blocks(x, fmt, *, axis=-1, block_2d=False):
  """Zero-pads `x` so the blocked axes are multiples of `fmt`'s block size (zeros never change amax)."""
  fmt = formats.get_format(fmt)
  axis = axis % x.ndim
  padded = _padded_shape(x.shape, fmt, _blocked_axes(fmt, x.ndim, axis, block_2d), pad=True)
  return jnp.pad(x, [(0, p - s) for s, p in zip(x.shape, padded)])


# --- blocks -------------------------------------------------------------------------------------------------------
# Per-block quantities have the scales' shape (each blocked axis divided by its block size). The elementwise chain
# never reshapes the full-size tensor into blocks: per-block factors are broadcast back to the full shape instead.
# On XLA:CPU that keeps the chain one vectorised loop that may write in place into a donated input (a blocked
# reshape of the input made XLA add a full-size copy and a fresh output buffer).

def _int_max(a, axes):
  """max over `axes` of non-negative float32 `a` (NaN-propagating), as an integer max of the bit patterns.

  For non-negative floats the bit patterns order like the values, and every NaN's lies above +inf's. XLA:CPU hands
  float max reductions to YNNPACK (jax 0.10), which drops NaN and is slow on short minor-axis blocks; an integer max
  is a standard reduction (so it also partitions under sharding) that XLA emits itself, vectorised.
  """
  i = jax.lax.bitcast_convert_type(a, jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.max(i, axis=axes), jnp.float32)


def _split_blocks(shape, block):
  """(shape with each blocked axis n split into (n / b, b), the positions of the b axes)."""
  split, axes = [], []
  for n, b in zip(shape, block):
    if b > 1:
      axes.append(len(split) + 1)
    split.extend((n // b, b) if b > 1 else (n,))
  return split, tuple(axes)


def _block_amax(x, block):
  """max |x| over each block, NaN-propagating, with the scales' shape.

  Tuned for XLA:CPU: a reduction over one blocked axis of up to 32 elements is a single vectorised pass over x, but
  longer ones (FP8's 128) get split into a tree with |x| materialised, and two blocked axes at once (16x16 tiles)
  run ~4x slower. So the innermost blocked axis is reduced first, in chunks of at most 16 (32 if that is the whole
  block), and whatever remains of the block is reduced on that 1/16-size result. Along the minor axis, halves of a
  chunk are first combined elementwise (contiguous loads) before the reduction proper.
  """
  a = jnp.abs(x)
  if all(b == 1 for b in block):
    return a
  inner = max(i for i, b in enumerate(block) if b > 1)
  chunk = block[inner] if block[inner] <= 32 or block[inner] % 16 else 16
  if inner == x.ndim - 1:
    a = a.reshape(x.shape[:-1] + (x.shape[-1] // chunk, chunk))
    while a.shape[-1] > 8 and a.shape[-1] % 2 == 0:
      half = a.shape[-1] // 2
      a = jnp.maximum(a[..., :half], a[..., half:])  # NaN-propagating
    amax = _int_max(a, -1)
  else:
    split, axes = _split_blocks(x.shape, [chunk if i == inner else 1 for i in range(x.ndim)])
    amax = _int_max(a.reshape(split), axes)
  rest = [b // chunk if i == inner else b for i, b in enumerate(block)]
  if all(r == 1 for r in rest):
    return amax
  # The rest of the block as a float max (a different reduction from the integer one: XLA would merge two integer
  # max reductions into one slow pass over x) with a separate NaN check (jnp.max may drop NaN, see _int_max).
  split, axes = _split_blocks(amax.shape, rest)
  amax = amax.reshape(split)
  return jnp.where(jnp.any(jnp.isnan(amax), axis=axes), jnp.float32(jnp.nan), jnp.max(amax, axis=axes))


def _tensor_amax(amax_b):
  """max over all blocks' amax (== max|x|, NaN-propagating): a pass over 1/block_size of the data, not over x.

  An unsigned max of the bit patterns (non-negative floats order like their bits, NaNs above +inf): a standard
  reduction (it partitions under sharding) that XLA:CPU emits itself. Unsigned, not _int_max's signed max: XLA would
  merge two reductions with one computation into a slow pass over x. (jnp.max's float max goes to YNNPACK, which
  drops NaN, so it needed a separate NaN check: two more kernels over the block amaxes and a YNNPACK call.)
  """
  m = jnp.max(jax.lax.bitcast_convert_type(amax_b, jnp.uint32))
  return jnp.where(m > jnp.uint32(0x7F800000), jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(m, jnp.float32))


def _block_std(x32, block, amax_b):
  """Population standard deviation (mean-centred, ddof 0) of each block, float32, with the scales' shape.

  Each block is first scaled by a power of two to |x| < 1 (exact), so squares neither overflow nor underflow,
  and shifted by its first element, so a constant block has exactly zero deviation; then two passes (mean, then
  the mean squared deviation from it), which stay accurate where E[x^2] - E[x]^2 would cancel. Non-finite blocks
  give NaN.
  """
  finite = jnp.isfinite(amax_b)
  _, k = jnp.frexp(jnp.where(finite, amax_b, jnp.float32(1.0)))  # amax_b < 2^k
  y = _scale_blocks(x32, mxfp4.pow2_factors(-k), block)
  split, axes = _split_blocks(x32.shape, block)
  y = y.reshape(split)
  first = y
  for a in axes:
    first = jax.lax.slice_in_dim(first, 0, 1, axis=a)
  d = y - first
  n = jnp.float32(math.prod(block))
  mean = jnp.sum(d, axis=axes, keepdims=True) / n
  var = jnp.sum(jnp.square(d - mean), axis=axes) / n
  return jnp.where(finite, mxfp4.scale_by_pow2(jnp.sqrt(var), k), jnp.float32(jnp.nan))


def _expand_blocks(s, block):
  """Repeats each per-block value over its block: [S0/B0, S1/B1, ...] -> [S0, S1, ...]."""
  interleaved = [d for n, b in zip(s.shape, block) for d in ((n, 1) if b > 1 else (n,))]
  repeated = [d for n, b in zip(s.shape, block) for d in ((n, b) if b > 1 else (n,))]
  return jnp.broadcast_to(s.reshape(interleaved), repeated).reshape([n * b for n, b in zip(s.shape, block)])


def _scale_blocks(x, factors, block):
  """x times each per-block factor in turn, each broadcast over its block."""
  for f in factors:
    x = x * _expand_blocks(f, block)
  return x


def _decode(values, scaling: formats.Scaling, block):
  """Element values times their decode scales: the format's per-block factors, then the tensor factor."""
  values = _scale_blocks(values, scaling.decode, block)
  if scaling.tensor_decode is not None:
    values = values * scaling.tensor_decode
  if scaling.nan_blocks is not None:
    values = jnp.where(_expand_blocks(scaling.nan_blocks, block), jnp.nan, values)
  return values


def _scale_shape(shape, block):
  return tuple(s // b for s, b in zip(shape, block))


def _quantize_elements(x32, fmt, block, rounding, key, random_bits, values=False, sr_bits="hash", clip_mask=False):
  """The quantizer proper on the (padded) float32 tensor.

  Returns (elements, scales, amax, decode): `elements` has x32's shape: E2M1 codes (int32 0..15) for FP4, or with
  `values=True` the E2M1 values those codes stand for (float32); E4M3 values (float32) for FP8. `scales` are the
  stored block scales. With `values=True`, `decode(elements)` is what `dequantize` returns before the non-finite
  check, without the round trip through codes, packing and stored scales. With `clip_mask=True` a fifth output:
  True where the scaled element lies strictly inside the element range (|x / s| < max; False for NaN).
  """
  amax_b = _block_amax(x32, block)
  amax = fmt.group_amax(amax_b, block)  # None: one amax for the whole tensor
  if amax is None:
    amax = _tensor_amax(amax_b)
  if clip_mask and (fmt.corrects_scales or fmt.scaling_candidates(amax_b, amax) is not None):
    raise ValueError(f"a clip mask needs one scaling per block; {fmt.label} chooses or corrects its block scales.")
  if fmt.corrects_scales:
    return _quantize_eden(x32, fmt, block, rounding, key, random_bits, amax_b, amax, values, sr_bits)
  candidates = fmt.scaling_candidates(amax_b, amax)
  if candidates is not None:
    return _quantize_choosing(x32, fmt, candidates, block, rounding, key, random_bits, amax, values, sr_bits)
  if fmt.uses_std:
    scaling = fmt.scaling_from_std(_block_std(x32, block, amax_b), amax_b)
  else:
    scaling = fmt.scaling_from_amax(amax_b, amax)
  y = _scale_blocks(x32, scaling.encode, block)
  if clip_mask:
    mask = jnp.abs(y) < jnp.float32(fmt.elem_max)
    return _quantize_elements_of(y, fmt, scaling, block, rounding, key, random_bits, values, sr_bits, amax) + (mask,)
  return _quantize_elements_of(y, fmt, scaling, block, rounding, key, random_bits, values, sr_bits, amax)


def _quantize_elements_of(y, fmt, scaling, block, rounding, key, random_bits, values, sr_bits, amax):
  """_quantize_elements' rounding step on the scaled tensor y."""
  scales = scaling.stored
  decode = lambda v: _decode(v, scaling, block)
  if not fmt.is_fp4:  # E4M3 elements (FP8): round-to-nearest-even only
    return grids.round_e4m3(y), scales, amax, decode
  if values:  # the rounded values equal the decoded codes (up to NaN inputs, whose tensor dequantizes to NaN)
    rounded = rounding_lib.round_e2m1(y, rounding=rounding, key=key, random_bits=random_bits, sr_bits=sr_bits)
    return rounded, scales, amax, decode
  codes = rounding_lib.e2m1_codes(y, rounding=rounding, key=key, random_bits=random_bits, sr_bits=sr_bits)
  return codes, scales, amax, decode


def _quantize_choosing(x32, fmt, candidates, block, rounding, key, random_bits, amax, values, sr_bits):
  """_quantize_elements for formats that choose per block among candidate scalings (NVFP4 4/6: four_over_six.py)."""
  round_fn = lambda y: rounding_lib.round_e2m1(y, rounding=rounding, key=key, random_bits=random_bits,
                                               sr_bits=sr_bits)
  decode_fn = lambda v, sc: _decode(v, sc, block)
  expand_fn = lambda s: _expand_blocks(s, block)
  elements, stored, dec, _ = four_over_six.choose(x32, candidates, block, fmt.select, round_fn, decode_fn, expand_fn)
  scaling = formats.Scaling(stored, (), dec, candidates[0].tensor_decode)
  decode = lambda v: _decode(v, scaling, block)
  return (elements if values else grids.e2m1_codes(elements)), stored, amax, decode


def _quantize_eden(x32, fmt, block, rounding, key, random_bits, amax_b, amax, values, sr_bits):
  """_quantize_elements for MS-EDEN (eden.py): RTN elements, then corrected, optionally SR'd, block scales."""
  scaling = fmt.scaling_from_amax(amax_b, amax)
  y = _scale_blocks(x32, scaling.encode, block)
  # A block whose scale underflowed to 0 decodes to 0 whatever its elements; its y (x * FLT_MAX) must not enter the
  # group sums (inf * 0 = NaN), so its elements are 0.
  y = jnp.where(_expand_blocks(scaling.decode[0] == 0, block), jnp.float32(0.0), y)
  v = rounding_lib.round_e2m1_nearest(y)
  # Block decode scales are never negative, which XLA cannot know: the runtime 0 eden.correction rounds with, from
  # 1/16 of the data instead of a pass over the elements.
  zero = jnp.any(scaling.decode[0] < 0).astype(jnp.uint32)
  corr = eden.correction(y, v, block, fmt.eden_group // fmt.block_size, zero)
  s_b = eden.round_scales(scaling.decode[0] * corr, rounding=rounding, key=key, random_bits=random_bits,
                          sr_bits=sr_bits)
  scaling = formats.Scaling(s_b.astype(jnp.float8_e4m3fn), (), (s_b,) + scaling.decode[1:], scaling.tensor_decode)
  decode = lambda e: _decode(e, scaling, block)
  return (v if values else rounding_lib.e2m1_codes_nearest(y)), scaling.stored, amax, decode


# --- quantize -----------------------------------------------------------------------------------------------------

def _prepare(x, fmt, axis, block_2d, pad):
  """(float32 x zero-padded to whole blocks, the padded shape, the block shape; the whole shape for FP8 tensor)."""
  blocked = _blocked_axes(fmt, x.ndim, axis, block_2d)
  shape = _padded_shape(x.shape, fmt, blocked, pad)
  x32 = x.astype(jnp.float32)
  if shape != x.shape:
    x32 = jnp.pad(x32, [(0, p - s) for s, p in zip(x.shape, shape)])
  block = block_shape(fmt, x.ndim, axis, block_2d) if blocked else shape
  return x32, shape, block


def quantize(x, fmt, *, axis: int = -1, block_2d: bool = False, rounding: str = "nearest", key=None,
             random_bits: int = 32, pad: bool = False, sr_bits: str = "hash") -> QArray:
  """Quantizes `x` to `fmt` (NVFP4, MXFP4, MXFP8, FP8 or a name from fp4jax.FORMAT_NAMES).

  Args:
    x: float32, bfloat16 or float16 array; the arithmetic is float32.
    fmt: the format.
    axis: the axis the 1D blocks run along (the GEMM's contraction axis); FP4 codes are packed along it.
    block_2d: square blocks over the last two axes (16x16 for NVFP4 weights); `axis` then only picks the packing axis.
    rounding: "nearest" (round-to-nearest-even, saturating) or "stochastic" (FP4 only, needs `key`).
    key: JAX PRNG key for stochastic rounding; the same key gives the same bits.
    random_bits: 32 for full-width uniforms, 8 for hardware-style 8 random bits per element.
    pad: zero-pad blocked axes up to a multiple of the block size instead of raising.
    sr_bits: the stochastic-rounding bit generator: "hash" (counter-based, fused; the default) or "threefry"
      (jax.random.bits); see fp4jax.prng.

  Returns:
    A QArray. NaN anywhere makes amax NaN; NaN or inf anywhere makes the whole dequantized tensor non-finite.
  """
  return _quantize(x, fmt, axis, block_2d, rounding, key, random_bits, pad, sr_bits, clip_mask=False)[0]


def quantize_with_clip_mask(x, fmt, *, axis: int = -1, block_2d: bool = False, rounding: str = "nearest", key=None,
                            random_bits: int = 32, pad: bool = False, sr_bits: str = "hash"):
  """(quantize(x, fmt, ...), mask): mask (bool, x's shape) is True where |x / block scale| < the element max.

  QuEST's straight-through gradient is this mask (arXiv 2502.05003; Quartet, arXiv 2505.14669): elements that
  saturated get no gradient. False for NaN. Formats that choose or correct block scales (4/6, EDEN) are refused.
  """
  return _quantize(x, fmt, axis, block_2d, rounding, key, random_bits, pad, sr_bits, clip_mask=True)


def _quantize(x, fmt, axis, block_2d, rounding, key, random_bits, pad, sr_bits, clip_mask):
  fmt = formats.get_format(fmt)
  x = jnp.asarray(x)
  axis = _check_input(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  x32, shape, block = _prepare(x, fmt, axis, block_2d, pad)
  out = _quantize_elements(x32, fmt, block, rounding, key, random_bits, sr_bits=sr_bits, clip_mask=clip_mask)
  elements, scales, amax = out[:3]
  codes = fmt.pack(elements, axis)
  per_tensor = not _blocked_axes(fmt, x.ndim, axis, block_2d)
  scales = scales.reshape(() if per_tensor else _scale_shape(shape, block))
  q = QArray(codes, scales, amax, fmt=fmt, shape=shape,
             orig_shape=tuple(x.shape), axis=axis, block_2d=block_2d, dtype=x.dtype)
  mask = out[4][tuple(slice(0, n) for n in x.shape)] if clip_mask else None
  return q, mask


# --- dequantize ---------------------------------------------------------------------------------------------------

def _block_of(q: QArray):
  if not _blocked_axes(q.fmt, q.ndim, q.axis, q.block_2d):
    return q.shape
  return block_shape(q.fmt, q.ndim, q.axis, q.block_2d)


def _finish(values, amax, orig_shape, dtype):
  """Non-finite amax poisons the whole tensor (fail loudly, never plausible numbers); crop padding; cast."""
  values = jnp.where(jnp.all(jnp.isfinite(amax)), values, jnp.nan)
  if values.shape != tuple(orig_shape):
    values = values[tuple(slice(0, n) for n in orig_shape)]
  return values.astype(dtype)


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """Float values of a QArray (code * block scale * global scale), cropped to the original shape, in `dtype`."""
  if not isinstance(q, QArray):
    raise ValueError(f"dequantize expects a QArray; got {type(q).__name__}.")
  qarray_lib.check_fields(q)
  block = _block_of(q)
  return decode_elements(q.fmt.unpack(q.codes, q.axis), q.fmt, q.scales.reshape(_scale_shape(q.shape, block)),
                         q.amax, block, q.orig_shape, dtype)


def decode_elements(elements, fmt, scales, amax, block, orig_shape, dtype=jnp.float32) -> jax.Array:
  """dequantize's arithmetic on element values (unpacked): elements x the block and tensor decode scales of the
  stored `scales` ([.., S_i / B_i, ..]) and `amax`, cropped to `orig_shape`, in `dtype`."""
  values = _decode(elements, fmt.scaling_from_stored(scales, amax), block)
  return _finish(values, amax, orig_shape, dtype)


def quantize_elements(x, fmt, *, axis: int = -1, block_2d: bool = False, rounding: str = "nearest", key=None,
                      random_bits: int = 32, pad: bool = False, sr_bits: str = "hash"):
  """The quantizer without the storage: (elements, scales, amax, block), where `elements` are the element values
  (E2M1 or E4M3, float32, x's padded shape) that `quantize(x, ...)` stores as codes, `scales` its stored block
  scales shaped [.., S_i / B_i, ..], and `decode_elements(elements, fmt, scales, amax, block, x.shape)` equals
  `dequantize(quantize(x, ...))` bit for bit, without packing and unpacking codes (XLA fuses a quantize-dequantize
  chain into one loop that recomputes each packed byte's two codes per element: ~3-10x slower on XLA:CPU)."""
  fmt = formats.get_format(fmt)
  x = jnp.asarray(x)
  axis = _check_input(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  x32, shape, block = _prepare(x, fmt, axis, block_2d, pad)
  elements, scales, amax, _ = _quantize_elements(x32, fmt, block, rounding, key, random_bits, values=True,
                                                 sr_bits=sr_bits)
  return elements, scales.reshape(_scale_shape(shape, block)), amax, block


def fake_quant(x, fmt, *, axis: int = -1, block_2d: bool = False, rounding: str = "nearest", key=None,
               random_bits: int = 32, pad: bool = False, sr_bits: str = "hash") -> jax.Array:
  """dequantize(quantize(x, fmt, ...)) in x's dtype: the values a quantized GEMM would see.

  Bit-identical to that composition, but multiplies the rounded E2M1/E4M3 values by their scales directly (no
  codes, packing or float8 scale round trip), so under jit the chain is a block-max pass plus one fused pass.
  """
  fmt = formats.get_format(fmt)
  x = jnp.asarray(x)
  axis = _check_input(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  x32, _, block = _prepare(x, fmt, axis, block_2d, pad)
  elements, _, amax, decode = _quantize_elements(x32, fmt, block, rounding, key, random_bits, values=True,
                                                 sr_bits=sr_bits)
  return _finish(decode(elements), amax, x.shape, x.dtype)


def quantization_error(x, fmt, **kwargs) -> jax.Array:
  """Relative Frobenius error ||fake_quant(x) - x|| / ||x|| in float32."""
  x32 = jnp.asarray(x).astype(jnp.float32)
  err = fake_quant(x, fmt, **kwargs).astype(jnp.float32) - x32
  return jnp.linalg.norm(err) / jnp.maximum(jnp.linalg.norm(x32), jnp.finfo(jnp.float32).tiny)


def num_blocks(shape, fmt, *, axis=-1, block_2d=False) -> int:
  """How many scaling blocks a tensor of `shape` has."""
  fmt = formats.get_format(fmt)
  blocked = _blocked_axes(fmt, len(shape), axis % len(shape), block_2d)
  if not blocked:
    return 1
  return math.prod(_scale_shape(shape, block_shape(fmt, len(shape), axis % len(shape), block_2d)))
