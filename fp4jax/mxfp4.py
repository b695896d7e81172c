"""The MXFP4 (OCP Microscaling) block scale: a power of two stored as E8M0, per 32 elements.

The exponent is computed exactly from frexp (ml_dtypes' E8M0 cast rounds to the nearest power of two instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import grids

E8M0_BIAS = 127
E8M0_MIN_EXPONENT = -127
E8M0_MAX_EXPONENT = 127


def scale_exponent(amax_b, scale_rule: str):
  """Integer exponent e of the block scale 2^e.

  floor (OCP): e = floor(log2 amax_b) - 2, so amax_b / 2^e lies in [4, 8) and may saturate to 6.
  ceil (paper): e = ceil(log2(amax_b / 6)), the smallest e with 6 * 2^e >= amax_b: no saturation.
  With amax_b = m * 2^E (m in [0.5, 1)), ceil is floor + 1 exactly when m > 0.75.
  """
  mantissa, e_frexp = jnp.frexp(amax_b)
  e = e_frexp - 1 - 2
  if scale_rule == "ceil":
    e = e + (mantissa > 0.75).astype(e.dtype)
  return _clamped(e, amax_b)


def _clamped(e, amax_b):
  """e clamped to E8M0's range; a zero block gets the smallest exponent and an infinite one the largest (log2 of
  inf is inf; frexp(inf) gives exponent 0, which would scale the block's finite elements into saturation)."""
  e = jnp.where(amax_b > 0, e, E8M0_MIN_EXPONENT)
  e = jnp.where(amax_b == jnp.inf, E8M0_MAX_EXPONENT, e)
  return jnp.clip(e, E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)


def e4m3_scale_exponent(amax_b):
  """Exponent e of MXFP8's (E4M3 elements) block scale 2^e: the smallest e with 448 * 2^e >= amax_b, so nothing
  saturates. With amax_b = m * 2^E (m in [0.5, 1)) and 448 = 0.875 * 2^9: e = E - 9, plus 1 when m > 0.875."""
  mantissa, e_frexp = jnp.frexp(amax_b)
  e = e_frexp - 9 + (mantissa > 0.875).astype(e_frexp.dtype)
  return _clamped(e, amax_b)


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

  t >= 1e-8 is a normal float32, so frexp gives floor(log2 t) exactly (an all-zero group: e = -27).
  """
  t = sigma_b * jnp.float32(QUEST_SCALE) + jnp.float32(QUEST_EPS)
  _, e_frexp = jnp.frexp(t)
  return jnp.clip(e_frexp - 1, E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
