"""MS-EDEN scale correction: Quartet II's unbiased backward quantizer (arXiv 2601.22813).

After round-to-nearest, each group of 128 elements along the blocked axis (8 NVFP4 blocks; `formats.NVFP4.eden_group`,
Quartet II's Hadamard size) gets the factor
S = sum(y^2) / sum(y * q(y)) (y: elements on the E2M1 scale, q(y): their rounded values; 1 when the denominator is 0)
multiplied into its 8 block scales, which are then rounded stochastically to a neighbouring E4M3 value, without
stochastic rounding of the elements (IST-DASLab/Quartet-II, src/models/quantization/quantizers/nvfp4_triton.py,
`eden_1x16s_fp4_kernel`). Sums are float32 in a fixed pairwise order (four_over_six.block_reduce's).

Following a random rotation (the RHT) this is unbiased at group level, E<x, x_hat> = |x|^2, only where the group's
block scales are equal: y is in units of each block's own scale, so with unequal scales the unweighted sums leave a
bias of about -6e-4 of |x|^2 on Gaussian data (docs/numerics.md). The published rule is kept as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import division
from fp4jax import four_over_six
from fp4jax import grids
from fp4jax import prng
from fp4jax import rounding as rounding_lib

GROUP_BLOCKS = 8  # default: 8 blocks of 16, the correction's 128-element groups


def _group_sum(per_block, axis, group_blocks):
  """Sums of `group_blocks` consecutive per-block values along `axis` (zero-padded), in pairwise order."""
  n = per_block.shape[axis]
  groups = -(-n // group_blocks)
  pad = [(0, groups * group_blocks - n if i == axis else 0) for i in range(per_block.ndim)]
  t = jnp.moveaxis(jnp.pad(per_block, pad), axis, -1)
  t = t.reshape(t.shape[:-1] + (groups, group_blocks))
  return jnp.moveaxis(four_over_six.pairwise(t, jnp.add), -1, axis)


def correction(y, v, block, group_blocks: int = GROUP_BLOCKS, zero=None):
  """Per-block factor S of each block's group of `group_blocks` blocks: sum(y^2) / sum(y * v) (1 where that sum
  is 0). `zero`: a runtime uint32 0 (four_over_six.rounded); by default derived from v, a pass over the elements."""
  axes = [i for i, b in enumerate(block) if b > 1]
  if len(axes) != 1:
    raise ValueError("NVFP4 scale_rule='eden' needs 1D blocks (1x16 along one axis); got 2D blocks.")
  axis = axes[0]
  per_block = lambda t: four_over_six.block_reduce(t, block, jnp.add)
  # Under jit XLA contracts each product with the first addition of its sum into an FMA (one rounding instead of
  # two: ~10% of the corrections moved by an ulp on heavy-tailed data); rounding the products explicitly keeps jit,
  # eager and the float32 reference bit-identical (four_over_six.rounded; |v| <= 6, so `zero` is a runtime 0).
  if zero is None:
    zero = jnp.any(jnp.abs(v) > 6.0).astype(jnp.uint32)
  num = _group_sum(per_block(four_over_six.rounded(y * y, zero)), axis, group_blocks)
  den = _group_sum(per_block(four_over_six.rounded(y * v, zero)), axis, group_blocks)
  s = jnp.where(den == 0, jnp.float32(1.0), division.divide(num, den))
  n = y.shape[axis] // block[axis]
  return jnp.repeat(s, group_blocks, axis=axis, total_repeat_length=s.shape[axis] * group_blocks)[
      tuple(slice(0, n) if i == axis else slice(None) for i in range(s.ndim))]


def e4m3_neighbours(s):
  """(lower, upper) E4M3 neighbours of non-negative float32 `s` (equal when `s` is an E4M3 value; 448 above 448)."""
  r = grids.round_e4m3(s, per_block=True)
  bits = jax.lax.bitcast_convert_type(r.astype(jnp.float8_e4m3fn), jnp.uint8)
  step = lambda d: jax.lax.bitcast_convert_type(bits + jnp.uint8(d), jnp.float8_e4m3fn).astype(jnp.float32)
  # Codes of non-negative E4M3 values order like the values; 0x7F above 448 is NaN, hence the clamp.
  lo = jnp.where(r > s, step(255), r)  # bits - 1 (uint8 wrap-around never happens: r > s >= 0 means r > 0)
  hi = jnp.where(r < s, jnp.minimum(jnp.where(r >= grids.E4M3_MAX, r, step(1)), grids.E4M3_MAX), r)
  return lo, hi


def round_scales(s, *, rounding, key, random_bits, sr_bits: str = "hash"):
  """E4M3 block scales from corrected float32 scales: to nearest, or stochastically between the neighbours.

  The random bits come from fp4jax.prng like the elements' stochastic rounding: `sr_bits` "hash" (counter-based,
  the default) or "threefry" (jax.random.bits).
  """
  if rounding == "nearest":
    return grids.round_e4m3(s, per_block=True)
  lo, hi = e4m3_neighbours(s)
  p = jnp.where(hi > lo, division.divide(s - lo, jnp.where(hi > lo, hi - lo, 1.0)), 0.0)
  u = rounding_lib.uniform_from_bits(prng.random_bits(key, s.shape, sr_bits), random_bits)
  threshold = p if random_bits == 32 else jnp.floor(p * 256.0)
  # The scales are per block but XLA:CPU fused this whole chain (neighbours through float8, the hash, the choice) into
  # each consumer's per-element loop, once per element of the block: 16x the work, much of the quartet2 backward.
  return division.computed_apart(jnp.where(jnp.isnan(s), s, jnp.where(u < threshold, hi, lo)))
