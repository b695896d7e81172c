"""Recipes: which format, block layout, rounding and RHT each operand of a linear layer's three GEMMs gets.

A linear layer y = x W (x [M tokens, K], W [K, N]) runs three GEMMs (arXiv 2509.25149, Sec. 4 and Fig. 5;
docs/numerics.md, "Recipe"):

  | GEMM  | lhs                                | rhs                              | contracted |
  | Fprop | x, 1x16 along K, RNE               | W, 16x16 2D, RNE                 | K          |
  | Dgrad | dY, 1x16 along N, SR               | W, the Fprop 2D codes reused     | N          |
  | Wgrad | dY, RHT + 1x16 along M, SR         | x, RHT + 1x16 along M, RNE       | M (tokens) |

`nvfp4()` is the paper's recipe; its keyword switches give the ablations. Recipes are frozen and hashable, so they
are static arguments of `jax.jit`: switching a model's recipe compiles once per distinct recipe.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

import numpy as np

from fp4jax import arg_checks
from fp4jax import formats
from fp4jax import prng
from fp4jax import recipe_names
from fp4jax import rht as rht_lib
# The newer presets (Four Over Six, TetraJet-v2, Quartet II, Quartet), re-exported: fp4jax.recipes.quartet2() etc.
from fp4jax.recipes_beyond import four_over_six, quartet, quartet2, tetrajet_v2

GEMMS = ("fprop", "dgrad", "wgrad")
BACKENDS = ("xla", "pallas")
RHT_SIGNS = ("fixed", "none", "per_call")
GEMM_MODES = ("auto", "bf16", "f32")
ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True)
class OperandConfig:
  """How one GEMM operand is quantized; `fmt=None` keeps it in high precision."""

  fmt: formats.Format | None = None
  block_2d: bool = False
  rounding: Literal["nearest", "stochastic"] = "nearest"
  rht: bool = False
  pad: bool = False  # zero-pad the contraction axis to the block size (FP8's 128-blocks on small layers)
  # Backward operands only (Dgrad's W, Wgrad's x): quantize the dequantized Fprop operand instead of the
  # high-precision tensor, so the backward sees the forward's quantized values (TetraJet-v2, Quartet II), in the
  # operand's dtype: a bfloat16 x's dequantized values are rounded to bfloat16 first (Quartet II's code does the same;
  # TetraJet-v2's kernels keep float32: ~1 % of the re-quantized codes differ, see recipes_beyond.tetrajet_v2).
  requantize: bool = False
  # Fprop operands only: the straight-through gradient of this operand is zeroed where its quantizer saturated
  # (|x / s| >= the element max), in the basis the quantizer saw (before the inverse Fprop RHT): QuEST's mask.
  clip_mask: bool = False

  def __post_init__(self):
    for field in ("block_2d", "rht", "pad", "requantize", "clip_mask"):
      object.__setattr__(self, field, arg_checks.flag(field, getattr(self, field)))
    if self.rounding not in ROUNDINGS:
      raise ValueError(f"rounding must be one of {ROUNDINGS}; got {self.rounding!r}.")
    if self.fmt is not None and not isinstance(self.fmt, formats.FormatBase):
      raise ValueError(f"fmt must be a fp4jax Format or None; got {self.fmt!r} (formats.get_format(name) builds one).")

  @property
  def quantized(self) -> bool:
    """Whether the operand is quantized (a format is set)."""
    return self.fmt is not None

  def describe(self) -> str:
    """One line: format, block layout, rounding and the operand's options ("NVFP4 1x16 SR RHT"; "bf16")."""
    if self.fmt is None:
      return "bf16"
    fmt, b = self.fmt, self.fmt.block_size
    layout = "tensor" if fmt.per_tensor else f"{b}x{b}" if self.block_2d else f"1x{b}"
    sr = "RNE, SR scales" if getattr(fmt, "scale_rule", None) == "eden" else "SR"  # EDEN's elements round to nearest
    parts = [fmt.label, layout, sr if self.rounding == "stochastic" else "RNE"]
    if self.rht:
      parts.append("RHT")
    if self.requantize:
      parts.append("of Fprop Q")
    if self.clip_mask:
      parts.append("clip-masked grad")
    return " ".join(parts)


