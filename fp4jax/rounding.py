"""Rounding onto the E2M1 grid: round-to-nearest-even and stochastic rounding keyed off a JAX PRNG key.

Stochastic rounding (SR) picks the lower or upper grid neighbour with probability proportional to closeness, so
E[SR(y)] = y for |y| <= 6. Random bits come from fp4jax.prng over the whole tensor's shape: by default a counter-based
hash of (seed from the key, element index) fused into the elementwise pass, or ("threefry") `jax.random.bits`; both are
independent of how the tensor is sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import grids
from fp4jax import prng

ROUNDING_MODES = ("nearest", "stochastic")
RANDOM_BITS = (32, 8)


def uniform_from_bits(bits, random_bits: int):
  """The uniform `u` that stochastic rounding compares with the round-up probability p.

  32: u = top 24 bits / 2^24, a full-width uniform in [0, 1), compared with p.
  8:  u = top 8 bits (0..255), compared with floor(p * 256), as hardware with 8 random bits per element does
      (probabilities truncated to multiples of 1/256).
  """
  if random_bits == 32:
    return jax.lax.shift_right_logical(bits, jnp.uint32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)
  if random_bits == 8:
    return jax.lax.shift_right_logical(bits, jnp.uint32(24)).astype(jnp.float32)
  raise ValueError(f"random_bits must be one of {RANDOM_BITS}; got {random_bits!r}.")


def round_e2m1_nearest(y):
  """Signed E2M1 values nearest to float32 `y` (ties to even, saturating at +-6, sign of zero kept)."""
  return grids.with_sign_of(grids.round_e2m1_magnitude(jnp.abs(y)), y)


def _round_up(p, key, shape, random_bits, sr_bits):
  """The stochastic decision: True where the round-up probability `p` (in [0, 1)) beats the uniform. False for NaN."""
  u = uniform_from_bits(prng.random_bits(key, shape, sr_bits), random_bits)
  threshold = p if random_bits == 32 else jnp.floor(p * 256.0)
  return u < threshold


def round_e2m1_stochastic(y, key, random_bits: int = 32, sr_bits: str = "hash"):
  """Signed E2M1 values: |y| (saturated at 6) rounded down or up at random, unbiased; deterministic given `key`."""
  a = jnp.minimum(jnp.abs(y), grids.E2M1_MAX)
  f, step, p = grids.e2m1_floor_fraction(a)
  r = jnp.where(_round_up(p, key, y.shape, random_bits, sr_bits), f + 1.0, f) * step
  return grids.with_sign_of(jnp.where(jnp.isnan(a), a, r), y)


def e2m1_codes_nearest(y):
  """4-bit E2M1 codes (int32 0..15) of round_e2m1_nearest(y), computed directly (no float rounding pass)."""
  return grids.e2m1_magnitude_code_nearest(jnp.abs(y)) | (grids.sign_bit(y) * grids.E2M1_SIGN_BIT)


def e2m1_codes_stochastic(y, key, random_bits: int = 32, sr_bits: str = "hash"):
  """4-bit E2M1 codes (int32 0..15) of round_e2m1_stochastic(y, key, ...): the same random bits and decisions.

  Rounding up moves to the next code, so the code is the lower neighbour's code plus the up/down decision.
  """
  a = jnp.minimum(jnp.abs(y), grids.E2M1_MAX)
  lo_code = grids.e2m1_floor_code(a)
  up = _round_up(grids.e2m1_floor_fraction(a)[2], key, y.shape, random_bits, sr_bits)  # a NaN keeps only its sign
  return (lo_code + up.astype(jnp.int32)) | (grids.sign_bit(y) * grids.E2M1_SIGN_BIT)


def e2m1_codes(y, *, rounding: str = "nearest", key=None, random_bits: int = 32, sr_bits: str = "hash"):
  """4-bit E2M1 codes (int32 0..15) of round_e2m1(y, ...): what `quantize` stores."""
  if rounding == "nearest":
    return e2m1_codes_nearest(y)
  return e2m1_codes_stochastic(y, key, random_bits, sr_bits)


def round_e2m1(y, *, rounding: str = "nearest", key=None, random_bits: int = 32, sr_bits: str = "hash"):
  """Rounds scaled values onto the signed E2M1 grid with the chosen rounding mode."""
  if rounding == "nearest":
    return round_e2m1_nearest(y)
  return round_e2m1_stochastic(y, key, random_bits, sr_bits)
