"""The NVFP4 quantizer's scales, step by step (arXiv 2509.25149, App. B.1-B.3; docs/numerics.md, "Quantization").

All arithmetic is float32 and each line is one rounding, in the reference order: the order decides the bits.

Variants (selected by `formats.NVFP4` fields), all the same two-level scheme with other constants:
  * `global_range` R = target * bound: the tensor encode scale is R / amax. NVIDIA: 6 * 448.
  * `target`: the element value a block's amax maps to; the block scale is amax_b * S_enc / target.
  * round_up: the E4M3 block scale rounded up instead of to nearest, so no element saturates (unbiased SR) beyond
    the float32 rounding of the scale product (`ROUND_UP_SLACK`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp4jax import division
from fp4jax import grids

GLOBAL_RANGE = grids.E2M1_MAX * grids.E4M3_MAX  # 2688: the largest value a block can represent at S_enc = 1
_ONE_SIXTH = np.float32(1.0 / 6.0)  # NumPy, not jnp: importing fp4jax must not start a JAX backend
# Relative slack of the round-up rule: amax_b * S_enc / 6 carries a few float32 roundings, so a block scale that
# dequantized values reproduce (re-quantization) lands a few ulps above its E4M3 value; without the slack it would
# move a whole E4M3 step (~8 %) up and quantize -> dequantize -> quantize would not be idempotent. 2^-21 = 4 ulps.
ROUND_UP_SLACK = 2.0**-21


def global_encode_scale(amax, global_range: float = GLOBAL_RANGE):
  """S_enc = 2688 / amax, clamped to FLT_MAX; 1 when amax == 0 (or S_enc == 0, i.e. amax == inf). NaN propagates."""
  s_enc = jnp.minimum(division.divide(jnp.float32(global_range), amax), grids.FLT_MAX)
  return jnp.where((amax == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)


def global_decode_scale(amax, global_range: float = GLOBAL_RANGE):
  """The dequantization multiplier amax / 2688 applied after code * block scale."""
  return grids.divide_by_constant(amax, global_range)


def block_scale(amax_b, s_enc, inv_target=_ONE_SIXTH, round_up: bool = False):
  """s_b = E4M3(amax_b * (S_enc * (1/6))): one RNE rounding of that product, saturating at 448, no lower clamp.

  inv_target: float32 1/target (1/6 for NVIDIA's recipe). round_up: round the product up to the next E4M3 value
  instead (still saturating at 448), so amax_b * S_enc / s_b <= target * (1 + ROUND_UP_SLACK): no element
  saturates by more than float32 rounding (a value that far above 6 rounds to 6 with a bias under 5e-7).
  """
  v = amax_b * (s_enc * jnp.float32(inv_target))
  return round_e4m3_up(v) if round_up else grids.round_e4m3(v, per_block=True)


def round_e4m3_up(v):
  """Non-negative float32 `v` rounded up to an E4M3 value (ceil on the E4M3 grid), saturating at 448; NaN stays."""
  r = grids.round_e4m3(v, per_block=True)
  # RNE lands at most one E4M3 step below v; that step is the quantum of r's binade (r < v never crosses a binade
  # upward: a power of two is on the grid). Stepping from r, not from v, avoids a ceil on scaled values.
  quantum = grids.pow2(jnp.maximum(grids.exponent_of(r), grids.E4M3_MIN_EXPONENT) - grids.E4M3_MANTISSA_BITS)
  up = jnp.where(r > 0, r + quantum, jnp.float32(2.0**-9))
  return jnp.where(r * jnp.float32(1.0 + ROUND_UP_SLACK) < v, jnp.minimum(up, jnp.float32(grids.E4M3_MAX)), r)


def block_encode_scale(s_b, s_enc):
  """enc_b = min(1 / (s_b * S_dec), FLT_MAX) with S_dec = 1 / S_enc; a zero block scale gives FLT_MAX."""
  s_dec = division.divide(jnp.float32(1.0), s_enc)
  return jnp.minimum(division.divide(jnp.float32(1.0), s_b * s_dec), grids.FLT_MAX)


def scales(amax_b, amax, *, global_range: float = GLOBAL_RANGE, inv_target=_ONE_SIXTH, round_up: bool = False):
  """(block scales as float32 E4M3 values, block encode scales) for block amaxes `amax_b` and tensor amax."""
  s_enc = global_encode_scale(amax, global_range)
  s_b = block_scale(amax_b, s_enc, inv_target, round_up)
  return s_b, block_encode_scale(s_b, s_enc)

