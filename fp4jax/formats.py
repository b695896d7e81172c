"""Number formats: what a quantized tensor is made of (elements, block scales, per-tensor scale).

Formats are frozen, hashable dataclasses, so they can be static arguments of `jax.jit` and fields of recipes.
Change a field with `fmt.replace(...)`, e.g. `MXFP4().replace(scale_rule="ceil")` or `MXFP4(scale_rule="ceil")`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Union

import jax.numpy as jnp


class _Format:
  """Shared helpers of the format dataclasses."""

  name: str
  block_size: int

  def replace(self, **changes):
    """Returns a copy with `changes` applied (validated)."""
    return dataclasses.replace(self, **changes)

  @property
  def is_fp4(self) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class NVFP4(_Format):
  """NVIDIA NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one FP32 per-tensor scale (stored as amax).

  Two-level scaling (spec section 2): the per-tensor encode scale `2688 / amax` maps the tensor's largest block
  to the top of E4M3 x E2M1 (448 * 6), so block scales stay in E4M3's range whatever the tensor's magnitude.
  """

  block_size: int = 16
  name: str = dataclasses.field(default="nvfp4", init=False)

  def __post_init__(self):
    if self.block_size != 16:
      raise ValueError(f"NVFP4 uses 16-element blocks; got block_size={self.block_size}.")

  elem_max = 6.0
  scale_max = 448.0
  scale_dtype = jnp.float8_e4m3fn

  @property
  def is_fp4(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class MXFP4(_Format):
  """OCP MXFP4: E2M1 elements, one power-of-two E8M0 scale per 32 elements, no per-tensor scale.

  scale_rule:
    "floor": OCP rule, scale = 2^(floor(log2 amax_b) - 2); the block max may saturate to 6.
    "ceil":  the paper's rule, scale = 2^ceil(log2(amax_b / 6)); never saturates.
  """

  scale_rule: Literal["floor", "ceil"] = "floor"
  block_size: int = 32
  name: str = dataclasses.field(default="mxfp4", init=False)

  def __post_init__(self):
    if self.scale_rule not in ("floor", "ceil"):
      raise ValueError(f"MXFP4 scale_rule must be 'floor' or 'ceil'; got {self.scale_rule!r}.")
    if self.block_size != 32:
      raise ValueError(f"MXFP4 uses 32-element blocks; got block_size={self.block_size}.")

  elem_max = 6.0
  scale_dtype = jnp.float8_e8m0fnu

  @property
  def is_fp4(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class FP8(_Format):
  """FP8 E4M3 with current (just-in-time) scaling: the paper's FP8 baseline.

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
    if self.block_size < 1:
      raise ValueError(f"FP8 block_size must be positive; got {self.block_size}.")

  elem_max = 448.0
  scale_dtype = jnp.float32


Format = Union[NVFP4, MXFP4, FP8]

_NAMED = {
    "nvfp4": NVFP4(),
    "mxfp4": MXFP4(),
    "mxfp4_ceil": MXFP4(scale_rule="ceil"),
    "fp8": FP8(),
    "fp8_tensor": FP8(scaling="tensor"),
}


def get_format(fmt: str | Format) -> Format:
  """Returns the format named `fmt` (one of FORMAT_NAMES), or `fmt` itself if it already is a format."""
  if isinstance(fmt, (NVFP4, MXFP4, FP8)):
    return fmt
  if isinstance(fmt, str) and fmt.lower() in _NAMED:
    return _NAMED[fmt.lower()]
  raise ValueError(f"Unknown format {fmt!r}; expected one of {sorted(_NAMED)} or an NVFP4/MXFP4/FP8 instance.")


FORMAT_NAMES = tuple(sorted(_NAMED))
