"""Kernel-safe versions of fp4jax's rounding and format arithmetic, bit-identical to fp4jax.grids / fp4jax.rounding.

Inside a Pallas Triton kernel three things differ from XLA, and each is avoided here:
  * `lax.round` has no Triton lowering: round-half-to-even is rebuilt from `floor` (exact for |x| < 2^23).
  * float32 `/` lowers to PTX `div.full.f32` (approximate, up to 2 ulp): divisions by powers of two become exact
    multiplications, and the one real division (the block encode scale) uses `div.rn.f32` through inline PTX when
    compiled (`exact_divide`); interpret mode runs XLA's IEEE division.
  * float min/max lower to `minnumf`/`maxnumf`, which drop NaN: every NaN-sensitive clamp restores NaN explicitly.
No table lookups either (Triton has no gather): E2M1 values are decoded by bit placement through float16, E4M3/E8M0
scales arithmetically.
Per-element work sets the quantize kernel's speed (it is ALU-, not memory-bound, if done naively), so element codes
come from threshold counts (~16 ops) rather than fp4jax's frexp-based rounding; block scales (1/16 of the work)
reuse the frexp-based E4M3 rounding. Every function here is tested bit for bit against fp4jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import grids
from fp4jax import nvfp4

E4M3_NAN_BITS = 0x7F
E8M0_NAN_BITS = 0xFF
E8M0_BIAS = 127


def round_half_even(x):
  """jnp.round(x) (ties to even) for float32 |x| < 2^23, from floor; NaN and +-inf pass through."""
  f = jnp.floor(x)
  d = x - f  # exact: f and x share the binade's quantum
  f_odd = (f - 2.0 * jnp.floor(f * 0.5)) == 1.0
  up = (d > 0.5) | ((d == 0.5) & f_odd)
  return jnp.copysign(jnp.where(up, f + 1.0, f), x)  # jnp.round(-0.3) is -0.0


def round_to_quantum(x, exponent):
  """x rounded to a multiple of 2**exponent, half-to-even, with the floor-based round (Triton has no round)."""
  return round_half_even(x * grids.pow2(-exponent)) * grids.pow2(exponent)


def keep_nan(x, y):
  """y where x is not NaN, else x: undoes Triton's NaN-dropping min/max."""
  return jnp.where(jnp.isnan(x), x, y)


def uniform_threshold(bits, p, random_bits: int):
  """(u, threshold) of rounding.round_e2m1_stochastic: round up iff u < threshold.

  bits: uint32 from jax.random.bits for random_bits=32; for random_bits=8 the top byte (bits >> 24) as uint8, which
  is all the 8-bit rule reads, so the kernel reads a quarter of the random bytes.
  """
  if random_bits == 32:
    u = jax.lax.shift_right_logical(bits, jnp.uint32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)
    return u, p
  return bits.astype(jnp.float32), jnp.floor(p * 256.0)


# RNE onto E2M1 is a count of thresholds passed: the midpoints between grid values, with ties going to the
# neighbour whose mantissa bit is 0 (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
_RNE_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_RNE_UP_AT_TIE = (False, True, False, True, False, True, False)  # ">=" where the tie rounds up, ">" elsewhere
_GRID_ABOVE_ZERO = tuple(float(v) for v in grids.E2M1_VALUES[1:])  # 0.5, 1, 1.5, 2, 3, 4, 6


def _sign(y):
  return jnp.signbit(y).astype(jnp.int32) * grids.E2M1_SIGN_BIT


def e2m1_code_nearest(y):
  """int32 E2M1 codes (0..15) of float32 `y` rounded to nearest-even, saturating at 6; sign from the sign bit.

  Equals grids.e2m1_codes(rounding.round_e2m1_nearest(y)) (NaN gives magnitude code 0 in both) in ~16 ops, where
  a frexp-based rounding followed by a comparison chain costs ~60: the per-element work decides the kernel's speed.
  """
  a = jnp.abs(y)
  m = jnp.zeros(y.shape, jnp.int32)
  for t, up_at_tie in zip(_RNE_MIDPOINTS, _RNE_UP_AT_TIE):
    m = m + ((a >= t) if up_at_tie else (a > t)).astype(jnp.int32)
  return m | _sign(y)


def e2m1_code_stochastic(y, bits, random_bits: int):
  """int32 E2M1 codes equal to grids.e2m1_codes(rounding.round_e2m1_stochastic(y, key)) given that key's bits.

  |y| saturates at 6; lo is the grid value at or below it and gap the step above lo (0.5 below 2, 1 below 4, else
  2), so p = (|y| - lo) / gap is exact as a multiplication; the code steps up from lo's iff u < threshold(p).
  """
  a = keep_nan(y, jnp.minimum(jnp.abs(y), grids.E2M1_MAX))  # NaN: all comparisons False -> code 0, as in fp4jax
  m_lo = jnp.zeros(y.shape, jnp.int32)
  for v in _GRID_ABOVE_ZERO:
    m_lo = m_lo + (a >= v).astype(jnp.int32)
  lo = jnp.where(a >= 4.0, jnp.floor(a * 0.5) * 2.0, jnp.where(a >= 2.0, jnp.floor(a), jnp.floor(a * 2.0) * 0.5))
  inv_gap = jnp.where(a >= 4.0, 0.5, jnp.where(a >= 2.0, 1.0, 2.0))
  u, threshold = uniform_threshold(bits, (a - lo) * inv_gap, random_bits)
  return (m_lo + (u < threshold).astype(jnp.int32)) | _sign(y)


