"""The 8-bit formats: FP8 E4M3 with float32 scales (the paper's FP8 baseline) and OCP MXFP8 (OutControl's format).

Both store E4M3 elements unpacked (float8_e4m3fn). Named instances and `get_format`: fp4jax.formats.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

import jax.numpy as jnp

from fp4jax import fp8
from fp4jax import grids
from fp4jax import mxfp4
from fp4jax.formats_base import FormatBase, Scaling


@dataclasses.dataclass(frozen=True)
class FP8(FormatBase):
  """FP8 E4M3 with current (just-in-time) scaling: the paper's FP8 baseline (arXiv 2509.25149, App. A.1).

  scaling:
    "tensor": one float32 scale for the whole tensor (classic per-tensor current scaling).
    "block":  one float32 scale per `block_size` elements along the quantized axis (1x128 for activations and
              gradients), or per block_size x block_size tile with `block_2d=True` (128x128 for weights).
  Scale = amax / 448; elements = E4M3(x * (448 / amax)), round-to-nearest-even, saturating at +-448.
  """

  scaling: Literal["tensor", "block"] = "block"
  block_size: int = 128
  name: str = dataclasses.field(default="fp8", init=False)

  def __post_init__(self):
    if self.scaling not in ("tensor", "block"):
      raise ValueError(f"FP8 scaling must be 'tensor' or 'block'; got {self.scaling!r}.")
    if (isinstance(self.block_size, bool) or not isinstance(self.block_size, numbers.Integral)  # True, 64.0
        or self.block_size < 1):
      raise ValueError(f"FP8 block_size must be a positive int; got {self.block_size!r}.")

  elem_max = grids.E4M3_MAX
  scale_dtype = jnp.float32

  @property
  def per_tensor(self) -> bool:
    return self.scaling == "tensor"

  @property
  def label(self) -> str:
    """Short name with the scaling, e.g. 'fp8(block)'."""
    return f"{self.name}({self.scaling})"

  def scaling_from_amax(self, amax_b, amax) -> Scaling:
    """Scales from block amaxes (current scaling: amax / 448 per block, or per tensor)."""
    del amax
    decode, encode = fp8.scales(amax_b)
    return Scaling(decode, (encode,), (decode,))

  def scaling_from_stored(self, scales, amax) -> Scaling:
    """Decode scales from stored float32 block scales."""
    del amax
    return Scaling(scales, (), (scales.astype(jnp.float32),))

  def pack(self, values, axis: int):
    """Storage of E4M3 values (float32, already on the grid): float8_e4m3fn, unpacked."""
    del axis
    return values.astype(jnp.float8_e4m3fn)

  def unpack(self, stored, axis: int):
    """float32 element values of stored float8_e4m3fn values."""
    del axis
    return stored.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MXFP8(FormatBase):
  """OCP MXFP8 (E4M3): E4M3 elements, one power-of-two E8M0 scale per 32 elements, no per-tensor scale.

  The scale is 2^ceil(log2(amax_b / 448)), the smallest power of two that keeps the block max within E4M3's 448
  (TetraJet-v2's kernels round amax_b / 448 up to E8M0: thu-ml/TetraJet-v2-NVFP4Training, kernels/csrc/quant_fp8.cu
  and utils.hpp); elements round to nearest even. OutControl (fp4jax.outcontrol) runs outlier channels in it. The
  exponent is capped at 119 (448 * 2^119 = 2.98e38, the last finite grid): a block above saturates at that top.
  """

  block_size: int = 32
  name: str = dataclasses.field(default="mxfp8", init=False)

  def __post_init__(self):
    if self.block_size != 32 or not isinstance(self.block_size, numbers.Integral):
      raise ValueError(f"MXFP8 uses 32-element blocks; got block_size={self.block_size!r}.")

  elem_max = grids.E4M3_MAX
  scale_dtype = jnp.float8_e8m0fnu

  def scaling_from_amax(self, amax_b, amax) -> Scaling:
    """Scales from block amaxes; blocks holding NaN store the E8M0 NaN."""
    del amax
    e = mxfp4.e4m3_scale_exponent(amax_b)
    return Scaling(mxfp4.encode_scales(e, amax_b), mxfp4.pow2_factors(-e), mxfp4.pow2_factors(e),
                   nan_blocks=jnp.isnan(amax_b))

  def scaling_from_stored(self, scales, amax) -> Scaling:
    """Decode scales from stored E8M0 block scales."""
    del amax
    e, is_nan = mxfp4.decode_exponents(scales)
    return Scaling(scales, (), mxfp4.pow2_factors(e), nan_blocks=is_nan)

  pack = FP8.pack
  unpack = FP8.unpack


