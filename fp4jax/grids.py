"""Element grids: E2M1 (FP4), E4M3 (FP8) and powers of two, rounded with explicit float32 arithmetic.

Rounding is done arithmetically (scale by an exact power of two, `round` half-to-even, scale back) rather than with
dtype casts: XLA may fold an f32 -> f8 -> f32 round trip away under jit, and an f32 -> float8_e4m3fn cast does not
saturate. The results are exactly representable, so a later cast to the storage dtype is lossless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)

E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_SIGN_BIT = 8

E4M3_MAX = 448.0
E4M3_MIN_EXPONENT = -6  # smallest normal exponent; subnormal step is 2^-9
E4M3_MANTISSA_BITS = 3


def exponent_of(x):
  """floor(log2 |x|) of positive finite float32 `x`, exactly (from frexp); 0 maps to a very small exponent."""
  _, e = jnp.frexp(x)
  return jnp.where(x > 0, e - 1, -1000)


def pow2(e):
  """2.0**e as float32, exactly, for integer `e` in [-126, 127] (built from the exponent bits)."""
  e = jnp.asarray(e, jnp.int32)
  bits = jax.lax.shift_left(e + 127, jnp.int32(23))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def round_to_quantum(x, exponent):
  """Rounds float32 `x` to a multiple of 2**exponent, half-to-even; exact for |x| / 2**exponent < 2**24."""
  # Two scalings keep both factors normal even when `exponent` is near the float32 limits.
  return jnp.round(x * pow2(-exponent)) * pow2(exponent)


def round_e2m1_magnitude(a):
  """Rounds non-negative float32 `a` onto the E2M1 magnitudes, round-to-nearest-even, saturating at 6.

  The E2M1 grid has step 0.5 below 2, 1 on [2, 4) and 2 on [4, 6]: the step is 2^(max(floor(log2 a), 0) - 1).
  """
  step_exponent = jnp.maximum(exponent_of(a), 0) - 1
  step_exponent = jnp.minimum(step_exponent, 1)  # beyond 8 the value saturates anyway
  r = round_to_quantum(jnp.minimum(a, 8.0), step_exponent)
  return jnp.where(jnp.isnan(a), a, jnp.minimum(r, E2M1_MAX))


def e2m1_floor_magnitude(a):
  """Largest E2M1 magnitude <= `a` (a in [0, 6]), and the gap to the next magnitude above it."""
  step_exponent = jnp.clip(exponent_of(a), 0, 2) - 1
  step = pow2(step_exponent)
  lo = jnp.floor(a * pow2(-step_exponent)) * step
  # At exactly 4 the lower neighbour's step (1) differs from the step above it (2): use the step above.
  gap = jnp.where(lo >= 4.0, 2.0, jnp.where(lo >= 2.0, 1.0, 0.5))
  return lo, gap


def e2m1_code_of_magnitude(m):
  """Maps an E2M1 magnitude in {0, .5, 1, 1.5, 2, 3, 4, 6} to its 3-bit code 0..7."""
  code = jnp.zeros(m.shape, jnp.uint8)
  for threshold in E2M1_VALUES[1:]:
    code = code + (m >= threshold).astype(jnp.uint8)
  return code


def e2m1_codes(v):
  """4-bit E2M1 codes of float32 `v`, whose magnitudes already lie on the grid; sign bit from v's sign bit (-0 -> 8)."""
  sign = jnp.signbit(v).astype(jnp.uint8) * jnp.uint8(E2M1_SIGN_BIT)
  return e2m1_code_of_magnitude(jnp.abs(v)) | sign


def e2m1_decode(codes, dtype=jnp.float32):
  """Float values of 4-bit E2M1 codes (uint8 0..15)."""
  table = jnp.asarray(np.concatenate([E2M1_VALUES, -E2M1_VALUES]), dtype)
  return table[codes.astype(jnp.int32)]


def round_e4m3(x):
  """Rounds float32 `x` to E4M3 (float8_e4m3fn) values, round-to-nearest-even, saturating at +-448; NaN stays NaN.

  The quantum is 2^(max(floor(log2|x|), -6) - 3): 3 mantissa bits for normals, 2^-9 steps for subnormals.
  Infinities saturate to +-448.
  """
  a = jnp.abs(x)
  q_exp = jnp.clip(exponent_of(a), E4M3_MIN_EXPONENT, 9) - E4M3_MANTISSA_BITS
  r = round_to_quantum(jnp.minimum(a, 512.0), q_exp)
  r = jnp.minimum(r, E4M3_MAX)
  r = jnp.where(jnp.isnan(x), x, r)
  return jnp.copysign(r, x)


def pack_nibbles(codes, axis):
  """Packs uint8 codes (0..15) two per byte along `axis`: element 2i in the low nibble, 2i+1 in the high one."""
  codes = jnp.moveaxis(codes, axis, -1)
  lo, hi = codes[..., 0::2], codes[..., 1::2]
  packed = lo | jax.lax.shift_left(hi, jnp.uint8(4))
  return jnp.moveaxis(packed, -1, axis)


def unpack_nibbles(packed, axis):
  """Inverse of `pack_nibbles`: uint8 codes 0..15 with the packed axis doubled."""
  packed = jnp.moveaxis(packed, axis, -1)
  lo = packed & jnp.uint8(0x0F)
  hi = jax.lax.shift_right_logical(packed, jnp.uint8(4))
  codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
  return jnp.moveaxis(codes, -1, axis)
