"""Element grids: E2M1 (FP4), E4M3 (FP8) and powers of two, rounded with explicit float32 arithmetic.

Rounding is done arithmetically (scale by an exact power of two, `round` half-to-even, scale back) rather than with
dtype casts: XLA may fold an f32 -> f8 -> f32 round trip away under jit, and an f32 -> float8_e4m3fn cast does not
saturate. The results are exactly representable, so a later cast to the storage dtype is lossless.

Speed (XLA:CPU, see benchmarks/quantize.py): everything here is plain elementwise integer/float arithmetic with no
table lookups and no frexp, so a whole quantize chain fuses into one vectorised loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import division

FLT_MAX = float(np.finfo(np.float32).max)

E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_SIGN_BIT = 8

# Round-to-nearest-even decision points on the E2M1 magnitudes: |y| beyond each threshold (or at it, when the upper
# neighbour has the even code, i.e. ties go up) adds one to the magnitude code. 0.25 -> 0, 0.75 -> 1, 5 -> 4, 7 -> 6.
E2M1_RNE_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                       (5.0, False))

E4M3_MAX = 448.0
E4M3_MIN_EXPONENT = -6  # smallest normal exponent; subnormal step is 2^-9
E4M3_MANTISSA_BITS = 3

_F32_EXPONENT_MASK = 0x7F800000
_F32_MANTISSA_BITS = 23


def exact_float32(x):
  """`x` (float32, bfloat16 or float16) as float32, exactly; the narrow types widened from their bits.

  Why not `x.astype(float32)`: XLA:GPU's excess-precision rewrite (SimplifyFPConversions, on by default) removes a
  float32 -> bfloat16 -> float32 convert pair, so a quantizer compiled together with the producer of a bfloat16
  tensor (an activation cast to bfloat16, the RHT's output) would read the producer's unrounded float32 values: on
  an H200, fp4jax.quantize(random_hadamard(x_bf16)) differed from the same call on the CPU in 2 % of its codes.
  Reading the bits needs the narrow value itself, so the rounding stays; on values already in memory it computes
  the same numbers as the cast.
  """
  x = jnp.asarray(x)
  if x.dtype == jnp.float32:
    return x
  if x.dtype == jnp.bfloat16:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, jnp.uint32(16)), jnp.float32)
  if x.dtype == jnp.float16:
    return _float16_bits_to_float32(jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32))
  raise ValueError(f"exact_float32 takes float32, bfloat16 or float16; got {jnp.dtype(x.dtype).name}.")


def _float16_bits_to_float32(b):
  """IEEE half -> single from the 16 bits in uint32 `b`: exponent rebiased (15 -> 127), subnormals as m * 2^-24."""
  sign = jax.lax.shift_left(b & jnp.uint32(0x8000), jnp.uint32(16))
  e = jax.lax.shift_right_logical(b, jnp.uint32(10)) & jnp.uint32(0x1F)
  m = b & jnp.uint32(0x3FF)
  normal = jax.lax.shift_left(e + jnp.uint32(127 - 15), jnp.uint32(23)) | jax.lax.shift_left(m, jnp.uint32(13))
  special = jnp.uint32(0x7F800000) | jax.lax.shift_left(m, jnp.uint32(13))  # inf, NaN (payload kept)
  subnormal = jax.lax.bitcast_convert_type(m.astype(jnp.float32) * jnp.float32(2.0**-24), jnp.uint32)
  magnitude = jnp.where(e == 0x1F, special, jnp.where(e == 0, subnormal, normal))
  return jax.lax.bitcast_convert_type(sign | magnitude, jnp.float32)


def exponent_of(x):
  """floor(log2 |x|) of positive finite float32 `x`, exactly (from frexp); 0 maps to a very small exponent."""
  _, e = jnp.frexp(x)
  return jnp.where(x > 0, e - 1, -1000)


def pow2(e):
  """2.0**e as float32, exactly, for integer `e` in [-126, 127] (built from the exponent bits)."""
  e = jnp.asarray(e, jnp.int32)
  bits = jax.lax.shift_left(e + 127, jnp.int32(23))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _quantum(a, min_exponent: int, max_exponent: int, mantissa_bits: int):
  """(2^k, 2^-k) for k = clip(floor(log2 a), min_exponent, max_exponent) - mantissa_bits, exactly.

  What exponent_of + pow2 compute (a <= 0 and float32 subnormals give min_exponent), read off the bits of float32
  `a` at a fraction of frexp's cost: clamping the bit pattern as a signed integer clamps the exponent (negative
  numbers are negative integers), then the mantissa is masked away.
  """
  e_bits = jnp.clip(jax.lax.bitcast_convert_type(a, jnp.int32), (127 + min_exponent) << _F32_MANTISSA_BITS,
                    ((127 + max_exponent) << _F32_MANTISSA_BITS) | 0x7FFFFF) & _F32_EXPONENT_MASK
  q_bits = e_bits - (mantissa_bits << _F32_MANTISSA_BITS)
  return (jax.lax.bitcast_convert_type(q_bits, jnp.float32),
          jax.lax.bitcast_convert_type((254 << _F32_MANTISSA_BITS) - q_bits, jnp.float32))


def round_e2m1_magnitude(a):
  """Rounds non-negative float32 `a` onto the E2M1 magnitudes, round-to-nearest-even, saturating at 6.

  The E2M1 grid has step 0.5 below 2, 1 on [2, 4) and 2 on [4, 6]: the step is 2^(clip(floor(log2 a), 0, 2) - 1).
  """
  # Compare-and-select clamps: jnp.minimum's NaN handling costs extra instructions, and NaN is restored at the end.
  a8 = jnp.where(a < 8.0, a, jnp.float32(8.0))  # beyond 8 the value saturates anyway
  step, inv_step = _quantum(a8, 0, 2, 1)
  r = jnp.round(a8 * inv_step) * step
  return jnp.where(jnp.isnan(a), a, jnp.where(r < E2M1_MAX, r, jnp.float32(E2M1_MAX)))


def e2m1_floor_fraction(a):
  """(lower E2M1 neighbour in grid steps, the step, the fraction of a step above it) of `a` in [0, 6]; NaN stays NaN.

  The E2M1 step is constant on [0, 2), [2, 4) and [4, 6], and `a` lies in its own binade's grid, so the gap from the
  lower neighbour lo = floor(a / step) * step to the upper one is that step (at lo = 2 and 4 too: there the step
  below is smaller, but `a` >= lo is in the upper binade). The fraction (a - lo) / gap, stochastic rounding's
  round-up probability, is thus the fractional part of a / step: exact (power-of-two scaling, an exact
  subtraction), and a few instructions instead of a gap lookup and a division.
  """
  step, inv_step = _quantum(a, 0, 2, 1)
  a_s = a * inv_step
  f = jnp.floor(a_s)
  return f, step, a_s - f


def with_sign_of(magnitude, x):
  """copysign(magnitude, x) for float32 `magnitude` with a clear sign bit (>= +0 or a positive NaN): one bitwise or."""
  sign = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-(2**31))
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(magnitude, jnp.int32) | sign, jnp.float32)


def e2m1_magnitude_code_nearest(a):
  """3-bit code (int32 0..7) of the E2M1 magnitude nearest to non-negative float32 `a` (RNE, saturating; NaN -> 0).

  Equal to `e2m1_code_of_magnitude(round_e2m1_magnitude(a))`, but seven compares instead of frexp + round.
  """
  code = jnp.zeros(a.shape, jnp.int32)
  for threshold, ties_up in E2M1_RNE_THRESHOLDS:
    code = code + ((a >= threshold) if ties_up else (a > threshold)).astype(jnp.int32)
  return code


def e2m1_floor_code(a):
  """Code (int32 0..7) of the largest E2M1 magnitude <= non-negative `a` (NaN -> 0)."""
  code = jnp.zeros(a.shape, jnp.int32)
  for threshold in E2M1_VALUES[1:]:
    code = code + (a >= threshold).astype(jnp.int32)
  return code


def sign_bit(x):
  """1 (int32) where float32 `x` has its sign bit set (negatives, -0.0, negative NaNs), else 0."""
  return jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(x, jnp.int32), jnp.int32(31))


def e2m1_code_of_magnitude(m):
  """Maps an E2M1 magnitude in {0, .5, 1, 1.5, 2, 3, 4, 6} to its 3-bit code 0..7 (uint8)."""
  return e2m1_floor_code(m).astype(jnp.uint8)


def e2m1_codes(v):
  """4-bit E2M1 codes of float32 `v`, whose magnitudes already lie on the grid; sign bit from v's sign bit (-0 -> 8)."""
  sign = jnp.signbit(v).astype(jnp.uint8) * jnp.uint8(E2M1_SIGN_BIT)
  return e2m1_code_of_magnitude(jnp.abs(v)) | sign


