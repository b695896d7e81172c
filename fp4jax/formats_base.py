"""What every number format shares: the `Scaling` a format hands the quantizer, and the base class of the formats.

The formats themselves: fp4jax.formats (NVFP4, MXFP4, and the registry of named formats), fp4jax.formats_fp8
(FP8, MXFP8).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


class Scaling(NamedTuple):
  """A tensor's scales in the form the quantizer applies them; per-block arrays have the scales' shape.

  stored: the block scales as a QArray stores them.
  encode: float32 per-block factors, applied left to right: x * encode[0] * encode[1] ... is on the element scale.
  decode: float32 per-block factors taking element values back, applied left to right (then `tensor_decode`).
  tensor_decode: float32 scalar applied after `decode` (NVFP4's amax / 2688), or None.
  nan_blocks: bool per block, blocks that decode to NaN whatever their elements (MXFP4's E8M0 NaN), or None.
  """

  stored: Any
  encode: tuple[Any, ...]
  decode: tuple[Any, ...]
  tensor_decode: Any = None
  nan_blocks: Any = None


class FormatBase:
  """Shared helpers of the format dataclasses."""

  def scaling_candidates(self, amax_b, amax):
    """Several candidate scalings to choose from per block, or None (the single `scaling_from_amax`)."""
    del amax_b, amax
    return None

  corrects_scales = False
  uses_std = False  # block scales from the blocks' standard deviations (MXFP4 "quest"), see quantize.py

  def group_amax(self, amax_b, block):
    """The second-level amaxes per group of blocks, or None (one amax for the whole tensor)."""
    del amax_b, block
    return None

  name: str
  block_size: int
  is_fp4 = False
  per_tensor = False  # one scale for the whole tensor instead of one per block

  def replace(self, **changes):
    """Returns a copy with `changes` applied (validated)."""
    return dataclasses.replace(self, **changes)

  @property
  def label(self) -> str:
    """Short name with the options that change the bits, e.g. 'mxfp4(ceil)'."""
    return self.name