HIGH_PRECISION = OperandConfig()


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """The two operands of one GEMM: lhs (activations or output gradient) and rhs (weight or activations)."""

  lhs: OperandConfig = HIGH_PRECISION
  rhs: OperandConfig = HIGH_PRECISION

  @property
  def quantized(self) -> bool:
    """Whether either operand is quantized."""
    return self.lhs.quantized or self.rhs.quantized

  @property
  def rht(self) -> bool:
    """Whether the GEMM's operands get the RHT (both or neither: Recipe checks)."""
    return self.lhs.rht or self.rhs.rht


HIGH_PRECISION_GEMM = GemmConfig()
_OPERAND_NAMES = {"fprop": ("x", "W"), "dgrad": ("dY", "W"), "wgrad": ("dY", "x")}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Per-GEMM quantization of a linear layer, plus the shared RHT and randomness settings.

  Attributes:
    name: label used in logs and tables.
    fprop, dgrad, wgrad: GemmConfig per GEMM (see the module docstring for what lhs/rhs are in each).
    rht_size: Hadamard tile size d (power of two, 2..256). Wgrad's RHT runs along tokens, padded to a multiple of
      d; Fprop's runs along K and Dgrad's along N, which d must divide (dot_general.check_layer_shape; the
      pretraining model checks every layer when it is configured).
    rht_signs: "fixed" (one sign vector for the whole run, the paper's default), "none" (plain Hadamard, an
      ablation) or "per_call" (fresh signs from the layer's key at every call).
    fprop_rht_signs: Fprop's own sign mode, or None for `rht_signs` (Quartet: a fixed Hadamard forward, "none",
      with per-call signs in the backward).
    random_bits: 32 (full-width uniforms) or 8 (hardware-style) for stochastic rounding.
    reuse_fprop_weight: Dgrad uses the transposed Fprop weight codes (needs the same 2D quantization in both).
    backend: "xla" (dequantize + matmul emulation) or "pallas" (pallas_kernels).
    sr_bits: stochastic-rounding bits: "hash" (counter-based, fused into the quantizer; fast) or "threefry"
      (jax.random.bits; the generator of earlier runs). See fp4jax.prng.
    gemm_mode: how the xla backend multiplies quantized operands: "f32" (dequantized float32 values at HIGHEST
      precision, the reference), "bf16" (code x block scale, exact in bf16, with float32 accumulation and the
      per-tensor scales applied to the output: a real FP4 GEMM up to summation order, and "f32" up to float32
      rounding, as "f32" rounds each decoded element and product; NVFP4 double-block scales are applied per 1x128
      group, after one bf16 GEMM each) or "auto" (the
      faster one on this machine: bf16 on GPUs, TPUs and AVX-512 CPUs, f32 on other CPUs; see
      fp4jax.gemm.auto_gemm_mode).
  """

  name: str = "bf16"
  fprop: GemmConfig = HIGH_PRECISION_GEMM
  dgrad: GemmConfig = HIGH_PRECISION_GEMM
  wgrad: GemmConfig = HIGH_PRECISION_GEMM
  rht_size: int = 16
  rht_signs: Literal["fixed", "none", "per_call"] = "fixed"
  fprop_rht_signs: Literal["fixed", "none", "per_call"] | None = None
  random_bits: int = 32
  reuse_fprop_weight: bool = True
  backend: Literal["xla", "pallas"] = "xla"
  sr_bits: Literal["hash", "threefry"] = "hash"
  gemm_mode: Literal["auto", "bf16", "f32"] = "auto"

  def __post_init__(self):
    rht_lib.check_size(self.rht_size)
    object.__setattr__(self, "reuse_fprop_weight", arg_checks.flag("reuse_fprop_weight", self.reuse_fprop_weight))
    if self.rht_signs not in RHT_SIGNS:
      raise ValueError(f"rht_signs must be one of {RHT_SIGNS}; got {self.rht_signs!r}.")
    if self.fprop_rht_signs is not None and self.fprop_rht_signs not in RHT_SIGNS:
      raise ValueError(f"fprop_rht_signs must be None or one of {RHT_SIGNS}; got {self.fprop_rht_signs!r}.")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}; got {self.backend!r}.")
    if self.random_bits not in (8, 32) or not isinstance(self.random_bits, numbers.Integral):  # 8.0: "nvfp4-sr8.0bit"
      raise ValueError(f"random_bits must be 8 or 32; got {self.random_bits!r}.")
    prng.check_sr_bits(self.sr_bits)
    if self.gemm_mode not in GEMM_MODES:
      raise ValueError(f"gemm_mode must be one of {GEMM_MODES}; got {self.gemm_mode!r}.")
    for gemm in GEMMS:
      cfg = getattr(self, gemm)
      if cfg.lhs.rht != cfg.rhs.rht:
        raise ValueError(f"{gemm}: RHT must apply to both operands (it is only exact when both are transformed).")
      for op in (cfg.lhs, cfg.rhs):  # MS-EDEN's correction groups are Quartet II's Hadamard tiles
        if cfg.rht and op.quantized and getattr(op.fmt, "scale_rule", None) == "eden" and \
            op.fmt.eden_group != self.rht_size:
          raise ValueError(f"{gemm}: NVFP4 scale_rule='eden' corrects groups of eden_group={op.fmt.eden_group} "
                           f"elements but the RHT size is {self.rht_size}; set eden_group={self.rht_size} (Quartet "
                           "II corrects over each Hadamard tile) or rht_size to the group.")
    for gemm, side, fprop_op in (("fprop", "lhs", None), ("fprop", "rhs", None), ("dgrad", "lhs", None),
                                 ("wgrad", "lhs", None), ("dgrad", "rhs", self.fprop.rhs),
                                 ("wgrad", "rhs", self.fprop.lhs)):
      op = getattr(self.gemm(gemm), side)
      if not op.requantize:
        continue
      if fprop_op is None:
        raise ValueError(f"{gemm}.{side}: requantize applies to Dgrad's W and Wgrad's x only.")
      if not (op.quantized and fprop_op.quantized):
        raise ValueError(f"{gemm}.{side}: requantize needs that operand and its Fprop counterpart quantized.")
    for gemm, side in (("dgrad", "lhs"), ("dgrad", "rhs"), ("wgrad", "lhs"), ("wgrad", "rhs")):
      if getattr(self.gemm(gemm), side).clip_mask:
        raise ValueError(f"{gemm}.{side}: clip_mask applies to Fprop operands only.")
    for side, op in (("lhs", self.fprop.lhs), ("rhs", self.fprop.rhs)):
      if op.clip_mask and not op.quantized:
        raise ValueError("clip_mask needs a quantized Fprop operand.")
      if op.quantized and op.rounding == "stochastic":  # the rule draws keys for Dgrad's and Wgrad's operands only
        raise ValueError(f"fprop.{side}: stochastic rounding applies to the backward's operands (gradients); Fprop "
                         "operands round to nearest.")

  def replace(self, **changes) -> "Recipe":
    """A copy with fields replaced. Unless `name` is among them, the name gets a tag per changed field
    ("nvfp4+rht_size=4"; a GEMM mode as the presets tag it, "-gemm:f32"), so logs and reports tell the two apart."""
    if "name" not in changes:
      name = self.name
      for field, value in changes.items():
        if getattr(self, field) == value:
          continue
        if field == "gemm_mode":
          old = recipe_names.gemm_tag(self.gemm_mode)
          # The old tag may sit before later tags ("nvfp4-gemm:f32+bf16fwd"): a stale one would name the wrong mode.
          head, _, tail = name.rpartition(old) if old and old in name else ("", "", name)
          name = head + tail + recipe_names.gemm_tag(value)
        else:
          value = value.item() if isinstance(value, np.generic) else value  # np.False_ is tagged as False
          name += f"+{field}" + (f"={value}" if isinstance(value, (bool, int, float, str)) or value is None else "")
      changes["name"] = name
    return dataclasses.replace(self, **changes)

  def gemm(self, name: str) -> GemmConfig:
    """The GemmConfig of "fprop", "dgrad" or "wgrad"."""
    return getattr(self, name)

  @property
  def is_quantized(self) -> bool:
    """Whether any GEMM quantizes an operand (False for bf16())."""
    return any(self.gemm(g).quantized for g in GEMMS)

  def signs_of(self, gemm: str) -> str:
    """The RHT sign mode of `gemm`: Fprop's own (`fprop_rht_signs`) if set, else `rht_signs`."""
    if gemm == "fprop" and self.fprop_rht_signs is not None:
      return self.fprop_rht_signs
    return self.rht_signs

  @property
  def needs_key(self) -> bool:
    """Whether a PRNG key is needed: stochastic rounding or per-call random RHT signs."""
    sr = any(op.rounding == "stochastic" and op.quantized for g in GEMMS for op in (self.gemm(g).lhs, self.gemm(g).rhs))
    signs = any(self.signs_of(g) == "per_call" and self.gemm(g).rht for g in GEMMS)
    return sr or signs

  @property
  def dgrad_reuses_weight(self) -> bool:
    """Dgrad's weight is the Fprop weight transposed: same 2D quantization, no RHT on either GEMM."""
    fw, dw = self.fprop.rhs, self.dgrad.rhs
    return (self.reuse_fprop_weight and fw.quantized and fw == dw and fw.block_2d and fw.rounding == "nearest"
            and not self.fprop.rht and not self.dgrad.rht)

  def with_bf16(self, forward: bool = True, backward: bool = True) -> "Recipe":
    """A copy whose forward (Fprop) and/or backward (Dgrad, Wgrad) GEMMs run in high precision."""
    changes = {}
    if forward:
      changes["fprop"] = HIGH_PRECISION_GEMM
      # Backward operands re-quantized from the Fprop operands now start from the high-precision tensors.
      plain = lambda g: GemmConfig(g.lhs, dataclasses.replace(g.rhs, requantize=False))
      changes["dgrad"], changes["wgrad"] = plain(self.dgrad), plain(self.wgrad)
    if backward:
      changes["dgrad"] = changes["wgrad"] = HIGH_PRECISION_GEMM
    suffix = "+bf16" + ("fwd" if forward and not backward else "bwd" if backward and not forward else "")
    if not self.is_quantized or not changes:
      return self
    return dataclasses.replace(self, name=self.name + suffix, **changes)

  def table(self) -> str:
    """The recipe as a readable table: one row per GEMM."""
    cells = []
    for g in GEMMS:
      cfg = self.gemm(g)
      ln, rn = _OPERAND_NAMES[g]
      rhs = cfg.rhs.describe()
      if g == "dgrad" and self.dgrad_reuses_weight:
        rhs += " (Fprop W^T reused)"
      cells.append((g, ln + ": " + cfg.lhs.describe(), rn + ": " + rhs))
    w = max(30, *(len(c[1]) + 1 for c in cells))
    fprop_signs = "" if self.fprop_rht_signs is None else f", fprop_rht_signs={self.fprop_rht_signs}"
    rows = [f"Recipe {self.name!r} (backend={self.backend}, rht_size={self.rht_size}, rht_signs={self.rht_signs}"
            f"{fprop_signs}, random_bits={self.random_bits}, sr_bits={self.sr_bits}, gemm_mode={self.gemm_mode})",
            f"  {'GEMM':<6} {'lhs':<{w}} {'rhs':<30}"]
    rows += [f"  {g:<6} {lhs:<{w}} {rhs:<30}" for g, lhs, rhs in cells]
    return "\n".join(rows)

  def __str__(self) -> str:
    return self.table()


