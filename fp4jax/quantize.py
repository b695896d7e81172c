"""quantize / dequantize / fake_quant: the public functional quantizers for NVFP4, MXFP4 and FP8.

A tensor is split into scaling blocks (1D along `axis`, or 2D tiles over the last two axes); the format computes
its block scales (`fmt.scaling_from_amax`, see formats.py and formats_fp8.py); elements are scaled and rounded onto the
element grid; the format stores them (`fmt.pack`: FP4 codes two per byte).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp4jax import arg_checks
from fp4jax import blocks
from fp4jax import formats
from fp4jax import eden
from fp4jax import explicit_axes
from fp4jax import four_over_six
from fp4jax import grids
from fp4jax import keys
from fp4jax import no_gradient
from fp4jax import norms
from fp4jax import prng
from fp4jax import rounding as rounding_lib
from fp4jax import qarray as qarray_lib
from fp4jax.qarray import QArray, block_shape

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# --- validation ---------------------------------------------------------------------------------------------------

def _check_axis(shape, axis, block_2d) -> int:
  """The non-negative blocked axis of an array of `shape`, or a ValueError naming what does not fit."""
  arg_checks.flag("block_2d", block_2d)
  ndim = len(shape)
  if ndim < 1 or (block_2d and ndim < 2):
    raise ValueError(f"cannot quantize an array of shape {tuple(shape)} with block_2d={block_2d}.")
  axis = arg_checks.axis_index(axis, ndim)
  if block_2d and axis < ndim - 2:
    raise ValueError(f"block_2d blocks span the last two axes; axis must be one of them, got axis={axis}.")
  return axis


def check_arguments(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits="hash", pad=False) -> int:
  """The non-negative blocked axis, after checking quantize's arguments for array `x` and format `fmt` (a ValueError
  names the first that does not fit); shared with the Pallas quantizer (pallas_kernels.quantize_nvfp4)."""
  arg_checks.flag("pad", pad)
  if key is not None:
    keys.check_key_or_hash_seed(key, sr_bits, "key")
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise ValueError(f"quantize supports float32, bfloat16 and float16 inputs; got dtype {jnp.dtype(x.dtype).name}.")
  axis = _check_axis(x.shape, axis, block_2d)
  if x.size == 0:
    raise ValueError(f"cannot quantize an empty array (shape {x.shape}): it has no amax.")
  if rounding not in rounding_lib.ROUNDING_MODES:
    raise ValueError(f"rounding must be one of {rounding_lib.ROUNDING_MODES}; got {rounding!r}.")
  if rounding == "nearest" and key is not None:
    raise ValueError("key is used by rounding='stochastic' only; round-to-nearest would ignore it. Pass "
                     "rounding='stochastic' to round stochastically, or key=None.")
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
  arg_checks.flag("pad", pad)
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
  x = jnp.asarray(x)
  axis = _check_axis(x.shape, axis, block_2d)
  padded = _padded_shape(x.shape, fmt, _blocked_axes(fmt, x.ndim, axis, block_2d), pad=True)
  return jnp.pad(x, [(0, p - s) for s, p in zip(x.shape, padded)])


# --- decoding (per-block reductions and broadcasts: fp4jax.blocks) -------------------------------------------------

def _decode(values, scaling: formats.Scaling, block):
  """Element values times their decode scales: the format's per-block factors, then the tensor factor."""
  values = blocks.scale_blocks(values, scaling.decode, block)
  if scaling.tensor_decode is not None:
    values = values * scaling.tensor_decode
  if scaling.nan_blocks is not None:
    values = jnp.where(blocks.expand_blocks(scaling.nan_blocks, block), jnp.nan, values)
  return values


