"""The FP8 (E4M3) baseline's scales: current scaling per tensor or per block, float32 scales."""

from __future__ import annotations

import jax.numpy as jnp

from fp4jax import division
from fp4jax import grids
from fp4jax.grids import E4M3_MAX


def scales(amax_b):
  """(decode scale amax/448, encode factor 448/amax) per block, both float32; amax == 0 gives 1 and 1.

  The encode factor is clamped to the largest float32 (as NVFP4's block encode scale): below amax 448 / FLT_MAX
  (~1.3e-36) it would be inf, and a zero (or flushed subnormal) element times inf is NaN.
  """
  zero = amax_b == 0
  decode = jnp.where(zero, jnp.float32(1.0), grids.divide_by_constant(amax_b, E4M3_MAX))
  encode = jnp.where(zero, jnp.float32(1.0),
                     jnp.minimum(division.divide(jnp.float32(E4M3_MAX), amax_b), grids.FLT_MAX))
  return division.computed_once(decode, encode)  # once per block, not per element (off the CPU)
