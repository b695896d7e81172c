"""Per-block reductions and broadcasts of the quantizers: block amax, tensor amax, block std, and per-block factors
broadcast back over their blocks. Tuned for XLA:CPU's loop emitter (see each function); used by fp4jax.quantize.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp4jax import mxfp4

# Per-block quantities have the scales' shape (each blocked axis divided by its block size). The elementwise chain
# never reshapes the full-size tensor into blocks: per-block factors are broadcast back to the full shape instead.
# On XLA:CPU that keeps the chain one vectorised loop that may write in place into a donated input (a blocked
# reshape of the input made XLA add a full-size copy and a fresh output buffer).


def int_max(a, axes):
  """max over `axes` of non-negative float32 `a` (NaN-propagating), as an integer max of the bit patterns.

  For non-negative floats the bit patterns order like the values, and every NaN's lies above +inf's. XLA:CPU hands
  float max reductions to YNNPACK (jax 0.10), which drops NaN and is slow on short minor-axis blocks; an integer max
  is a standard reduction (so it also partitions under sharding) that XLA emits itself, vectorised.
  """
  i = jax.lax.bitcast_convert_type(a, jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.max(i, axis=axes), jnp.float32)


def split_blocks(shape, block):
  """(shape with each blocked axis n split into (n / b, b), the positions of the b axes)."""
  split, axes = [], []
  for n, b in zip(shape, block):
    if b > 1:
      axes.append(len(split) + 1)
    split.extend((n // b, b) if b > 1 else (n,))
  return split, tuple(axes)


def block_amax(x, block):
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
    amax = int_max(a, -1)
  else:
    split, axes = split_blocks(x.shape, [chunk if i == inner else 1 for i in range(x.ndim)])
    amax = int_max(a.reshape(split), axes)
  rest = [b // chunk if i == inner else b for i, b in enumerate(block)]
  if all(r == 1 for r in rest):
    return amax
  # The rest of the block as a float max (a different reduction from the integer one: XLA would merge two integer
  # max reductions into one slow pass over x) with a separate NaN check (jnp.max may drop NaN, see int_max).
  split, axes = split_blocks(amax.shape, rest)
  amax = amax.reshape(split)
  return jnp.where(jnp.any(jnp.isnan(amax), axis=axes), jnp.float32(jnp.nan), jnp.max(amax, axis=axes))


def tensor_amax(amax_b):
  """max over all blocks' amax (== max|x|, NaN-propagating): a pass over 1/block_size of the data, not over x.

  An unsigned max of the bit patterns (non-negative floats order like their bits, NaNs above +inf): a standard
  reduction (it partitions under sharding) that XLA:CPU emits itself. Unsigned, not int_max's signed max: XLA would
  merge two reductions with one computation into a slow pass over x. (jnp.max's float max goes to YNNPACK, which
  drops NaN, so it needed a separate NaN check: two more kernels over the block amaxes and a YNNPACK call.)
  """
  m = jnp.max(jax.lax.bitcast_convert_type(amax_b, jnp.uint32))
  return jnp.where(m > jnp.uint32(0x7F800000), jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(m, jnp.float32))


def block_std(x32, block, amax_b):
  """Population standard deviation (mean-centred, ddof 0) of each block, float32, with the scales' shape.

  Each block is first scaled by a power of two to |x| < 1 (exact), so squares neither overflow nor underflow,
  and shifted by its first element, so a constant block has exactly zero deviation; then two passes (mean, then
  the mean squared deviation from it), which stay accurate where E[x^2] - E[x]^2 would cancel. Non-finite blocks
  give NaN.
  """
  finite = jnp.isfinite(amax_b)
  _, k = jnp.frexp(jnp.where(finite, amax_b, jnp.float32(1.0)))  # amax_b < 2^k
  y = scale_blocks(x32, mxfp4.pow2_factors(-k), block)
  split, axes = split_blocks(x32.shape, block)
  y = y.reshape(split)
  first = y
  for a in axes:
    first = jax.lax.slice_in_dim(first, 0, 1, axis=a)
  d = y - first
  n = jnp.float32(math.prod(block))
  mean = jnp.sum(d, axis=axes, keepdims=True) / n
  var = jnp.sum(jnp.square(d - mean), axis=axes) / n
  return jnp.where(finite, mxfp4.scale_by_pow2(jnp.sqrt(var), k), jnp.float32(jnp.nan))


def expand_blocks(s, block):
  """Repeats each per-block value over its block: [S0/B0, S1/B1, ...] -> [S0, S1, ...]."""
  interleaved = [d for n, b in zip(s.shape, block) for d in ((n, 1) if b > 1 else (n,))]
  repeated = [d for n, b in zip(s.shape, block) for d in ((n, b) if b > 1 else (n,))]
  return jnp.broadcast_to(s.reshape(interleaved), repeated).reshape([n * b for n, b in zip(s.shape, block)])


def scale_blocks(x, factors, block):
  """x times each per-block factor in turn, each broadcast over its block."""
  for f in factors:
    x = x * expand_blocks(f, block)
  return x