def _scale_shape(shape, block):
  return tuple(s // b for s, b in zip(shape, block))


def _quantize_elements(x32, fmt, block, rounding, key, random_bits, values=False, sr_bits="hash", clip_mask=False):
  """The quantizer proper on the (padded) float32 tensor.

  Returns (elements, scales, amax, scaling): `elements` has x32's shape: E2M1 codes (int32 0..15) for FP4, or with
  `values=True` the E2M1 values those codes stand for (float32); E4M3 values (float32) for FP8. `scales` are the
  stored block scales, `scaling` the quantizer's own (formats.Scaling). With `values=True`,
  `_decode(elements, scaling, block)` is what `dequantize` returns before the non-finite check, without the round
  trip through codes, packing and stored scales. With `clip_mask=True` a fifth output:
  True where the scaled element lies strictly inside the element range (|x / s| < max; False for NaN).
  """
  amax_b = blocks.block_amax(x32, block)
  amax = fmt.group_amax(amax_b, block)  # None: one amax for the whole tensor
  if amax is None:
    amax = blocks.tensor_amax(amax_b)
  if clip_mask and (fmt.corrects_scales or fmt.scaling_candidates(amax_b, amax) is not None):
    raise ValueError(f"a clip mask needs one scaling per block; {fmt.label} chooses or corrects its block scales.")
  if fmt.corrects_scales:
    return _quantize_eden(x32, fmt, block, rounding, key, random_bits, amax_b, amax, values, sr_bits)
  candidates = fmt.scaling_candidates(amax_b, amax)
  if candidates is not None:
    return _quantize_choosing(x32, fmt, candidates, block, rounding, key, random_bits, amax, values, sr_bits, amax_b)
  if fmt.uses_std:
    scaling = fmt.scaling_from_std(blocks.block_std(x32, block, amax_b), amax_b)
  else:
    scaling = fmt.scaling_from_amax(amax_b, amax)
  y = blocks.scale_blocks(x32, scaling.encode, block)
  if clip_mask:
    mask = jnp.abs(y) < jnp.float32(fmt.elem_max)
    return _quantize_elements_of(y, fmt, scaling, block, rounding, key, random_bits, values, sr_bits, amax) + (mask,)
  return _quantize_elements_of(y, fmt, scaling, block, rounding, key, random_bits, values, sr_bits, amax)


def _quantize_elements_of(y, fmt, scaling, block, rounding, key, random_bits, values, sr_bits, amax):
  """_quantize_elements' rounding step on the scaled tensor y."""
  scales = scaling.stored
  if not fmt.is_fp4:  # E4M3 elements (FP8): round-to-nearest-even only
    return grids.round_e4m3(y), scales, amax, scaling
  if values:  # the rounded values equal the decoded codes (up to NaN inputs, whose tensor dequantizes to NaN)
    rounded = rounding_lib.round_e2m1(y, rounding=rounding, key=key, random_bits=random_bits, sr_bits=sr_bits)
    return rounded, scales, amax, scaling
  codes = rounding_lib.e2m1_codes(y, rounding=rounding, key=key, random_bits=random_bits, sr_bits=sr_bits)
  return codes, scales, amax, scaling


def _quantize_choosing(x32, fmt, candidates, block, rounding, key, random_bits, amax, values, sr_bits, amax_b):
  """_quantize_elements for formats that choose per block among candidate scalings (NVFP4 4/6: four_over_six.py)."""
  round_fn = lambda y: rounding_lib.round_e2m1(y, rounding=rounding, key=key, random_bits=random_bits,
                                               sr_bits=sr_bits)
  decode_fn = lambda v, sc: _decode(v, sc, block)
  expand_fn = lambda s: blocks.expand_blocks(s, block)
  select_round_fn = rounding_lib.round_e2m1_nearest if fmt.select_on == "nearest" and rounding != "nearest" else None
  elements, stored, dec, _ = four_over_six.choose(x32, candidates, block, fmt.select, round_fn, decode_fn, expand_fn,
                                                  select_round_fn, amax_b)
  scaling = formats.Scaling(stored, (), dec, candidates[0].tensor_decode)
  return (elements if values else grids.e2m1_codes(elements)), stored, amax, scaling


def _quantize_eden(x32, fmt, block, rounding, key, random_bits, amax_b, amax, values, sr_bits):
  """_quantize_elements for MS-EDEN (eden.py): RTN elements, then corrected, optionally SR'd, block scales."""
  scaling = fmt.scaling_from_amax(amax_b, amax)
  y = blocks.scale_blocks(x32, scaling.encode, block)
  # A block whose scale underflowed to 0 decodes to 0 whatever its elements; its y (x * FLT_MAX) must not enter the
  # group sums (inf * 0 = NaN), so its elements are 0, each with its sign (-0 stays -0, as in every other quantizer;
  # +-0 add nothing to the sums).
  y = jnp.where(blocks.expand_blocks(scaling.decode[0] == 0, block), jnp.copysign(jnp.float32(0.0), y), y)
  v = rounding_lib.round_e2m1_nearest(y)
  # Block decode scales are never negative, which XLA cannot know: the runtime 0 eden.correction rounds with, from
  # 1/16 of the data instead of a pass over the elements.
  zero = jnp.any(scaling.decode[0] < 0).astype(jnp.uint32)
  corr = eden.correction(y, v, block, fmt.eden_group // fmt.block_size, zero)
  s_b = eden.round_scales(scaling.decode[0] * corr, rounding=rounding, key=key, random_bits=random_bits,
                          sr_bits=sr_bits)
  scaling = formats.Scaling(s_b.astype(jnp.float8_e4m3fn), (), (s_b,) + scaling.decode[1:], scaling.tensor_decode)
  return (v if values else rounding_lib.e2m1_codes_nearest(y)), scaling.stored, amax, scaling


# --- quantize -----------------------------------------------------------------------------------------------------

def _prepare(x, fmt, axis, block_2d, pad):
  """(float32 x zero-padded to whole blocks, the padded shape, the block shape; the whole shape for FP8 tensor)."""
  blocked = _blocked_axes(fmt, x.ndim, axis, block_2d)
  shape = _padded_shape(x.shape, fmt, blocked, pad)
  x32 = grids.exact_float32(x)  # not astype: XLA:GPU would drop the rounding of a fused bfloat16 producer
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
    key: JAX PRNG key for stochastic rounding; the same key gives the same bits. With sr_bits "hash", also a
      fp4jax.prng.HashSeed derived from a key (the same bits as that key).
    random_bits: 32 for full-width uniforms, 8 for hardware-style 8 random bits per element.
    pad: zero-pad blocked axes up to a multiple of the block size instead of raising. The zeros never change an
      amax, but they do count in a block's standard deviation (MXFP4 scale_rule 'quest').
    sr_bits: the stochastic-rounding bit generator: "hash" (counter-based, fused; the default) or "threefry"
      (jax.random.bits); see fp4jax.prng.

  Returns:
    A QArray. NaN anywhere makes amax NaN; NaN or inf anywhere makes the whole dequantized tensor non-finite.
    Not differentiable: reverse-mode autodiff that reaches it raises a TypeError (its gradient would be zero: the
    codes are integers); `fake_quant` has the straight-through gradient. Under jax.vmap each item is quantized as
    if alone (its own amax), and the QArray's arrays carry the batch axes.
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
  fmt, x, axis = _checked(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  settings = _static(fmt, axis, block_2d, rounding, random_bits, pad, sr_bits, clip_mask=clip_mask)
  name = "fp4jax.quantize_with_clip_mask" if clip_mask else "fp4jax.quantize"
  run = lambda x, key: no_gradient.refusing_gradient(x, key, _quantize_jit, name, settings)
  return _on_auto_axes(run, x, key)


def _on_auto_axes(fn, x, *args):
  """fn(x, *args); with `x` sharded over Explicit mesh axes, run with the axes made Auto (fp4jax.explicit_axes)."""
  if explicit_axes.explicit_axes(x):
    return explicit_axes.run_auto_like(fn, (x, *args), explicit_axes.first_sharding(x))
  return fn(x, *args)


def _checked(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits):
  """(the format, x as an array, the non-negative axis), or a clear error; runs before (outside) the jitted bodies."""
  fmt = formats.get_format(fmt)
  x = jnp.asarray(x)
  return fmt, x, check_arguments(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)


# The public quantizers run their bodies through jax.jit, once per shape and settings: called outside jit (a notebook,
# a test) their many small ops would otherwise dispatch and compile one by one (NVFP4 quantize of a [512, 1024]
# array: 1.5 s for the first call, 12-17 ms for later ones, against 0.2 s and under 1 ms jitted). Inside a trace the
# nested jit is inlined. `jax.disable_jit()` restores op-by-op execution.
_SETTINGS = ("fmt", "axis", "block_2d", "rounding", "random_bits", "pad", "sr_bits")


def _static(*values, **extra) -> tuple:
  """The jitted bodies' static arguments (`_SETTINGS` in order, then `extra`) as hashable (name, value) pairs."""
  return tuple(zip(_SETTINGS, values)) + tuple(extra.items())


@functools.partial(jax.jit, static_argnames=_SETTINGS + ("clip_mask",))
def _quantize_jit(x, key, *, fmt, axis, block_2d, rounding, random_bits, pad, sr_bits, clip_mask):
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


def _finish(values, amax, orig_shape, dtype, saturate=False):
  """Non-finite amax poisons the whole tensor (fail loudly, never plausible numbers); crop padding; saturate where
  asked (`may_pass_dtype`); cast."""
  values = jnp.where(jnp.all(jnp.isfinite(amax)), values, jnp.nan)
  if values.shape != tuple(orig_shape):
    values = values[tuple(slice(0, n) for n in orig_shape)]
  return (saturated(values, dtype) if saturate else values).astype(dtype)


def may_pass_dtype(fmt, dtype) -> bool:
  """Whether `fmt`'s decoded values can lie beyond `dtype`'s largest finite value for finite input: for any output
  narrower than float32, and for float32 where a format decodes past its tensor amax (NVFP4 with headroom: up to
  17/16 of it; MS-EDEN, whose scale corrections can exceed 1). The other formats decode within their amax or, for MX,
  within the capped grid, so float32 output skips the saturation (a compute-bound pass: +20 % for float32 q+dq)."""
  if jnp.finfo(dtype).max < jnp.finfo(jnp.float32).max:
    return True
  return bool(getattr(fmt, "headroom", False)) or getattr(fmt, "scale_rule", None) == "eden"


def saturated(values, dtype):
  """`values` with magnitudes beyond `dtype`'s largest finite value set to it (NaN stays NaN).

  A format's grid can reach past the output dtype from finite input: an MX block of float16 values near 65504
  decodes to 65536 (4 x 2^14 with the "ceil" rule), and NVFP4 with headroom maps a block maximum to 17/16 of it
  (past FLT_MAX from 3.2e38). As the MX exponent caps do, those values saturate rather than becoming inf: a finite
  tensor never decodes to inf, and only non-finite input gives non-finite output (the tensor poisoned with NaN).
  """
  fmax = jnp.finfo(dtype).max
  return jnp.where(jnp.abs(values) > fmax, jnp.sign(values) * jnp.asarray(fmax, values.dtype), values)


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """Float values of a QArray (code * block scale * global scale), cropped to the original shape, in `dtype`."""
  if not isinstance(q, QArray):
    raise ValueError(f"dequantize expects a QArray; got {type(q).__name__}.")
  if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
    raise ValueError(f"dequantize returns floating-point values; got dtype={jnp.dtype(dtype).name}.")
  if jnp.dtype(dtype).itemsize < 2:  # float8 / float4 outputs: no saturation or NaN handling of theirs here
    raise ValueError(f"dequantize returns float32, bfloat16, float16 or float64 values; got dtype="
                     f"{jnp.dtype(dtype).name} (quantize to that format instead, e.g. fp4jax.quantize(x, 'fp8')).")
  qarray_lib.check_fields(q)
  return _on_auto_axes(functools.partial(_dequantize_jit, dtype=jnp.dtype(dtype)), q)


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantize_jit(q: QArray, *, dtype):
  block = _block_of(q)
  values = decode_elements(q.fmt.unpack(q.codes, q.axis), q.fmt, q.scales.reshape(_scale_shape(q.shape, block)),
                           q.amax, block, q.orig_shape, dtype)
  return _tied_to(values, q.amax)


@jax.custom_jvp
def _tied_to(values, amax):
  """`values`, given a zero tangent from `amax`. A format whose stored fields are all integers (MXFP4's E8M0 scales)
  would otherwise stop a cotangent silently before the quantizer that made the QArray; through amax it reaches that
  quantizer, which refuses it (fp4jax.no_gradient). Outside differentiation this is the identity: no operations."""
  del amax
  return values


@_tied_to.defjvp
def _tied_to_jvp(primals, tangents):
  values, _ = primals
  d_values, d_amax = tangents
  return values, d_values + jnp.zeros_like(d_values) * jnp.sum(d_amax).astype(d_values.dtype)


def decode_elements(elements, fmt, scales, amax, block, orig_shape, dtype=jnp.float32) -> jax.Array:
  """dequantize's arithmetic on element values (unpacked): elements x the block and tensor decode scales of the
  stored `scales` ([.., S_i / B_i, ..]) and `amax`, cropped to `orig_shape`, in `dtype`."""
  values = _decode(elements, fmt.scaling_from_stored(scales, amax), block)
  return _finish(values, amax, orig_shape, dtype, may_pass_dtype(fmt, dtype))


def quantize_elements(x, fmt, *, axis: int = -1, block_2d: bool = False, rounding: str = "nearest", key=None,
                      random_bits: int = 32, pad: bool = False, sr_bits: str = "hash"):
  """The quantizer without the storage: (elements, scales, amax, block), where `elements` are the element values
  (E2M1 or E4M3, float32, x's padded shape) that `quantize(x, ...)` stores as codes, `scales` its stored block
  scales shaped [.., S_i / B_i, ..], and `decode_elements(elements, fmt, scales, amax, block, x.shape)` equals
  `dequantize(quantize(x, ...))` bit for bit, without packing and unpacking codes (XLA fuses a quantize-dequantize
  chain into one loop that recomputes each packed byte's two codes per element: ~3-10x slower on XLA:CPU).
  Not differentiable, as quantize: reverse-mode autodiff that reaches it raises a TypeError."""
  fmt, x, axis = _checked(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  block = block_shape(fmt, x.ndim, axis, block_2d) if _blocked_axes(fmt, x.ndim, axis, block_2d) else None
  settings = _static(fmt, axis, block_2d, rounding, random_bits, pad, sr_bits)
  name = "fp4jax.quantize.quantize_elements"
  run = lambda x, key: no_gradient.refusing_gradient(x, key, _quantize_elements_jit, name, settings)
  elements, scales, amax = _on_auto_axes(run, x, key)
  return elements, scales, amax, (block or elements.shape)


@functools.partial(jax.jit, static_argnames=_SETTINGS)
def _quantize_elements_jit(x, key, *, fmt, axis, block_2d, rounding, random_bits, pad, sr_bits):
  x32, shape, block = _prepare(x, fmt, axis, block_2d, pad)
  elements, scales, amax, _ = _quantize_elements(x32, fmt, block, rounding, key, random_bits, values=True,
                                                 sr_bits=sr_bits)
  return elements, scales.reshape(_scale_shape(shape, block)), amax


def decoded_values(x, fmt, *, dtype=jnp.float32, tensor_decode: bool = True, axis: int = -1, block_2d: bool = False,
                   rounding: str = "nearest", key=None, random_bits: int = 32, pad: bool = False,
                   sr_bits: str = "hash") -> tuple[jax.Array, jax.Array]:
  """(values in `dtype`, the tensor amax): x quantized, times the quantizer's own float32 block decode scales.

  tensor_decode=True: `values` is dequantize(quantize(x, ...)) bit for bit (what fake_quant returns, in `dtype`).
  tensor_decode=False: the per-tensor decode factor (NVFP4's amax / R, with double_block each 1x128 group's; MXFP4
  Tseng's 4/3) and the poisoning by a non-finite amax are left to the caller, which applies both after a GEMM
  (fp4jax.gemm.unit_values).
  The block scales are the float32 values the quantizer rounded, equal to the stored E4M3 / E8M0 scales read back.
  Decoding from the stored ones instead, XLA:CPU fused their float8 round trip into every element's loop: 20 % of
  the `small` nvfp4 train step (benchmarks/RESULTS.md). Not differentiable, as quantize.
  """
  fmt, x, axis = _checked(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  settings = _static(fmt, axis, block_2d, rounding, random_bits, pad, sr_bits, dtype=jnp.dtype(dtype),
                     tensor_decode=bool(tensor_decode))
  run = lambda x, key: no_gradient.refusing_gradient(x, key, _decoded_values_jit, "fp4jax.quantize.decoded_values",
                                                     settings)
  return _on_auto_axes(run, x, key)


@functools.partial(jax.jit, static_argnames=_SETTINGS + ("dtype", "tensor_decode"))
def _decoded_values_jit(x, key, *, fmt, axis, block_2d, rounding, random_bits, pad, sr_bits, dtype, tensor_decode):
  x32, _, block = _prepare(x, fmt, axis, block_2d, pad)
  elements, _, amax, scaling = _quantize_elements(x32, fmt, block, rounding, key, random_bits, values=True,
                                                  sr_bits=sr_bits)
  if tensor_decode:
    return _finish(_decode(elements, scaling, block), amax, x.shape, dtype, may_pass_dtype(fmt, dtype)), amax
  scaling = scaling._replace(tensor_decode=None)
  if getattr(fmt, "double_block", False):  # NVFP4 decode scales (s_b, group's amax / R): the group's is left out too
    scaling = scaling._replace(decode=scaling.decode[:-1])
  values = _decode(elements, scaling, block)
  return _finish(values, jnp.float32(0.0), x.shape, dtype), amax  # a finite stand-in amax: cropped and cast only


def fake_quant(x, fmt, *, axis: int = -1, block_2d: bool = False, rounding: str = "nearest", key=None,
               random_bits: int = 32, pad: bool = False, sr_bits: str = "hash") -> jax.Array:
  """dequantize(quantize(x, fmt, ...)) in x's dtype: the values a quantized GEMM would see.

  Bit-identical to that composition, but multiplies the rounded E2M1/E4M3 values by their scales directly (no
  codes, packing or float8 scale round trip), so under jit the chain is a block-max pass plus one fused pass.

  Differentiable with the straight-through estimator: the gradient is the identity (the cotangent passes through
  unchanged), as in quantization-aware training, since the rounding's own derivative is zero almost everywhere
  (without it jax.grad would return zeros). `quantize` has none: differentiating through it raises. For QuEST's clipped
  estimator, multiply the cotangent by the mask of `quantize_with_clip_mask`.
  """
  fmt, x, axis = _checked(x, fmt, axis, block_2d, rounding, key, random_bits, sr_bits)
  settings = (fmt, axis, block_2d, rounding, random_bits, pad, sr_bits)
  return _on_auto_axes(lambda x, key: _fake_quant_straight_through(x, key, settings), x, key)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _fake_quant_straight_through(x, key, settings):
  return _fake_quant_jit(x, key, **dict(zip(_SETTINGS, settings)))


@_fake_quant_straight_through.defjvp
def _fake_quant_straight_through_jvp(settings, primals, tangents):
  x, key = primals
  return _fake_quant_straight_through(x, key, settings), tangents[0]


@functools.partial(jax.jit, static_argnames=_SETTINGS)
def _fake_quant_jit(x, key, *, fmt, axis, block_2d, rounding, random_bits, pad, sr_bits):
  return _decoded_values_jit(x, key, fmt=fmt, axis=axis, block_2d=block_2d, rounding=rounding,
                             random_bits=random_bits, pad=pad, sr_bits=sr_bits, dtype=x.dtype, tensor_decode=True)[0]


def quantization_error(x, fmt, **kwargs) -> jax.Array:
  """Relative Frobenius error ||fake_quant(x) - x|| / ||x|| in float32."""
  # Scaled first: squares of |x| > ~1.8e19 overflow to inf (NaN ratio), of |x| < ~1e-19 underflow to 0 (ratio 0).
  return norms.relative_error(fake_quant(x, fmt, **kwargs), x)


def num_blocks(shape, fmt, *, axis=-1, block_2d=False, pad: bool = False) -> int:
  """How many scaling blocks `quantize(x, fmt, axis=..., block_2d=..., pad=...)` gives a tensor of `shape`: the
  scales' size (1 for a per-tensor format). A blocked axis that is not a whole number of blocks is an error, as in
  quantize, unless `pad` (then it counts the padded blocks)."""
  fmt = formats.get_format(fmt)
  shape = tuple(shape)
  axis = _check_axis(shape, axis, block_2d)
  blocked = _blocked_axes(fmt, len(shape), axis, block_2d)
  if not blocked:
    return 1
  padded = _padded_shape(shape, fmt, blocked, pad)
  return math.prod(_scale_shape(padded, block_shape(fmt, len(shape), axis, block_2d)))