def e2m1_decode(codes, dtype=jnp.float32):
  """Float values of 4-bit E2M1 codes (uint8 0..15); code 8 is -0.0.

  Arithmetic, not a table lookup: XLA:CPU turns a lookup into a gather, which does not vectorise. Magnitude codes
  2..7 are normal numbers 2^((m>>1)-1) * (1 + (m&1)/2): their three bits go straight under a float32 exponent bias.
  """
  c = codes.astype(jnp.int32)
  m = c & 7
  normal = jax.lax.bitcast_convert_type((m << 22) + (126 << _F32_MANTISSA_BITS), jnp.float32)
  magnitude = jnp.where(m >= 2, normal, m.astype(jnp.float32) * jnp.float32(0.5))
  signed = jax.lax.bitcast_convert_type(magnitude, jnp.int32) | ((c & E2M1_SIGN_BIT) << 28)
  return jax.lax.bitcast_convert_type(signed, jnp.float32).astype(dtype)


def round_e4m3(x, *, per_block: bool = False):
  """Rounds float32 `x` to E4M3 (float8_e4m3fn) values, round-to-nearest-even, saturating at +-448; NaN stays NaN.

  The quantum is 2^(max(floor(log2|x|), -6) - 3): 3 mantissa bits for normals, 2^-9 steps for subnormals.
  Infinities saturate to +-448.
  per_block=True gives the same values for per-block scales: it scales back with an exact division instead of a
  multiplication, and XLA does not duplicate a divide into a broadcasting consumer, so the rounding runs once per
  block rather than once for every element of the block (a divide per element is slower, hence the switch).
  """
  # Beyond 512 everything saturates; clamping first keeps the exponent <= 9.
  a = jnp.minimum(jnp.abs(x), 512.0)
  quantum, inv_quantum = _quantum(a, E4M3_MIN_EXPONENT, 9, E4M3_MANTISSA_BITS)
  # Rounded and saturated in units of the quantum, then scaled back exactly (quantum and inverse are powers of two).
  r = with_sign_of(jnp.minimum(jnp.round(a * inv_quantum), E4M3_MAX * inv_quantum), x)
  r = r / inv_quantum if per_block else r * quantum
  return jnp.where(jnp.isnan(x), x, r)


