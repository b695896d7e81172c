"""The MXFP4 (OCP Microscaling) block scale: a power of two stored as E8M0, per 32 elements.

The exponent is computed exactly from frexp (ml_dtypes' E8M0 cast rounds to the nearest power of two instead).

E8M0 reaches 2^127, but a block's grid must also fit float32, whose largest value is 3.4e38 < 2^128: under the rules
that round the scale up, a block with amax above ~2.98e38 got 2^126, and its max rounded to E2M1's 4 decoded to
4 * 2^126 = 2^128 = inf. So each rule's exponent is capped where the top of its grid, top * 2^e, is still finite
(`max_exponent`); such a block saturates at that top instead (2.55e38 for E2M1), as the OCP "floor" rule's does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import grids

E8M0_BIAS = 127
E8M0_MIN_EXPONENT = -127
E8M0_MAX_EXPONENT = 127


def max_exponent(top: float) -> int:
  """The largest scale exponent e whose grid top * 2^e is a finite float32 (E8M0's 127 at most): 125 for E2M1's 6,
  124 for Tseng's decoded 6 * 4/3, 119 for E4M3's 448."""
  return min(E8M0_MAX_EXPONENT, math.floor(math.log2(float(np.finfo(np.float32).max) / top)))


def scale_exponent(amax_b, scale_rule: str, top: float = grids.E2M1_MAX):
  """Integer exponent e of the block scale 2^e.

  floor (OCP): e = floor(log2 amax_b) - 2, so amax_b / 2^e lies in [4, 8) and may saturate to 6.
  ceil (paper): e = ceil(log2(amax_b / 6)), the smallest e with 6 * 2^e >= amax_b: no saturation.
  With amax_b = m * 2^E (m in [0.5, 1)), ceil is floor + 1 exactly when m > 0.75.
  top: the largest decoded element value in units of the scale (6; Tseng's 6 * 4/3); e is capped at
  max_exponent(top), which only "ceil" reaches (amax_b > 6 * 2^125 = 2.55e38) and Tseng's (amax_b >= 2^127).
  """
  mantissa, e_frexp = jnp.frexp(amax_b)
  e = e_frexp - 1 - 2
  if scale_rule == "ceil":
    e = e + (mantissa > 0.75).astype(e.dtype)
  return _clamped(e, amax_b, max_exponent(top))


def _clamped(e, amax_b, e_max: int):
  """e clamped to [E8M0's smallest, e_max]; a zero block gets the smallest exponent and an infinite one E8M0's
  largest (log2 of inf is inf; frexp(inf) gives exponent 0, which would scale the block's finite elements into
  saturation; at 2^127 they flush to 0 and the inf decodes to inf)."""
  e = jnp.where(amax_b > 0, e, E8M0_MIN_EXPONENT)
  e = jnp.clip(e, E8M0_MIN_EXPONENT, e_max)
  return jnp.where(amax_b == jnp.inf, E8M0_MAX_EXPONENT, e)


def e4m3_scale_exponent(amax_b):
  """Exponent e of MXFP8's (E4M3 elements) block scale 2^e: the smallest e with 448 * 2^e >= amax_b, so nothing
  saturates. With amax_b = m * 2^E (m in [0.5, 1)) and 448 = 0.875 * 2^9: e = E - 9, plus 1 when m > 0.875.
  Capped at max_exponent(448) = 119: a block with amax_b above 448 * 2^119 = 2.98e38 saturates at it (2^120 rounded
  its max to 256 * 2^120 = inf)."""
  mantissa, e_frexp = jnp.frexp(amax_b)
  e = e_frexp - 9 + (mantissa > 0.875).astype(e_frexp.dtype)
  return _clamped(e, amax_b, max_exponent(grids.E4M3_MAX))


def scale_by_pow2(x, e):
  """x * 2^e exactly for e in [-252, 254], in two steps so each factor stays a normal float32."""
  half = jnp.floor_divide(e, 2)
  return x * grids.pow2(half) * grids.pow2(e - half)


def pow2_factors(e):
  """Two float32 factors whose product is 2^e, for per-block exponents e in [-252, 252]: x * f0 * f1 equals
  scale_by_pow2(x, e) bit for bit.

  The factors are formed as exact reciprocals (1 / 2^-h): XLA does not duplicate a divide into a broadcasting
  consumer, so when they are broadcast over the blocks the exponent arithmetic runs once per block, not per element.
  """
  half = jnp.floor_divide(e, 2)
  one = jnp.float32(1.0)
  return one / grids.pow2(-half), one / grids.pow2(half - e)


def encode_scales(e, amax_b):
  """E8M0 storage of exponents e; NaN blocks get the E8M0 NaN (0xFF)."""
  bits = jnp.where(jnp.isnan(amax_b), 0xFF, e + E8M0_BIAS).astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)


def decode_exponents(scales):
  """Exponents e (int32) of stored E8M0 scales, and a mask of NaN scales."""
  bits = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
  return bits - E8M0_BIAS, bits == 0xFF


# QuEST (arXiv 2502.05003) as Quartet uses it (arXiv 2505.14669; IST-DASLab/Quartet,
# src/models/quantization/quantizers/mxfp4.py, QuestMXFP4Quantizer): the scale is the power of two at or below
# sigma * 2.92247856 / 6 + 1e-8, where 2.92247856 sigma is the MSE-optimal clipping range of E2M1 for Gaussian data
# and 1e-8 keeps an all-zero group's scale finite.
QUEST_SCALE = 2.92247856 / 6.0
QUEST_EPS = 1e-8
# Tseng et al. (arXiv 2502.20586; amazon-science/mxfp4-llm): elements encoded at 3/4 of the OCP floor scale, so the
# block max lands in [3, 6) and never saturates (stochastic rounding stays unbiased); the GEMM output is scaled back.
TSENG_ENCODE = 0.75
TSENG_DECODE = 4.0 / 3.0


def quest_exponent(sigma_b):
  """Integer exponent e of QuEST's block scale 2^e: floor(log2(sigma * QUEST_SCALE + QUEST_EPS)), in float32.

  t >= 1e-8 is a normal float32, so frexp gives floor(log2 t) exactly (an all-zero group: e = -27). Capped at
  max_exponent(6) = 125: sigma above ~1.75e38 gave 2^126, where elements rounded to 4 decoded to inf.
  """
  t = sigma_b * jnp.float32(QUEST_SCALE) + jnp.float32(QUEST_EPS)
  _, e_frexp = jnp.frexp(t)
  return jnp.clip(e_frexp - 1, E8M0_MIN_EXPONENT, max_exponent(grids.E2M1_MAX))
