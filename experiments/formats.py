"""BF16 vs FP8 vs NVFP4 (the paper's recipe) vs MXFP4: the paper's main comparison (docs/numerics.md, "Formats").

NVFP4 and MXFP4 both run the full recipe (RHT on Wgrad, stochastic rounding on gradients, 2D weight blocks) and keep
the same last block(s) in BF16, so only the format differs (MXFP4: 32-element blocks, power-of-two "ceil" scales,
RHT size 32, as in the paper). FP8 is E4M3 with 1x128 / 128x128 blocks on every block; BF16 is the reference.
Paper (8B, 1T tokens): MXFP4 ~2.5% relative loss gap vs ~1.5% for NVFP4.

    python -m experiments.formats --preset smoke --out runs/formats_smoke   # ~1 min on a CPU (bf16, nvfp4, mxfp4)
    python -m experiments.formats --preset cpu --out runs/formats_cpu       # ~6-16 min on 2 CPU cores
    python -m experiments.formats --preset gpu --out runs/formats_gpu       # paper_1b (1.2B) on a GPU
"""

import sys

from experiments import cli
from experiments import sweep

SEEDS = {"smoke": 1, "cpu": 2, "gpu": 1}


def get_config(preset: str) -> sweep.Sweep:
  """The formats sweep for `preset`: python -m experiments.formats --preset PRESET --out runs/formats_PRESET."""
  base = sweep.base_overrides(preset)
  base["bf16_last"] = sweep.HIGH_PRECISION_LAST[preset]
  runs = [sweep.Run("bf16", {"recipe": "bf16", "bf16_last": 0}, "BF16"),
          sweep.Run("fp8", {"recipe": "fp8", "bf16_last": 0}, "FP8 (E4M3, 1x128 / 128x128 blocks)"),
          sweep.Run("nvfp4", {"recipe": "nvfp4"}, "NVFP4 (paper recipe)"),
          sweep.Run("mxfp4", {"recipe": "mxfp4"}, "MXFP4 (same recipe, RHT 32)")]
  left_out = ""
  if preset == "smoke":
    runs = [r for r in runs if r.name != "fp8"]
    left_out = " (FP8 only in the cpu and gpu presets)"
  compared = " vs ".join(r.name.upper() for r in runs)
  return sweep.Sweep(experiment="formats", preset=preset, runs=tuple(runs), base=base, seeds=SEEDS[preset],
                     reference="bf16", command=f"python -m experiments.formats --preset {preset} "
                                               f"--out runs/formats_{preset}",
                     description=f"{compared}{left_out}; the FP4 runs keep the same last block(s) in BF16.")


def main(argv=None) -> int:
  """`python -m experiments.formats` (see --help and the module docstring); returns the exit code."""
  return cli.main(get_config, argv, prog="python -m experiments.formats", doc=__doc__)


if __name__ == "__main__":
  sys.exit(main())