# --- presets ------------------------------------------------------------------------------------------------------

def bf16(*, sr_bits: str = "hash", gemm_mode: str = "auto") -> Recipe:
  """No quantization: every GEMM is a plain dot_general in the compute dtype.

  gemm_mode: the backward's operands (fp4jax.gemm.unquantized_output_dtype): "bf16" multiplies bfloat16 dY, "f32"
  float32 dY, "auto" the first on accelerators and the second on CPUs; a mode other than "auto" is in the name
  ("bf16-gemm:f32"), as for every preset. sr_bits: kept like every preset's (nothing is rounded: it changes nothing).
  """
  return Recipe(name="bf16" + recipe_names.gemm_tag(gemm_mode), sr_bits=sr_bits, gemm_mode=gemm_mode)


def _fp4_recipe(name, fmt, *, rht, rht_size, stochastic_rounding, weight_2d, rht_on, random_signs, random_bits,
                backend, default_rht_size, sr_bits, gemm_mode, sr_fmt=None, extra_tags="") -> Recipe:
  # A CLI typo ("stochastic_rounding=flase") parses to a truthy string: reject it rather than silently enable.
  for flag, value in (("rht", rht), ("stochastic_rounding", stochastic_rounding), ("weight_2d", weight_2d)):
    if not isinstance(value, bool):
      raise ValueError(f"{flag} must be True or False; got {value!r}.")
  if rht_on is None:
    rht_on = ()
  rht_on = (rht_on,) if isinstance(rht_on, str) else tuple(rht_on)
  if not rht or not rht_on:  # no RHT anywhere: its settings would change nothing, yet make another Recipe
    settings = [("rht_size", rht_size, default_rht_size), ("random_signs", random_signs, True)]
    if not rht:
      settings.insert(0, ("rht_on", rht_on, ("wgrad",)))
    inert = {k: v for k, v, default in settings if v != default}
    if inert:
      raise ValueError(f"{'rht=False' if not rht else 'rht_on=()'} turns the RHT off; "
                       f"{', '.join(f'{k}={v!r}' for k, v in inert.items())} would have no effect.")
    rht_on = ()
  recipe_names.check_random_bits(stochastic_rounding, random_bits, "stochastic_rounding")
  unknown = set(rht_on) - set(GEMMS)
  if unknown:
    raise ValueError(f"rht_on entries must be among {GEMMS}; got {sorted(unknown)}.")
  rht_on = tuple(g for g in GEMMS if g in rht_on)  # one name per recipe: "wgrad+dgrad" is "dgrad+wgrad"
  grad_rounding = "stochastic" if stochastic_rounding else "nearest"

  def op(rounding="nearest", block_2d=False, gemm="fprop"):
    op_fmt = sr_fmt if rounding == "stochastic" and sr_fmt is not None else fmt
    return OperandConfig(fmt=op_fmt, block_2d=block_2d, rounding=rounding, rht=gemm in rht_on)

  if random_signs is True:
    signs = "fixed"
  elif random_signs is False:
    signs = "none"
  elif random_signs in RHT_SIGNS:
    signs = random_signs
  else:
    raise ValueError(f"random_signs must be True, False or one of {RHT_SIGNS}; got {random_signs!r}.")
  return Recipe(
      name=recipe_names.ablation_name(name, rht_on=rht_on, rht_size=rht_size, default_rht_size=default_rht_size,
                                      stochastic_rounding=stochastic_rounding, weight_2d=weight_2d, signs=signs,
                                      random_bits=random_bits, sr_bits=sr_bits, gemm_mode=gemm_mode,
                                      extra_tags=extra_tags),
      fprop=GemmConfig(op(gemm="fprop"), op(block_2d=weight_2d, gemm="fprop")),
      dgrad=GemmConfig(op(grad_rounding, gemm="dgrad"), op(block_2d=weight_2d, gemm="dgrad")),
      wgrad=GemmConfig(op(grad_rounding, gemm="wgrad"), op(gemm="wgrad")),
      rht_size=rht_size, rht_signs=signs, random_bits=random_bits, backend=backend, sr_bits=sr_bits,
      gemm_mode=gemm_mode)


