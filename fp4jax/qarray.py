"""QArray: a quantized tensor as a pytree (codes, block scales, amax) plus static layout metadata."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import formats
from fp4jax import grids


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized tensor.

  Array children (traced under jit, vmap, scan; usable as custom_vjp residuals):
    codes:  FP4 formats: uint8, two E2M1 codes per byte packed along `axis` (element 2i in the low nibble).
            FP8: float8_e4m3fn values, unpacked, same shape as the (padded) input.
    scales: block scales. NVFP4 float8_e4m3fn, MXFP4 float8_e8m0fnu, FP8 float32. Shape: the input shape with the
            blocked axis divided by the block size (1D), or the last two axes divided (2D); FP8 "tensor": shape ().
    amax:   float32 scalar, max |x| over the whole tensor (NVFP4's per-tensor scale is 2688 / amax); with
            NVFP4(double_block=True) one float32 per 1x128 group instead (the input shape, blocked axis / 128).
  Static metadata: fmt, shape (padded input shape), orig_shape, axis (non-negative), block_2d, dtype (input dtype).
  """

  codes: jax.Array
  scales: jax.Array
  amax: jax.Array
  fmt: Any
  shape: tuple[int, ...]
  orig_shape: tuple[int, ...]
  axis: int
  block_2d: bool
  dtype: Any

  def tree_flatten(self):
    """Pytree children (codes, scales, amax) and the static rest."""
    aux = (self.fmt, self.shape, self.orig_shape, self.axis, self.block_2d, jnp.dtype(self.dtype).name)
    return (self.codes, self.scales, self.amax), aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    """The QArray of `tree_flatten`'s parts."""
    fmt, shape, orig_shape, axis, block_2d, dtype = aux
    return cls(*children, fmt=fmt, shape=shape, orig_shape=orig_shape, axis=axis, block_2d=block_2d,
               dtype=jnp.dtype(dtype))

  @property
  def ndim(self) -> int:
    """Rank of the (padded) quantized tensor."""
    return len(self.shape)

  @property
  def size(self) -> int:
    """Elements of the (padded) quantized tensor."""
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of real storage: packed codes + block scales + the float32 amax (~4.5 bits/element for NVFP4; 4.75
    with double-block scales, whose amax holds one float32 per 128 elements)."""
    return int(self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize
               + self.amax.size * self.amax.dtype.itemsize)

  @property
  def bits_per_element(self) -> float:
    """Stored bits (codes, scales and amax) per element: 4.5 for NVFP4 1x16 blocks plus the amax (4.75 with
    double-block scales)."""
    return 8.0 * self.nbytes / self.size

  def unpacked_codes(self) -> jax.Array:
    """E2M1 codes 0..15 as uint8 with the (padded) input shape; FP4 formats only."""
    if not self.fmt.is_fp4:
      raise ValueError(f"unpacked_codes() is for FP4 formats; this QArray is {self.fmt.name}.")
    return grids.unpack_nibbles(self.codes, self.axis)

  def __repr__(self):
    layout = "2d" if self.block_2d else f"1d(axis={self.axis})"
    return (f"QArray({self.fmt.name}, shape={self.orig_shape}, layout={layout}, dtype={jnp.dtype(self.dtype).name}, "
            f"codes={_describe(self.codes)}, scales={_describe(self.scales)})")


def _describe(leaf) -> str:
  """dtype(shape) of an array leaf; repr of anything else (e.g. after jax.tree.map(jnp.shape, q))."""
  if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
    return f"{leaf.dtype}{tuple(leaf.shape)}"
  return repr(leaf)


def block_shape(fmt: formats.Format, ndim: int, axis: int, block_2d: bool) -> tuple[int, ...]:
  """The shape of one scaling block for a tensor of rank `ndim` (1 everywhere but the blocked axes)."""
  shape = [1] * ndim
  if block_2d:
    shape[-1] = shape[-2] = fmt.block_size
  else:
    shape[axis] = fmt.block_size
  return tuple(shape)


def check_fields(q: QArray) -> None:
  """Raises ValueError naming the first field of `q` that disagrees with its format and shape (a hand-built or
  edited QArray), so `dequantize` never decodes garbage or fails deep inside."""
  fmt = q.fmt
  if not isinstance(fmt, (formats.NVFP4, formats.MXFP4, formats.MXFP8, formats.FP8)):
    raise ValueError(f"QArray.fmt must be an NVFP4, MXFP4, MXFP8 or FP8 format; got {fmt!r}.")
  shape, orig = tuple(q.shape), tuple(q.orig_shape)
  if not shape or not all(isinstance(n, int) and n > 0 for n in shape):
    raise ValueError(f"QArray.shape must be a non-empty tuple of positive ints; got {q.shape!r}.")
  if len(orig) != len(shape) or any(o > s for o, s in zip(orig, shape)):
    raise ValueError(f"QArray.orig_shape {orig} must have the rank of shape {shape} and fit inside it (padding "
                     f"only grows axes).")
  if not isinstance(q.axis, int) or not 0 <= q.axis < len(shape):
    raise ValueError(f"QArray.axis must be an int in [0, {len(shape)}); got {q.axis!r}.")
  if q.block_2d and (len(shape) < 2 or q.axis < len(shape) - 2):
    raise ValueError(f"a block_2d QArray needs rank >= 2 and axis among the last two; got shape {shape}, "
                     f"axis {q.axis}.")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"QArray.dtype must be a float dtype; got {q.dtype!r}.")
  per_tensor = isinstance(fmt, formats.FP8) and fmt.scaling == "tensor"
  blocked = () if per_tensor else (len(shape) - 2, len(shape) - 1) if q.block_2d else (q.axis,)
  for a in blocked:
    if shape[a] % fmt.block_size:
      raise ValueError(f"QArray.shape {shape}: axis {a} (length {shape[a]}) is not a multiple of the {fmt.name} "
                       f"block size {fmt.block_size}.")
  if fmt.is_fp4:
    codes_dtype, codes_shape = jnp.dtype(jnp.uint8), list(shape)
    codes_shape[q.axis] //= 2  # two E2M1 codes per byte along axis
    codes_shape = tuple(codes_shape)
  else:
    codes_dtype, codes_shape = jnp.dtype(jnp.float8_e4m3fn), shape
  _check_array("codes", q.codes, codes_dtype, codes_shape, fmt)
  scales_shape = () if per_tensor else tuple(n // fmt.block_size if a in blocked else n for a, n in enumerate(shape))
  _check_array("scales", q.scales, jnp.dtype(fmt.scale_dtype), scales_shape, fmt)
  amax_shape = ()
  if getattr(fmt, "double_block", False):  # NVFP4 double-block: one amax per 1x128 group along the blocked axis
    if q.block_2d:
      raise ValueError("a double_block NVFP4 QArray has 1D blocks; got block_2d=True.")
    group = formats.DOUBLE_BLOCK_GROUP
    amax_shape = tuple(-(-n // group) if a == q.axis else n for a, n in enumerate(scales_shape))
  _check_array("amax", q.amax, jnp.dtype(jnp.float32), amax_shape, fmt)


def _check_array(field, a, dtype, shape, fmt):
  if not hasattr(a, "dtype") or not hasattr(a, "shape"):
    raise ValueError(f"QArray.{field} must be an array; got {type(a).__name__}.")
  if jnp.dtype(a.dtype) != dtype or tuple(a.shape) != tuple(shape):
    batched = jnp.dtype(a.dtype) == dtype and tuple(a.shape[-len(shape):] if shape else ()) == tuple(shape)
    hint = (" It has leading batch axes: a QArray returned by jax.vmap keeps them in its arrays, not in its shape, so "
            "dequantize it under jax.vmap too." if batched and a.ndim > len(shape) else "")
    raise ValueError(f"QArray.{field} must be {dtype.name} with shape {tuple(shape)} for {fmt.name}; got "
                     f"{jnp.dtype(a.dtype).name} with shape {tuple(a.shape)}.{hint}")
