"""Presets beyond NVIDIA's recipe: Four Over Six, TetraJet-v2, Quartet II and Quartet (re-exported by fp4jax.recipes).

Each accepts `sr_bits=` and `gemm_mode=` like every preset (see fp4jax.recipes.Recipe): they change speed, not the
recipe, and show in the name as in `nvfp4()` ("-threefry" when something is rounded stochastically, "-gemm:MODE"),
as do 8 random bits ("-sr8bit") and a non-default RHT size: one recipe, one name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp4jax import formats
from fp4jax import recipe_names
from fp4jax import rht as rht_lib

if TYPE_CHECKING:
  from fp4jax.recipes import Recipe


def _recipes():
  """fp4jax.recipes, imported when a preset is called: it imports this module at load time (no import cycle)."""
  from fp4jax import recipes  # pylint: disable=g-import-not-at-top
  return recipes


def _check_switches(**switches) -> None:
  """A CLI typo ("stochastic_rounding=flase") parses to a truthy string: refuse it rather than silently switch on."""
  for flag, value in switches.items():
    if not isinstance(value, bool):
      raise ValueError(f"{flag} must be True or False; got {value!r}.")


def _sr_and_speed_tags(stochastic: bool, random_bits: int, sr_bits: str, gemm_mode: str) -> str:
  """Name tags of the SR bits and generator (only when something is rounded stochastically) and the GEMM mode, as
  `nvfp4()` tags them ("-sr8bit", "-threefry", "-gemm:f32")."""
  sr = (f"-sr{random_bits}bit" if random_bits != 32 else "") + (f"-{sr_bits}" if sr_bits != "hash" else "")
  return (sr if stochastic else "") + recipe_names.gemm_tag(gemm_mode)


def four_over_six(*, select: str = "mse", unbiased_sr=False, rht: bool = True, rht_size: int = 16,
                  stochastic_rounding: bool = True, weight_2d: bool = True, rht_on: tuple[str, ...] = ("wgrad",),
                  random_signs=True, random_bits: int = 32, backend: str = "xla", sr_bits: str = "hash",
                  gemm_mode: str = "auto") -> Recipe:
  """NVIDIA's NVFP4 recipe with Four Over Six block scales on every operand (arXiv 2512.02010; repository
  mit-han-lab/fouroversix): weights, activations and gradients, SR on the gradients as in NVIDIA's recipe. Unlike
  TransformerEngine's implementation it composes with the RHT. Same switches as `nvfp4()`."""
  r = _recipes().nvfp4(rht=rht, rht_size=rht_size, stochastic_rounding=stochastic_rounding, weight_2d=weight_2d,
            rht_on=rht_on, random_signs=random_signs, random_bits=random_bits, backend=backend,
            four_over_six=True, select=select, unbiased_sr=unbiased_sr, sr_bits=sr_bits, gemm_mode=gemm_mode)
  return r.replace(name="four_over_six" + r.name[len("nvfp4"):].replace("+4over6", "", 1))


def tetrajet_v2(*, rht_size: int = 16, double_block: bool = True, stochastic_rounding: bool = True,
                random_bits: int = 32, backend: str = "xla", sr_bits: str = "hash",
                gemm_mode: str = "auto") -> Recipe:
  """TetraJet-v2 (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training) without OsciReset / OutControl.

  Every operand is NVFP4 with double-block scales (an FP32 scale per 1x128 group, E4M3 per 1x16), weights in 1x16
  blocks along the contraction axis. Forward: round to nearest. Backward: both GEMMs see the output gradient and
  the Fprop operands dequantized, transposed and re-quantized, all with an RHT of size `rht_size` (fresh signs per
  call) along the contraction axis and stochastic rounding.

  Two differences from the authors' kernels (kernels/csrc/quant_fp4.cu, olmo/quantization_real/linear.py):
    * The dequantized Fprop x is re-quantized in x's dtype: in a bfloat16 model its values are rounded to bfloat16
      before the RHT, where the kernels keep float32. On a bfloat16 x of 128 tokens x 32 channels, 1.2 % of the
      re-quantized codes differ, and dW's error against the straight-through gradient measured 13.9 % against the
      kernels' 14.0 % (no worse). A float32 x gives the kernels' operands.
    * Dgrad and Wgrad share one RHT sign vector per call; the reference draws one per GEMM (seed_dx, seed_dw).
  """
  _check_switches(double_block=double_block, stochastic_rounding=stochastic_rounding)
  recipe_names.check_random_bits(stochastic_rounding, random_bits, "stochastic_rounding")
  lib = _recipes()
  fmt = formats.NVFP4(double_block=double_block)
  sr = "stochastic" if stochastic_rounding else "nearest"
  fwd = lib.OperandConfig(fmt=fmt)
  grad = lib.OperandConfig(fmt=fmt, rounding=sr, rht=True)
  requant = lib.OperandConfig(fmt=fmt, rounding=sr, rht=True, requantize=True)
  name = ("tetrajet_v2" + ("" if rht_size == 16 else f"-rht{rht_size}") + ("" if double_block else "-double_block")
          + ("" if stochastic_rounding else "-sr") + _sr_and_speed_tags(stochastic_rounding, random_bits, sr_bits,
                                                                         gemm_mode))
  return lib.Recipe(name=name, fprop=lib.GemmConfig(fwd, fwd), dgrad=lib.GemmConfig(grad, requant),
                    wgrad=lib.GemmConfig(grad, requant), rht_size=rht_size, rht_signs="per_call",
                    random_bits=random_bits, backend=backend, sr_bits=sr_bits, gemm_mode=gemm_mode)


