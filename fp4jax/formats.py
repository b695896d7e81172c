"""Number formats: what a quantized tensor is made of (elements, block scales, per-tensor scale).

Formats are frozen, hashable dataclasses, so they can be static arguments of `jax.jit` and fields of recipes.
Change a field with `fmt.replace(...)`, e.g. `MXFP4().replace(scale_rule="ceil")` or `MXFP4(scale_rule="ceil")`.

Each format owns its rules: how block scales follow from block and tensor amaxes (`scaling_from_amax`), how
stored scales decode (`scaling_from_stored`), how element values are stored (`pack` / `unpack`), whether it has one
scale per tensor (`per_tensor`). `quantize.py` only calls these; the arithmetic lives in nvfp4.py, mxfp4.py, fp8.py.

This module holds the FP4 formats (NVFP4, MXFP4) and the registry of named formats (`get_format`); FP8 and MXFP8
live in formats_fp8.py, the shared `Scaling` and base class in formats_base.py (all re-exported here).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal, Union

import jax.numpy as jnp
import numpy as np

from fp4jax import cli_values
from fp4jax import division
from fp4jax import grids
from fp4jax import mxfp4
from fp4jax import nvfp4
from fp4jax.formats_base import FormatBase, Scaling  # Scaling re-exported: formats.Scaling
from fp4jax.formats_fp8 import FP8, MXFP8  # re-exported: formats.FP8, formats.MXFP8


NVFP4_SCALE_RULES = ("nearest", "up", "4over6", "eden")
FOUR_OVER_SIX_SELECT = ("mse", "mae", "absmax")
FOUR_OVER_SIX_SELECT_ON = ("rounded", "nearest")
FOUR_OVER_SIX_E4M3_BOUND = 256.0
_HEADROOM = 16.0 / 17.0
EDEN_ELEM_MAX = 6.0 / ((17.0 / 16.0) * 0.93)  # Quartet II's backward: block max -> 6.07, a little saturation
EDEN_E4M3_BOUND = 255.99
DOUBLE_BLOCK_GROUP = 8  # blocks of 16 per double-block group (1x128)


def _f32(v: float) -> float:
  """`v` rounded to the nearest float32 (the constants the float32 arithmetic uses)."""
  return float(np.float32(v))


class _FP4Format(FormatBase):
  """E2M1 elements: 4-bit codes, packed two per byte along the quantized axis."""

  is_fp4 = True
  elem_max = grids.E2M1_MAX

  def pack(self, codes, axis: int):
    """Storage of E2M1 codes (integers 0..15): uint8, two per byte along `axis` (element 2i in the low nibble)."""
    return grids.pack_nibbles(codes.astype(jnp.uint8), axis)

  def unpack(self, stored, axis: int):
    """float32 element values of stored codes."""
    return grids.e2m1_decode(grids.unpack_nibbles(stored, axis))


@dataclasses.dataclass(frozen=True)
class NVFP4(_FP4Format):
  """NVIDIA NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one FP32 per-tensor scale (stored as amax).

  Two-level scaling (arXiv 2509.25149, Sec. 2 and App. B): the per-tensor encode scale `2688 / amax` maps the
  tensor's largest block to the top of E4M3 x E2M1 (448 * 6), so block scales stay in E4M3's range whatever the
  tensor's magnitude.

  scale_rule:
    "nearest": NVIDIA's rule, the block scale amax_b * S_enc / 6 rounded to the nearest E4M3 value. When it rounds
      down (about half the blocks) the block max scales above 6 and saturates, which biases stochastic rounding.
    "up": that block scale rounded up to the next E4M3 value, so nothing saturates and stochastic rounding is
      unbiased at the block maxima too (Quartet II, arXiv 2601.22813, makes the same point; fouroversix's
      "stochastic_unbiased" rounding).
    "4over6": Four Over Six (arXiv 2512.02010; mit-han-lab/fouroversix,
      src/fouroversix/quantize/pytorch/reference.py): each block is quantized twice, its max mapped to 6 and to 4,
      and keeps the candidate whose dequantized values are closer to the input by `select`. The tensor scale uses
      an E4M3 bound of 256 instead of 448 (S_enc = 6 * 256 / amax), so the "4" candidate's 1.5x larger block
      scale still fits in E4M3. Ties keep the "6" candidate. With stochastic rounding both candidates use the
      same random bits.
    "eden": Quartet II's MS-EDEN backward quantizer (arXiv 2601.22813; see eden.py): block max -> 6 / (17/16 *
      0.93), E4M3 bound 255.99, elements always round to nearest, then each `eden_group`-element group's
      correction sum(y^2) / sum(y q(y)) is multiplied into its block scales, which `rounding="stochastic"` rounds
      stochastically to a neighbouring E4M3 value ("nearest": to the nearest one). 1D blocks only.
  select: the 4/6 error per block: "mse" (sum of squares), "mae" (sum of magnitudes) or "absmax" (largest).
  select_on: what the 4/6 errors are measured on. "rounded" (the reference's): each candidate rounded as the operand
    is, so with stochastic rounding the choice keeps the better draw, a selection on the random bits that biases
    SR (+1.2 % at block maxima with headroom, docs/numerics.md). "nearest": the candidates rounded to nearest; the
    chosen scaling is then rounded as the operand is, so the choice does not see the random bits and SR with
    `headroom` stays unbiased. The same bits as "rounded" under round-to-nearest.
  headroom: encode elements at 16/17 of their scale (block max at 6 * 16/17) and undo it in the tensor decode
    scale: E4M3 rounding moves a normal block scale down by at most a factor 16/17, so no element saturates (the
    other cure for the stochastic-rounding bias; fouroversix's rounding "adjustment factor"). Subnormal E4M3 scales
    (blocks under ~3.5e-5 of the tensor amax) can round down by up to a third: SR is biased there; "up" is not.
  double_block: TetraJet-v2's "double-block" scaling (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training,
    kernels/baseline_fakequant/nvfp4_quant_fused_kernel.py): the FP32 second-level scale comes from the amax of
    each 1x128 group (8 blocks along the blocked axis) instead of the whole tensor, so one outlier only coarsens
    its own group. The QArray then stores one amax per group (float32, the scales' shape with the blocked axis
    divided by 8, rounded up). 1D blocks only.
  eden_group: elements per MS-EDEN correction group (16 times a power of two; "eden" only). Quartet II corrects
    over each Hadamard tile (IST-DASLab/Quartet-II, schemes/quartet_2.py, `eden_1x16s_fp4_kernel`), so a recipe's
    RHT size must equal it (checked by fp4jax.Recipe); 128 is the paper's.
  """

  block_size: int = 16
  scale_rule: Literal["nearest", "up", "4over6", "eden"] = "nearest"
  select: Literal["mse", "mae", "absmax"] = "mse"
  headroom: bool = False
  double_block: bool = False
  eden_group: int = 128
  select_on: Literal["rounded", "nearest"] = "rounded"  # last: the earlier fields keep their positions
  name: str = dataclasses.field(default="nvfp4", init=False)

  def __post_init__(self):
    if self.block_size != 16 or not isinstance(self.block_size, numbers.Integral):  # 16.0 breaks reshapes
      raise ValueError(f"NVFP4 uses 16-element blocks; got block_size={self.block_size!r}.")
    if self.scale_rule not in NVFP4_SCALE_RULES:
      raise ValueError(f"NVFP4 scale_rule must be one of {NVFP4_SCALE_RULES}; got {self.scale_rule!r}.")
    if self.select not in FOUR_OVER_SIX_SELECT:
      raise ValueError(f"NVFP4 select must be one of {FOUR_OVER_SIX_SELECT}; got {self.select!r}.")
    if self.select_on not in FOUR_OVER_SIX_SELECT_ON:
      raise ValueError(f"NVFP4 select_on must be one of {FOUR_OVER_SIX_SELECT_ON}; got {self.select_on!r}.")
    if self.select_on != "rounded" and self.scale_rule != "4over6":
      raise ValueError(f"NVFP4 select_on applies to scale_rule='4over6' only; got select_on={self.select_on!r} with "
                       f"scale_rule={self.scale_rule!r}.")
    for flag in ("headroom", "double_block"):
      if not isinstance(getattr(self, flag), bool):
        raise ValueError(f"NVFP4 {flag} must be True or False; got {getattr(self, flag)!r}.")
    g = self.eden_group
    if not isinstance(g, numbers.Integral) or isinstance(g, bool) or g < 16 or g % 16 or (g // 16) & (g // 16 - 1):
      raise ValueError(f"NVFP4 eden_group must be 16 times a power of two (16, 32, 64, 128, ...): the correction "
                       f"sums its blocks pairwise; got {g!r}.")
    object.__setattr__(self, "eden_group", int(g))  # np.int64(128) names and compares as 128
    if g != 128 and self.scale_rule != "eden":
      raise ValueError(f"NVFP4 eden_group applies to scale_rule='eden' only; got eden_group={g} with "
                       f"scale_rule={self.scale_rule!r}.")

  scale_max = grids.E4M3_MAX
  scale_dtype = jnp.float8_e4m3fn

  @property
  def corrects_scales(self) -> bool:
    """Block scales are corrected after the elements are rounded (MS-EDEN), see eden.py."""
    return self.scale_rule == "eden"

  @property
  def label(self) -> str:
    """Short name with the options that change the bits, e.g. 'nvfp4(4over6:mae)'."""
    tags = [] if self.scale_rule == "nearest" else [self.scale_rule]
    if self.scale_rule == "4over6" and self.select != "mse":
      tags[-1] += ":" + self.select
    if self.select_on == "nearest":
      tags[-1] += "@nearest"
    if self.headroom:
      tags.append("16/17")
    if self.double_block:
      tags.append("1x128")
    if self.eden_group != 128:
      tags.append(f"group{self.eden_group}")
    return self.name + (f"({','.join(tags)})" if tags else "")

  @property
  def _factor(self) -> float:
    return _HEADROOM if self.headroom else 1.0

  @property
  def global_range(self) -> float:
    """float32 R with S_enc = R / amax: 6 * E4M3 bound (448, or 256 for 4/6), times 16/17 with headroom."""
    if self.scale_rule == "eden":
      return _f32(EDEN_ELEM_MAX * EDEN_E4M3_BOUND * self._factor)
    bound = FOUR_OVER_SIX_E4M3_BOUND if self.scale_rule == "4over6" else grids.E4M3_MAX
    return _f32(grids.E2M1_MAX * bound * self._factor)

  @property
  def targets(self) -> tuple[float, ...]:
    """The element value(s) a block max maps to: (6,), or (6, 4) for 4/6 (times 16/17 with headroom)."""
    ts = ((grids.E2M1_MAX, 4.0) if self.scale_rule == "4over6" else
          (EDEN_ELEM_MAX,) if self.scale_rule == "eden" else (grids.E2M1_MAX,))
    return tuple(t * self._factor for t in ts)

  def group_amax(self, amax_b, block):
    """Double-block: the amax of each group of 8 blocks along the blocked axis (else None: one tensor amax)."""
    if not self.double_block:
      return None
    axes = [i for i, b in enumerate(block) if b > 1]
    if len(axes) != 1:
      raise ValueError("NVFP4 double_block scales need 1D blocks (1x16 along one axis); got 2D blocks.")
    a, n = axes[0], amax_b.shape[axes[0]]
    groups = -(-n // DOUBLE_BLOCK_GROUP)
    padded = jnp.pad(amax_b, [(0, groups * DOUBLE_BLOCK_GROUP - n if i == a else 0) for i in range(amax_b.ndim)])
    split = padded.shape[:a] + (groups, DOUBLE_BLOCK_GROUP) + padded.shape[a + 1:]
    g = padded.reshape(split)
    # NaN-propagating max (jnp.max may drop NaN on XLA:CPU, see blocks.int_max).
    return jnp.where(jnp.any(jnp.isnan(g), axis=a + 1), jnp.float32(jnp.nan), jnp.max(g, axis=a + 1))

  def _per_block(self, amax, scales_shape):
    """The second-level amax for every block: a scalar, or each 1x128 group's repeated over its 8 blocks."""
    if jnp.ndim(amax) == 0:
      return amax
    for i, (na, ns) in enumerate(zip(amax.shape, scales_shape)):
      if na != ns:
        return jnp.repeat(amax, DOUBLE_BLOCK_GROUP, axis=i, total_repeat_length=na * DOUBLE_BLOCK_GROUP)[
            tuple(slice(0, ns) if j == i else slice(None) for j in range(amax.ndim))]
    return amax

  def _scaling(self, amax_b, amax, target) -> Scaling:
    amax = self._per_block(amax, amax_b.shape)
    s_b, encode = nvfp4.scales(amax_b, amax, global_range=self.global_range, inv_target=_f32(1.0 / target),
                               round_up=self.scale_rule == "up")
    t_dec = nvfp4.global_decode_scale(amax, self.global_range)
    s_b, encode, t_dec = division.computed_once(s_b, encode, t_dec)  # once per block / tensor, not per element
    # s_b is exactly an E4M3 value: decoding with it equals decoding the stored float8 scale (NaN aside, which the
    # quantizer maps to a NaN tensor anyway). Per-group decode scales are applied per block, after s_b.
    if jnp.ndim(amax):
      return Scaling(s_b.astype(jnp.float8_e4m3fn), (encode,), (s_b, t_dec))
    return Scaling(s_b.astype(jnp.float8_e4m3fn), (encode,), (s_b,), t_dec)

  def scaling_from_amax(self, amax_b, amax) -> Scaling:
    """Scales from block amaxes and the tensor amax (float32); for 4/6, the "6" candidate."""
    return self._scaling(amax_b, amax, self.targets[0])

  def scaling_candidates(self, amax_b, amax):
    """The candidate scalings a block chooses from by `select` (4/6: max -> 6, max -> 4), or None if just one."""
    if len(self.targets) == 1:
      return None
    return tuple(self._scaling(amax_b, amax, t) for t in self.targets)

  def scaling_from_stored(self, scales, amax) -> Scaling:
    """Decode scales from stored E4M3 block scales and the stored amax (per 1x128 group with double_block)."""
    t_dec = nvfp4.global_decode_scale(self._per_block(amax, scales.shape), self.global_range)
    if jnp.ndim(amax):
      return Scaling(scales, (), (scales.astype(jnp.float32), t_dec))
    return Scaling(scales, (), (scales.astype(jnp.float32),), t_dec)


MXFP4_SCALE_RULES = ("floor", "ceil", "quest", "tseng")


@dataclasses.dataclass(frozen=True)
class MXFP4(_FP4Format):
  """OCP MXFP4: E2M1 elements, one power-of-two E8M0 scale per 32 elements, no per-tensor scale.

  scale_rule:
    "floor": OCP rule, scale = 2^(floor(log2 amax_b) - 2); the block max may saturate to 6.
    "ceil":  the paper's rule (arXiv 2509.25149, Sec. 2 and App. B.4), scale = 2^ceil(log2(amax_b / 6)); never
             saturates below amax_b = 6 * 2^125 = 2.55e38. Above, 2^126 would put the grid's top past float32 (4 *
             2^126 = 2^128 decoded to inf): the scale stays 2^125 and the block saturates there, as under "floor".
    "quest": QuEST's rule as Quartet's forward pass uses it (arXiv 2505.14669; IST-DASLab/Quartet,
             src/models/quantization/quantizers/mxfp4_triton.py): scale = 2^floor(log2(sigma * 2.92247856 / 6 +
             1e-8)), sigma the block's population standard deviation (mean-centred, ddof 0). Elements beyond 6
             times the scale saturate: `quantize_with_clip_mask` returns which did (the gradient mask). The repo's
             kernel rounds ties toward zero; here ties round to even, as every fp4jax rule.
    "tseng": Tseng et al.'s backward rule (arXiv 2502.20586; Quartet's AlbertTsengQuantizer): the "floor" scale,
             elements encoded at 3/4 of it (block max in [3, 6): no saturation, so stochastic rounding is
             unbiased) and decoded with a per-tensor factor 4/3. A block with amax >= 2^127 = 1.7e38 gets scale
             2^124, not 2^125 (whose top, 8 * 2^125 = 2^128, decoded to inf), and saturates at 8 * 2^124 = 2^127.
             A constant block under "quest" has sigma 0, so scale 2^-27, and all its elements clip.
  Every rule's exponent is capped where the grid's top is still a finite float32 (fp4jax.mxfp4.max_exponent): a
  "quest" block with sigma above ~1.75e38 gets 2^125 too.
  """

  scale_rule: Literal["floor", "ceil", "quest", "tseng"] = "floor"
  block_size: int = 32
  name: str = dataclasses.field(default="mxfp4", init=False)

  def __post_init__(self):
    if self.scale_rule not in MXFP4_SCALE_RULES:
      raise ValueError(f"MXFP4 scale_rule must be one of {MXFP4_SCALE_RULES}; got {self.scale_rule!r}.")
    if self.block_size != 32 or not isinstance(self.block_size, numbers.Integral):
      raise ValueError(f"MXFP4 uses 32-element blocks; got block_size={self.block_size!r}.")

  scale_dtype = jnp.float8_e8m0fnu

  @property
  def label(self) -> str:
    """Short name with the scale rule, e.g. 'mxfp4(ceil)'."""
    return f"{self.name}({self.scale_rule})"

  @property
  def uses_std(self) -> bool:
    """Block scales follow from each block's standard deviation (QuEST), not its amax."""
    return self.scale_rule == "quest"

  @property
  def tensor_factor(self) -> float:
    """The per-tensor decode factor after code x 2^e: 4/3 for "tseng", else 1."""
    return mxfp4.TSENG_DECODE if self.scale_rule == "tseng" else 1.0

  @property
  def _tensor_decode(self):
    return jnp.float32(self.tensor_factor) if self.scale_rule == "tseng" else None

  def scaling_from_amax(self, amax_b, amax) -> Scaling:
    """Scales from block amaxes (the tensor amax is not used: MXFP4 has no per-tensor scale)."""
    del amax
    if self.uses_std:
      raise ValueError("MXFP4 scale_rule 'quest' needs the blocks' standard deviations: use scaling_from_std.")
    rule = "floor" if self.scale_rule == "tseng" else self.scale_rule
    e = mxfp4.scale_exponent(amax_b, rule, top=grids.E2M1_MAX * self.tensor_factor)
    encode = mxfp4.pow2_factors(-e)
    if self.scale_rule == "tseng":
      encode = encode + (jnp.float32(mxfp4.TSENG_ENCODE),)
    return Scaling(mxfp4.encode_scales(e, amax_b), encode, mxfp4.pow2_factors(e), self._tensor_decode,
                   nan_blocks=jnp.isnan(amax_b))

  def scaling_from_std(self, sigma_b, amax_b) -> Scaling:
    """QuEST scales from the blocks' standard deviations; blocks holding NaN or inf store the E8M0 NaN."""
    bad = ~jnp.isfinite(amax_b) | jnp.isnan(sigma_b)
    e = jnp.where(bad, 0, mxfp4.quest_exponent(sigma_b))  # a definite exponent for the (NaN-decoding) block
    return Scaling(mxfp4.encode_scales(e, jnp.where(bad, jnp.nan, amax_b)), mxfp4.pow2_factors(-e),
                   mxfp4.pow2_factors(e), nan_blocks=bad)

  def scaling_from_stored(self, scales, amax) -> Scaling:
    """Decode scales from stored E8M0 block scales."""
    del amax
    e, is_nan = mxfp4.decode_exponents(scales)
    return Scaling(scales, (), mxfp4.pow2_factors(e), self._tensor_decode, nan_blocks=is_nan)


Format = Union[NVFP4, MXFP4, MXFP8, FP8]

_NAMED = {
    "nvfp4": NVFP4(),
    "nvfp4_4over6": NVFP4(scale_rule="4over6"),
    "nvfp4_up": NVFP4(scale_rule="up"),
    "mxfp4": MXFP4(),
    "mxfp4_ceil": MXFP4(scale_rule="ceil"),
    "mxfp4_quest": MXFP4(scale_rule="quest"),
    "mxfp4_tseng": MXFP4(scale_rule="tseng"),
    "mxfp8": MXFP8(),
    "fp8": FP8(),
    "fp8_tensor": FP8(scaling="tensor"),
}


def get_format(fmt: str | Format) -> Format:
  """Returns the format named `fmt` (one of FORMAT_NAMES), or `fmt` itself if it already is a format."""
  if isinstance(fmt, FormatBase):
    return fmt
  if isinstance(fmt, str) and fmt.lower() in _NAMED:
    return _NAMED[fmt.lower()]
  hint = cli_values.did_you_mean(fmt.lower(), _NAMED) if isinstance(fmt, str) else ""
  raise ValueError(f"Unknown format {fmt!r}{hint}; expected one of {sorted(_NAMED)} or an NVFP4/MXFP4/MXFP8/FP8 "
                   "instance.")


FORMAT_NAMES = tuple(sorted(_NAMED))
