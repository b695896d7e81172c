"""The NVFP4 quantizer's scales, step by step (arXiv 2509.25149, App. B.1-B.3; docs/numerics.md, "Quantization").

All arithmetic is float32 and each line is one rounding, in the reference order: the order decides the bits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp4jax import grids

GLOBAL_RANGE = grids.E2M1_MAX * grids.E4M3_MAX  # 2688: the largest value a block can represent at S_enc = 1
_ONE_SIXTH = np.float32(1.0 / 6.0)  # NumPy, not jnp: importing fp4jax must not start a JAX backend


def global_encode_scale(amax):
  """S_enc = 2688 / amax, clamped to FLT_MAX; 1 when amax == 0 (or S_enc == 0, i.e. amax == inf). NaN propagates."""
  s_enc = jnp.minimum(jnp.float32(GLOBAL_RANGE) / amax, grids.FLT_MAX)
  return jnp.where((amax == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


def global_decode_scale(amax):
  """The dequantization multiplier amax / 2688 applied after code * block scale."""
  return grids.divide_by_constant(amax, GLOBAL_RANGE)


def block_scale(amax_b, s_enc):
  """s_b = E4M3(amax_b * (S_enc * (1/6))): one RNE rounding of that product, saturating at 448, no lower clamp."""
  return grids.round_e4m3(amax_b * (s_enc * _ONE_SIXTH), per_block=True)


def block_encode_scale(s_b, s_enc):
  """enc_b = min(1 / (s_b * S_dec), FLT_MAX) with S_dec = 1 / S_enc; a zero block scale gives FLT_MAX."""
  s_dec = jnp.float32(1.0) / s_enc
  return jnp.minimum(jnp.float32(1.0) / (s_b * s_dec), grids.FLT_MAX)


def scales(amax_b, amax):
  """(block scales as float32 E4M3 values, block encode scales) for block amaxes `amax_b` and tensor amax."""
  s_enc = global_encode_scale(amax)
  s_b = block_scale(amax_b, s_enc)
  return s_b, block_encode_scale(s_b, s_enc)