def quartet2(*, four_over_six: bool = False, rht_size: int = 128, stochastic_scales: bool = True,
             random_bits: int = 32, backend: str = "xla", sr_bits: str = "hash", gemm_mode: str = "auto") -> Recipe:
  """Quartet II (arXiv 2601.22813; IST-DASLab/Quartet-II, schemes/quartet_2.py, kernels/python/quartet2/linear.py).

  Forward: NVFP4 1x16 round-to-nearest on x and W (no Hadamard, no 2D blocks; `four_over_six` as in the released
  kernel). Backward ("MS-EDEN"): the output gradient and the dequantized Fprop x and W, re-quantized, get an RHT of
  size `rht_size` with fresh signs per call along each backward GEMM's contraction axis, then NVFP4 with the EDEN
  correction over each Hadamard tile (eden_group = rht_size) and stochastically rounded block scales
  (`formats.NVFP4` scale_rule "eden"; their random bits come from `sr_bits`'s generator).
  As in `tetrajet_v2`, the dequantized Fprop x is re-quantized in x's dtype: in a bfloat16 model its values are
  rounded to bfloat16 before the RHT, where the released kernels keep float32 (a float32 x gives their operands).
  """
  _check_switches(four_over_six=four_over_six, stochastic_scales=stochastic_scales)
  recipe_names.check_random_bits(stochastic_scales, random_bits, "stochastic_scales")
  lib = _recipes()
  fwd = lib.OperandConfig(fmt=formats.NVFP4(scale_rule="4over6") if four_over_six else formats.NVFP4())
  rht_lib.check_size(rht_size)
  if rht_size < 16:
    raise ValueError(f"quartet2: the EDEN correction runs over each Hadamard tile of whole 16-element blocks; "
                     f"rht_size must be >= 16, got {rht_size}.")
  bwd_fmt = formats.NVFP4(scale_rule="eden", eden_group=rht_size)
  sr = "stochastic" if stochastic_scales else "nearest"
  grad = lib.OperandConfig(fmt=bwd_fmt, rounding=sr, rht=True)
  requant = lib.OperandConfig(fmt=bwd_fmt, rounding=sr, rht=True, requantize=True)
  name = ("quartet2" + ("+4over6" if four_over_six else "") + ("" if rht_size == 128 else f"-rht{rht_size}")
          + ("" if stochastic_scales else "-sr")
          + _sr_and_speed_tags(stochastic_scales, random_bits, sr_bits, gemm_mode))
  return lib.Recipe(name=name, fprop=lib.GemmConfig(fwd, fwd), dgrad=lib.GemmConfig(grad, requant),
                    wgrad=lib.GemmConfig(grad, requant), rht_size=rht_size, rht_signs="per_call",
                    random_bits=random_bits, backend=backend, sr_bits=sr_bits, gemm_mode=gemm_mode)


def quartet(*, rht_size: int = 32, stochastic_rounding: bool = True, random_bits: int = 32, backend: str = "xla",
            sr_bits: str = "hash", gemm_mode: str = "auto") -> Recipe:
  """Quartet (arXiv 2505.14669; IST-DASLab/Quartet: src/models/quantization/quantizers/mxfp4.py and mxfp4_triton.py,
  the backward scheme "Q(E)Q(Wt)t_Q(Et)Q(Xt)t" of sweep_tokens_backward.sh, quartet_qat/.../module/linear_fns.py).

  MXFP4 in all three GEMMs. Forward: a fixed Hadamard of size `rht_size` (no signs) on x and W along K, then QuEST
  (`formats.MXFP4` scale_rule "quest": power-of-two scale from each 32-group's standard deviation), round to
  nearest; each operand's gradient is zeroed where QuEST saturated it, before the inverse Hadamard. Backward: the
  output gradient and the dequantized Fprop x and W (still in the Hadamard basis) are re-quantized after an RHT of
  size `rht_size` with fresh signs per call along each backward GEMM's inner dimension, as MXFP4 with Tseng et al.'s
  3/4 scale (scale_rule "tseng": never saturates) and stochastic rounding; Dgrad's and Wgrad's outputs, in the
  Fprop basis along K, are masked and transformed back. The released CUDA kernels round the backward to nearest
  (`stochastic_rounding=False`).
  """
  _check_switches(stochastic_rounding=stochastic_rounding)
  recipe_names.check_random_bits(stochastic_rounding, random_bits, "stochastic_rounding")
  lib = _recipes()
  fwd = lib.OperandConfig(fmt=formats.MXFP4(scale_rule="quest"), rht=True, clip_mask=True)
  bwd_fmt = formats.MXFP4(scale_rule="tseng")
  sr = "stochastic" if stochastic_rounding else "nearest"
  grad = lib.OperandConfig(fmt=bwd_fmt, rounding=sr, rht=True)
  requant = lib.OperandConfig(fmt=bwd_fmt, rounding=sr, rht=True, requantize=True)
  name = ("quartet" + ("" if rht_size == 32 else f"-rht{rht_size}") + ("" if stochastic_rounding else "-sr")
          + _sr_and_speed_tags(stochastic_rounding, random_bits, sr_bits, gemm_mode))
  return lib.Recipe(name=name, fprop=lib.GemmConfig(fwd, fwd), dgrad=lib.GemmConfig(grad, requant),
                    wgrad=lib.GemmConfig(grad, requant), rht_size=rht_size, rht_signs="per_call",
                    fprop_rht_signs="none", random_bits=random_bits, backend=backend, sr_bits=sr_bits,
                    gemm_mode=gemm_mode)