UNBIASED_SR = (False, True, "up", "headroom")


def nvfp4(*, rht: bool = True, rht_size: int = 16, stochastic_rounding: bool = True, weight_2d: bool = True,
          rht_on: tuple[str, ...] = ("wgrad",), random_signs=True, random_bits: int = 32,
          backend: str = "xla", four_over_six: bool = False, select: str = "mse", unbiased_sr=False,
          sr_bits: str = "hash", gemm_mode: str = "auto") -> Recipe:
  """The paper's NVFP4 recipe; each keyword switches one component off or changes it (for ablations).

  rht: Random Hadamard Transform on the GEMMs in `rht_on` (paper: Wgrad only), tile size `rht_size`.
  stochastic_rounding: SR on the output-gradient operands of Dgrad and Wgrad (RNE elsewhere).
  weight_2d: 16x16 weight blocks, so Dgrad reuses the Fprop weight exactly (else 1x16 re-quantized per GEMM).
  random_signs: True = fixed random sign vector (paper), False = no signs, "per_call" = fresh signs per call.
  four_over_six: every operand uses Four Over Six block scales (arXiv 2512.02010; `formats.NVFP4` scale_rule
    "4over6"), chosen per block by `select` ("mse", "mae" or "absmax").
  unbiased_sr: the SR operands' block scales: False (NVIDIA: rounded to nearest, ~1.2 % bias at block maxima),
    True or "up" (rounded up: unbiased), "headroom" (elements at 16/17 of their scale: unbiased except in blocks
    whose E4M3 scale is subnormal, under ~3.5e-5 of the tensor amax, docs/numerics.md; with 4/6 the
    SR operands choose their candidate on nearest-rounded values, NVFP4(select_on="nearest"), since choosing among
    stochastically rounded candidates, as the reference does, biases SR again: docs/numerics.md).
  sr_bits, gemm_mode: the SR bit generator and the GEMM mode (see Recipe); they change speed, not the recipe.
  """
  if not isinstance(four_over_six, bool):
    raise ValueError(f"four_over_six must be True or False; got {four_over_six!r}.")
  if select not in formats.FOUR_OVER_SIX_SELECT:
    raise ValueError(f"select must be one of {formats.FOUR_OVER_SIX_SELECT}; got {select!r}.")
  if select != "mse" and not four_over_six:
    raise ValueError(f"select={select!r} chooses between Four Over Six's two block scales; it needs "
                     "four_over_six=True.")
  if unbiased_sr not in UNBIASED_SR or (unbiased_sr is not False and not isinstance(unbiased_sr, (bool, str))):
    raise ValueError(f"unbiased_sr must be one of {UNBIASED_SR}; got {unbiased_sr!r}.")
  if unbiased_sr is not False and stochastic_rounding is False:
    raise ValueError(f"unbiased_sr={unbiased_sr!r} changes the block scales of stochastically rounded operands; "
                     "with stochastic_rounding=False there are none.")
  if four_over_six and unbiased_sr in (True, "up"):
    raise ValueError("four_over_six chooses between two block scales per block; rounding them up is not defined. "
                     "Use unbiased_sr='headroom' with four_over_six.")
  fmt = formats.NVFP4(scale_rule="4over6", select=select) if four_over_six else formats.NVFP4()
  sr_fmt, tags = None, ""
  if four_over_six:
    tags += "+4over6" + ("" if select == "mse" else f":{select}")
  if unbiased_sr is not False and stochastic_rounding:
    if unbiased_sr == "headroom":  # with 4/6, chosen on nearest-rounded candidates: else the choice biases SR
      sr_fmt = fmt.replace(headroom=True, select_on="nearest" if four_over_six else "rounded")
    else:
      sr_fmt = fmt.replace(scale_rule="up")
    tags += "+usr" + (":headroom" if unbiased_sr == "headroom" else "")
  return _fp4_recipe("nvfp4", fmt, rht=rht, rht_size=rht_size, stochastic_rounding=stochastic_rounding,
                     weight_2d=weight_2d, rht_on=rht_on, random_signs=random_signs, random_bits=random_bits,
                     backend=backend, default_rht_size=16, sr_bits=sr_bits, gemm_mode=gemm_mode, sr_fmt=sr_fmt,
                     extra_tags=tags)


