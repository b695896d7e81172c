"""float32 division, correctly rounded on every backend.

The scales of the quantizers are quotients (NVFP4: S_enc = 2688 / amax, enc_b = 1 / (s_b * S_dec); FP8: 448 /
amax_b), and one ulp in a scale flips an element's code wherever the scaled element sits near a rounding midpoint.
XLA:CPU divides as IEEE 754 says (round to nearest even). XLA:GPU does not: it compiles a float32 divide to PTX
`div.full.f32` (up to 2 ulp off), and TPUs approximate too. On an H200, enc_b came out an ulp high often enough that
fp4jax.quantize differed from the CPU (and from the Pallas kernel, which divides with `div.rn.f32`) in 0.02-0.05 %
of the codes of bfloat16 tensors drawn on the device.

So `divide` uses the native divide on the CPU and, on every other platform, `divide_by_bits`: the platform's
division proposes the quotient of the operands' significands, an exact integer residual corrects it, and the
rounding to nearest even is done by hand, which integer arithmetic makes exact everywhere. About 70 operations
with no loop, spent only on per-block and per-tensor scales (1/16 of the elements or fewer), never per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SIGN = 0x80000000
_MAGNITUDE = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000
_MANTISSA = 0x007FFFFF
_HIDDEN = 0x00800000


def _u32(v):
  return jnp.uint32(v)


def _significand_and_exponent(mag):
  """(significand in [2^23, 2^24), unbiased-by-127 exponent as int32) of finite nonzero magnitude bits `mag`;
  subnormals are normalised (value = significand * 2^(exponent - 127 - 23))."""
  field = jax.lax.shift_right_logical(mag, _u32(23)).astype(jnp.int32)
  frac = mag & _u32(_MANTISSA)
  shift = jnp.maximum(jax.lax.clz(frac).astype(jnp.int32) - 8, 0)  # subnormal: moves the top set bit to bit 23
  subnormal = field == 0
  sig = jnp.where(subnormal, jax.lax.shift_left(frac, shift.astype(jnp.uint32)), frac | _u32(_HIDDEN))
  return sig, jnp.where(subnormal, 1 - shift, field)


def _floor_quotient(num, den, approx):
  """(floor(num * 2^24 / den), remainder != 0) for significands with den <= num < 2 den: 25 quotient bits.

  The platform's float32 division gives a candidate within a few ulps (XLA:GPU: div.full.f32, <= 2 ulp); the exact
  residual R = num * 2^24 - candidate * den stays below 2^31 for candidates within ~30 ulps, so uint32 arithmetic
  that wraps modulo 2^32 computes it exactly, and floor(R / den) (approximate, then fixed up by one) moves the
  candidate to the floor. The operands are below 2^25 with at most 24 significant bits, so both float32 conversions
  are exact.
  """
  fnum, fden = num.astype(jnp.float32), den.astype(jnp.float32)
  q = jnp.clip(approx(fnum, fden), 0.5, 4.0) * jnp.float32(2.0**24)  # an integer below 2^26: exact in float32
  cand = q.astype(jnp.uint32)
  r = jax.lax.bitcast_convert_type(jax.lax.shift_left(num, _u32(24)) - cand * den, jnp.int32)
  iden = den.astype(jnp.int32)
  d = jnp.floor(approx(r.astype(jnp.float32), fden)).astype(jnp.int32)
  r = r - d * iden
  low, high = r < 0, r >= iden  # the approximate floor can be one off either way
  d = d - low.astype(jnp.int32) + high.astype(jnp.int32)
  r = jnp.where(low, r + iden, jnp.where(high, r - iden, r))
  return cand + d.astype(jnp.uint32), r != 0


def _round_to_bits(q, sticky, e):
  """float32 magnitude bits of q * 2^(e - 127 - 24) (q: 25 bits, top bit set) rounded to nearest even, including
  gradual underflow (e <= 0) and overflow to inf."""
  k = jnp.clip(2 - e, 1, 31).astype(jnp.uint32)  # bits shifted out: 1 (the guard) for normal results, more below
  kept = jax.lax.shift_right_logical(q, k)
  guard = jax.lax.shift_right_logical(q, k - 1) & _u32(1)
  below = q & (jax.lax.shift_left(_u32(1), k - 1) - 1)
  up = (guard == 1) & ((below != 0) | sticky | ((kept & 1) == 1))
  # Exponent field e - 1 plus the significand's hidden bit gives field e; a carry out of the significand moves on to
  # the next binade (or to inf) by itself, and a subnormal rounding up to 2^23 becomes the smallest normal.
  field = (jnp.clip(e, 1, 255) - 1).astype(jnp.uint32)
  bits = jax.lax.shift_left(field, _u32(23)) + kept + up.astype(jnp.uint32)
  return jnp.minimum(bits, _u32(_INF_BITS))


def divide_by_bits(a, b, approx=jnp.divide):
  """a / b for float32 a, b (broadcast together), correctly rounded whatever the accuracy of `approx`.

  `approx` (the platform's float32 division) only proposes the quotient of the two significands, which integer
  arithmetic then corrects (`_floor_quotient`): any candidate within ~30 ulps gives the same, exact result.
  Follows IEEE 754 in full: round to nearest even, subnormal operands and results, signed zeros, inf / x = inf,
  x / inf = 0, x / 0 = inf for x != 0, and NaN for NaN operands, 0 / 0 and inf / inf.
  """
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  ba = jax.lax.bitcast_convert_type(a, jnp.uint32)
  bb = jax.lax.bitcast_convert_type(b, jnp.uint32)
  sign = (ba ^ bb) & _u32(_SIGN)
  ma, mb = ba & _u32(_MAGNITUDE), bb & _u32(_MAGNITUDE)
  sig_a, e_a = _significand_and_exponent(ma)
  sig_b, e_b = _significand_and_exponent(mb)
  small = sig_a < sig_b  # quotient of significands below 1: take one more bit of the numerator
  num = jax.lax.shift_left(sig_a, small.astype(jnp.uint32))
  q, sticky = _floor_quotient(num, sig_b, approx)
  e = e_a - e_b + 127 - small.astype(jnp.int32)
  bits = _round_to_bits(q, sticky, e)
  a_inf, b_inf = ma == _INF_BITS, mb == _INF_BITS
  a_zero, b_zero = ma == 0, mb == 0
  nan = (ma > _INF_BITS) | (mb > _INF_BITS) | (a_zero & b_zero) | (a_inf & b_inf)
  bits = jnp.where(a_inf | b_zero, _u32(_INF_BITS), jnp.where(a_zero | b_inf, _u32(0), bits))
  bits = jnp.where(nan, _u32(_NAN_BITS), bits | sign)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _cpu_divide(a, b):
  """XLA:CPU's IEEE divide, kept from XLA's rewrite of a division by a constant or by a broadcast (scalar or row)
  into a multiplication by the rounded reciprocal (off by an ulp for about half of all inputs): the divisor is made
  elementwise in `a` (b, or a itself where a is NaN, which gives the same NaN), so there is no broadcast to rewrite.
  No optimization barrier: one would keep each division out of its neighbours' kernels."""
  return a / jnp.where(jnp.isnan(a), a, b)


@jax.custom_jvp
def divide(a, b):
  """a / b in float32 (broadcast together), correctly rounded on every backend and under jax.vmap: XLA's divide on
  the CPU, `divide_by_bits` elsewhere."""
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  return jax.lax.platform_dependent(a, b, cpu=_cpu_divide, default=divide_by_bits)


@divide.defjvp
def _divide_jvp(primals, tangents):
  a, b = primals
  da, db = tangents
  q = divide(a, b)
  return q, (da - q * db) / b