# E2M1 -> float by bit placement: the nibble's sign goes to float16 bit 15 and its magnitude bits e1 e0 m to bits
# 11:9 (the low two exponent bits and the top mantissa bit). That half is value(code) * 2^-14 exactly: exponent
# field E > 0 gives 2^(E-15) (1 + m/2) = 2^-14 * 2^(E-1) (1 + m/2), and E = 0 the subnormal m * 2^-15 = 2^-14 * m/2. float16 subnormals are kept by every half -> float32 conversion (FTZ
# applies to float32 arithmetic only), so no compare, select or table is needed: 5 integer ops and one conversion.
E2M1_HALF_GAIN = 2.0**14


def e2m1_half_bits(nibbles):
  """uint16 float16 bit patterns of value(code) * 2^-14 for int32 E2M1 codes 0..15 (higher bits ignored)."""
  return (((nibbles & 7) << 9) | ((nibbles & 8) << 12)).astype(jnp.uint16)


def e2m1_scaled(nibbles, scale, *, gain_in_scale: bool = False):
  """float32 value(code) * scale for int32 E2M1 codes, exact (code * scale has at most 6 significant bits).

  gain_in_scale: `scale` already carries the factor 2^14 (one multiply per element instead of two; only safe when
  scale * 2^14 cannot overflow float32, e.g. E4M3 block scales).
  """
  h = jax.lax.bitcast_convert_type(e2m1_half_bits(nibbles), jnp.float16).astype(jnp.float32)
  return h * scale if gain_in_scale else (h * E2M1_HALF_GAIN) * scale


def e2m1_value(codes):
  """Float32 values of int32 E2M1 codes 0..15 (bit placement, see e2m1_half_bits)."""
  return e2m1_scaled(codes, jnp.float32(1.0))


def round_e4m3(x):
  """grids.round_e4m3: float32 onto E4M3 values, RNE, saturating at +-448, NaN kept."""
  a = jnp.abs(x)
  q_exp = jnp.clip(grids.exponent_of(a), grids.E4M3_MIN_EXPONENT, 9) - grids.E4M3_MANTISSA_BITS
  r = round_to_quantum(jnp.minimum(a, 512.0), q_exp)
  r = keep_nan(x, jnp.minimum(r, grids.E4M3_MAX))
  return jnp.copysign(r, x)


def round_e4m3_up(x):
  """nvfp4.round_e4m3_up: non-negative float32 onto E4M3 values rounded up (ceil on the grid, with its 2^-21
  relative slack), saturating at 448, NaN kept. RNE lands at most one E4M3 quantum below x, the quantum of the
  rounded value's binade."""
  r = round_e4m3(x)
  quantum = grids.pow2(jnp.maximum(grids.exponent_of(r), grids.E4M3_MIN_EXPONENT) - grids.E4M3_MANTISSA_BITS)
  up = jnp.where(r > 0, r + quantum, jnp.float32(2.0**-9))
  slack = jnp.float32(1.0 + nvfp4.ROUND_UP_SLACK)
  return jnp.where(r * slack < x, jnp.minimum(up, jnp.float32(grids.E4M3_MAX)), r)  # up is finite: no NaN to keep


def e4m3_bits(v):
  """float8_e4m3fn bit patterns (int32 0..255) of float32 values already on the E4M3 grid.

  Normals: a float32 with a 3-bit mantissa has bits (E+127)<<23 | m<<20, and E4M3 wants (E+7)<<3 | m, which is
  (float32 bits >> 20) - (120 << 3). Subnormals (< 2^-6) are integer multiples of 2^-9. NaN -> 0x7F (| sign).
  """
  a = jnp.abs(v)
  fbits = jax.lax.bitcast_convert_type(a, jnp.int32)
  normal = jax.lax.shift_right_logical(fbits, 20) - (120 << 3)
  subnormal = (a * 512.0).astype(jnp.int32)
  mag = jnp.where(jnp.isnan(a), E4M3_NAN_BITS, jnp.where(a >= 2.0**-6, normal, subnormal))
  return mag | (jnp.signbit(v).astype(jnp.int32) << 7)


def e4m3_value(bits):
  """Float32 values of float8_e4m3fn bit patterns (int32 0..255)."""
  e = (bits >> 3) & 15
  m = bits & 7
  mant = jnp.where(e == 0, m, m + 8).astype(jnp.float32)
  mag = mant * grids.pow2(jnp.where(e == 0, -9, e - 10))
  mag = jnp.where((bits & 0x7F) == E4M3_NAN_BITS, jnp.nan, mag)
  return jnp.where((bits & 0x80) != 0, -mag, mag)


def e8m0_value(bits):
  """Float32 2^(bits - 127) of float8_e8m0fnu bit patterns (int32 0..255), built as float32 bit patterns: exponent
  field `bits` for 1..254, the subnormal 2^-127 for 0 (no arithmetic, so no flush-to-zero), NaN for 0xFF."""
  f32_bits = jnp.where(bits == 0, 0x00400000, jnp.where(bits == E8M0_NAN_BITS, 0x7FC00000, bits << 23))
  return jax.lax.bitcast_convert_type(f32_bits.astype(jnp.int32), jnp.float32)


def exact_divide(a, b, *, interpret: bool):
  """IEEE round-to-nearest a / b: XLA's division in interpret mode, PTX `div.rn.f32` in a compiled Triton kernel."""
  if interpret:
    return a / b
  from jax.experimental.pallas import triton as plt  # pylint: disable=g-import-not-at-top
  a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
  [q] = plt.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                   result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return q