def mxfp4(*, scale_rule: str = "ceil", rht: bool = True, rht_size: int = 32, stochastic_rounding: bool = True,
          weight_2d: bool = True, rht_on: tuple[str, ...] = ("wgrad",), random_signs=True, random_bits: int = 32,
          backend: str = "xla", sr_bits: str = "hash", gemm_mode: str = "auto") -> Recipe:
  """The paper's MXFP4 comparison: 32-element E8M0 blocks ("ceil" scales), RHT size 32 on Wgrad, SR on gradients.

  Weights use 32x32 2D blocks by default so the comparison with nvfp4() changes only the format.
  """
  return _fp4_recipe("mxfp4", formats.MXFP4(scale_rule=scale_rule), rht=rht, rht_size=rht_size,
                     stochastic_rounding=stochastic_rounding, weight_2d=weight_2d, rht_on=rht_on,
                     random_signs=random_signs, random_bits=random_bits, backend=backend, default_rht_size=32,
                     sr_bits=sr_bits, gemm_mode=gemm_mode, extra_tags="" if scale_rule == "ceil" else f"+{scale_rule}")


def fp8(*, block_size: int = 128, scaling: str = "block", sr_bits: str = "hash", gemm_mode: str = "auto") -> Recipe:
  """The paper's FP8 baseline: E4M3 everywhere, 1x128 blocks for activations/gradients, 128x128 for weights, RNE.

  Partial blocks at the end of a contraction axis are zero-padded (layers narrower than 128 still work).
  """
  fmt = formats.FP8(scaling=scaling, block_size=block_size)
  act = OperandConfig(fmt=fmt, pad=True)
  weight = OperandConfig(fmt=fmt, block_2d=True, pad=True)
  tags = ("" if scaling == "block" else f"-{scaling}") + ("" if block_size == 128 else f"-b{block_size}")
  return Recipe(name="fp8" + tags + recipe_names.gemm_tag(gemm_mode), fprop=GemmConfig(act, weight),
                dgrad=GemmConfig(act, weight), wgrad=GemmConfig(act, act), sr_bits=sr_bits, gemm_mode=gemm_mode)


