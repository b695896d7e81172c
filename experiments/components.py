"""The paper's recipe with each component removed in turn: RHT, stochastic rounding, 2D weights, BF16 blocks.

"full" is NVFP4 with RHT (size 16, Wgrad), SR on gradients, 16x16 weight blocks and the last block(s) in BF16;
each "no_*" run drops one of them ("no_hp_layers" runs NVFP4 in every block). BF16 is the reference.
Paper (12B, resumed at 3.43T tokens): removing SR, RHT or 2D, or fewer BF16 layers, each made the loss worse.
Change the full recipe's BF16 blocks with --set bf16_last=K (no_hp_layers keeps 0).

    python -m experiments.components --preset smoke --out runs/components_smoke
    python -m experiments.components --preset cpu --out runs/components_cpu     # ~10-20 min on 2 CPU cores
    python -m experiments.components --preset gpu --out runs/components_gpu
"""

import sys

from experiments import cli
from experiments import sweep

SEEDS = {"smoke": 1, "cpu": 2, "gpu": 1}


def get_config(preset: str) -> sweep.Sweep:
  """The ablation sweep for `preset`: python -m experiments.components --preset PRESET --out runs/components_PRESET."""
  base = sweep.base_overrides(preset)
  base["bf16_last"] = sweep.HIGH_PRECISION_LAST[preset]
  runs = [sweep.Run("bf16", {"recipe": "bf16", "bf16_last": 0}, "BF16"),
          sweep.Run("full", {"recipe": "nvfp4"}, "NVFP4 full recipe"),
          sweep.Run("no_rht", {"recipe": "nvfp4:rht=false"}, "- RHT"),
          sweep.Run("no_sr", {"recipe": "nvfp4:stochastic_rounding=false"}, "- stochastic rounding"),
          sweep.Run("no_2d", {"recipe": "nvfp4:weight_2d=false"}, "- 2D weight blocks"),
          # Every BF16-layer setting its own: a --set bf16_first=K (or bf16_blocks, bf16_pattern) must not give the
          # all-NVFP4 run BF16 layers.
          sweep.Run("no_hp_layers", {"recipe": "nvfp4", "bf16_first": 0, "bf16_last": 0, "bf16_blocks": (),
                                     "bf16_pattern": None}, "- BF16 blocks (all NVFP4)")]
  if preset == "smoke":
    runs = [r for r in runs if r.name in ("bf16", "full", "no_sr")]
  return sweep.Sweep(experiment="components", preset=preset, runs=tuple(runs), base=base, seeds=SEEDS[preset],
                     reference="bf16", command=f"python -m experiments.components --preset {preset} "
                                               f"--out runs/components_{preset}",
                     description="NVFP4 full recipe, then without RHT, SR, 2D weights or BF16 blocks; BF16 reference.")


def main(argv=None) -> int:
  """`python -m experiments.components` (see --help and the module docstring); returns the exit code."""
  return cli.main(get_config, argv, prog="python -m experiments.components", doc=__doc__)


if __name__ == "__main__":
  sys.exit(main())
