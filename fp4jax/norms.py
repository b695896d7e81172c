"""Relative Frobenius errors of float32 tensors whose squares leave float32's range.

A plain sum of squares overflows to inf from |x| ~ 1.8e19 and underflows to 0 below |x| ~ 1e-19, so ||e|| / ||x|| of
such a tensor came out NaN (inf / inf) or an exact-looking 0 (finite / inf). Both operands are first multiplied by
one power of two that brings max |x| into [0.5, 1): the squares stay in range, and as the scaling is exact the ratio
of the norms keeps its bits for every tensor whose squares did fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import mxfp4


def unit_scaled(ref, *others) -> tuple[jax.Array, ...]:
  """(ref, *others) in float32 times 2^-e, e the binary exponent of max |ref| (max |ref| * 2^-e in [0.5, 1));
  unscaled when max |ref| is 0, inf or NaN (those give 0, inf or NaN norms either way)."""
  arrays = tuple(jnp.asarray(a).astype(jnp.float32) for a in (ref, *others))
  if not arrays[0].size:
    return arrays
  amax = jnp.max(jnp.abs(arrays[0]))
  usable = jnp.isfinite(amax) & (amax > 0)
  _, e = jnp.frexp(jnp.where(usable, amax, jnp.float32(1.0)))
  e = jnp.where(usable, e, 0)
  return tuple(mxfp4.scale_by_pow2(a, -e) for a in arrays)


def relative_error(approx, ref) -> jax.Array:
  """||approx - ref|| / ||ref|| (Frobenius, float32); 0 when both are zero, NaN when either holds a NaN."""
  ref32, approx32 = unit_scaled(ref, approx)
  return jnp.linalg.norm(approx32 - ref32) / jnp.maximum(jnp.linalg.norm(ref32), jnp.finfo(jnp.float32).tiny)