PRESETS = {"bf16": bf16, "nvfp4": nvfp4, "mxfp4": mxfp4, "fp8": fp8, "four_over_six": four_over_six,
           "tetrajet_v2": tetrajet_v2, "quartet2": quartet2, "quartet": quartet}
RECIPE_NAMES = tuple(PRESETS)


def get_recipe(spec: str | Recipe) -> Recipe:
  """A recipe from its CLI form "name[:key=value,...]", e.g. "nvfp4:rht_size=4,stochastic_rounding=false".

  Tuple values use '+': "nvfp4:rht_on=wgrad+dgrad".
  """
  if isinstance(spec, Recipe):
    return spec
  if not isinstance(spec, str):  # else its str() is parsed: "Unknown recipe '<function nvfp4 at 0x..>'"
    preset = next((n for n, f in PRESETS.items() if f is spec), None)
    if preset:
      raise ValueError(f"got the preset function fp4jax.recipes.{preset}; a recipe is what it returns: "
                       f"fp4jax.recipes.{preset}().")
    raise ValueError(f"expected a Recipe (fp4jax.recipes.nvfp4()) or its name, e.g. 'nvfp4:rht_size=4'; got "
                     f"{type(spec).__name__} {str(spec)[:80]!r}.")
  name, kwargs = recipe_names.parse_spec(spec, PRESETS)
  return PRESETS[name](**kwargs)