def pack_nibbles(codes, axis):
  """Packs uint8 codes (0..15) two per byte along `axis`: element 2i in the low nibble, 2i+1 in the high one."""
  axis = axis % codes.ndim
  n = codes.shape[axis]
  codes = codes.astype(jnp.uint8)
  if axis == codes.ndim - 1:
    # Along the minor axis, stride-2 reads keep XLA:CPU from vectorising (~5x slower): read each pair as one
    # little-endian uint16 instead (element 2i is its low byte) and fold the high byte's nibble down.
    w = jax.lax.bitcast_convert_type(codes.reshape(codes.shape[:-1] + (n // 2, 2)), jnp.uint16)
    return ((w & jnp.uint16(0x00FF)) | (jax.lax.shift_right_logical(w, jnp.uint16(4)) & jnp.uint16(0x00F0))
            ).astype(jnp.uint8)
  # Pairs as a new axis next to `axis`: two contiguous slices, no transpose.
  pairs = codes.reshape(codes.shape[:axis] + (n // 2, 2) + codes.shape[axis + 1:])
  lo = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
  hi = jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
  return lo | jax.lax.shift_left(hi, jnp.uint8(4))


def unpack_nibbles(packed, axis):
  """Inverse of `pack_nibbles`: uint8 codes 0..15 with the packed axis doubled."""
  axis = axis % packed.ndim
  n = packed.shape[axis]
  if axis == packed.ndim - 1:
    # The mirror image of pack_nibbles' uint16 trick: spread each byte's nibbles into the two bytes of a uint16.
    w = packed.astype(jnp.uint16)
    w = (w & jnp.uint16(0x000F)) | (jax.lax.shift_left(w, jnp.uint16(4)) & jnp.uint16(0x0F00))
    return jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(packed.shape[:-1] + (2 * n,))
  # Broadcast each byte to a pair and shift by (0, 4): elementwise, so it fuses (a stack/concatenate does not).
  pairs_shape = packed.shape[:axis] + (n, 2) + packed.shape[axis + 1:]
  pairs = jax.lax.broadcast_in_dim(packed, pairs_shape, [d for d in range(len(pairs_shape)) if d != axis + 1])
  shift = jax.lax.broadcasted_iota(jnp.uint8, pairs_shape, axis + 1) * jnp.uint8(4)
  codes = jax.lax.shift_right_logical(pairs, shift) & jnp.uint8(0x0F)
  return codes.reshape(packed.shape[:axis] + (2 * n,) + packed.shape[axis + 1:])


def divide_by_constant(a, c: float):
  """a / c correctly rounded in float32 on every backend, also under jax.vmap (fp4jax.division.divide: XLA's
  rewrite of a division by a constant into a multiplication by the rounded reciprocal cannot reach it)."""
  return division.divide(a, jnp.float32(c))
