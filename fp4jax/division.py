"""float32 division, correctly rounded on every backend.

The scales of the quantizers are quotients (NVFP4: S_enc = 2688 / amax, enc_b = 1 / (s_b * S_dec); FP8: 448 /
amax_b), and one ulp in a scale flips an element's code wherever the scaled element sits near a rounding midpoint.
XLA:CPU divides as IEEE 754 says (round to nearest even). XLA:GPU does not: it compiles a float32 divide to PTX
`div.full.f32` (up to 2 ulp off), and TPUs approximate too. On an H200, enc_b came out an ulp high often enough that
fp4jax.quantize differed from the CPU (and from the Pallas kernel, which divides with `div.rn.f32`) in 0.02-0.05 %
of the codes of bfloat16 tensors drawn on the device.

So `divide` picks per platform: the native divide on the CPU; on NVIDIA and AMD GPUs `divide_in_float64`, the
float64 quotient (IEEE-exact there) rounded to float32, which is the correctly rounded float32 quotient; elsewhere
`divide_by_bits`: the platform's division proposes the quotient of the operands' significands, an exact integer
residual corrects it, and the rounding to nearest even is done by hand (~70 operations, no loop). All of them are
spent only on per-block and per-tensor scales (1/16 of the elements or fewer); where XLA:GPU would recompute one
in every element of its consumer (the quantizers' scalings, the GEMM factors), `computed_once` keeps it out.
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


def _widen_exactly(x):
  """float32 `x` as float64 from its bits (call under jax.enable_x64): not a convert, which XLA:GPU's
  excess-precision rewrite would delete after a float64 -> float32 rounding (SimplifyFPConversions)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  field = jax.lax.shift_right_logical(bits, _u32(23)) & _u32(0xFF)
  frac = bits & _u32(_MANTISSA)
  sig = jnp.where(field == 0, frac, frac | _u32(_HIDDEN)).astype(jnp.float64)  # < 2^24: exact
  # 2^(field - 150) (2^-149 for subnormals) as float64 bits: the product below is exact.
  exp = (jnp.maximum(field, _u32(1)).astype(jnp.uint64) + jnp.uint64(1023 - 150))
  value = sig * jax.lax.bitcast_convert_type(jax.lax.shift_left(exp, jnp.uint64(52)), jnp.float64)
  value = jnp.where(field == 0xFF, jnp.where(frac == 0, jnp.float64(jnp.inf), jnp.float64(jnp.nan)), value)
  return jnp.where((bits & _u32(_SIGN)) != 0, -value, value)


def divide_in_float64(a, b):
  """a / b for float32 a, b, correctly rounded: the float64 quotient (IEEE-exact on NVIDIA and AMD GPUs, as PTX
  div.rn.f64) rounded to float32. Rounding twice is harmless here: float64 carries 53 >= 2 * 24 + 2 bits, enough for
  every quotient of float32 operands (Figueroa, "When is double rounding innocuous?", 1995), subnormal results
  included, and no float32 quotient over- or underflows float64. Traced with 64-bit types switched on for just
  these few operations; the operands are widened from their bits (_widen_exactly)."""
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  with jax.enable_x64(True):
    q = _widen_exactly(a) / _widen_exactly(b)
    # A float32-subnormal quotient is rounded to its multiple of 2^-149 here and assembled from bits: a converting
    # or multiplying float32 unit may flush it to zero (XLA:CPU does; a 2^-149 multiple below 2^23 is exact).
    mag = jnp.abs(q)
    m = jnp.round(mag * jnp.float64(2.0**149)).astype(jnp.uint32)  # round half to even
    sign = jnp.where(jnp.signbit(q), _u32(_SIGN), _u32(0))
    tiny = jax.lax.bitcast_convert_type(m | sign, jnp.float32)
    return jnp.where(mag < jnp.float64(2.0**-126), tiny, q.astype(jnp.float32))


def _cpu_divide(a, b):
  """XLA:CPU's IEEE divide, kept from XLA's rewrite of a division by a constant or by a broadcast (scalar or row)
  into a multiplication by the rounded reciprocal (off by an ulp for about half of all inputs): the divisor is made
  elementwise in `a` (b, or a itself where a is NaN, which gives the same NaN), so there is no broadcast to rewrite.
  No optimization barrier: one would keep each division out of its neighbours' kernels."""
  return a / jnp.where(jnp.isnan(a), a, b)


def computed_once(*quotients):
  """The arguments unchanged; off the CPU behind an optimization barrier, so that each is computed once.

  XLA:GPU fuses a scalar or per-block producer into every per-element kernel that reads it when it deems the
  producer cheap, and it did so with these quotients: compiled for sm_90, the `small` nvfp4 train step recomputed
  per-tensor and per-block scale quotients in every element of the 2D weight quantizers and of Wgrad's output
  scaling (with `divide_by_bits`, ~70 integer operations per quotient per element). Behind the barrier they are
  computed in the per-block and scalar kernels. XLA:CPU does not duplicate its native divide (fp4jax.quantize's
  pitfalls), so the CPU gets no barrier and its programs stay as they were. Returns a tuple (one per argument).
  """
  return jax.lax.platform_dependent(*quotients, cpu=lambda *q: q,
                                    default=lambda *q: tuple(jax.lax.optimization_barrier(q)))


def computed_apart(x):
  """`x` unchanged, computed in a kernel of its own rather than in every element of a broadcasting consumer.

  On the CPU it becomes x / 1 (exact; NaN stays NaN): XLA:CPU removes optimization barriers before fusion but does
  not duplicate a divide into a consumer that broadcasts it. Elsewhere `computed_once`'s barrier keeps it out.
  """
  return jax.lax.platform_dependent(x, cpu=lambda x: _cpu_divide(x, jnp.ones_like(x)),
                                    default=lambda x: jax.lax.optimization_barrier(x))


@jax.custom_jvp
def divide(a, b):
  """a / b in float32 (broadcast together), correctly rounded on every backend and under jax.vmap: XLA's divide on
  the CPU, `divide_in_float64` on NVIDIA and AMD GPUs, `divide_by_bits` elsewhere (TPU)."""
  a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  return jax.lax.platform_dependent(a, b, cpu=_cpu_divide, cuda=divide_in_float64, rocm=divide_in_float64,
                                    default=divide_by_bits)


@divide.defjvp
def _divide_jvp(primals, tangents):
  a, b = primals
  da, db = tangents
  q = divide(a, b)
  return q, (da - q * db) / b
