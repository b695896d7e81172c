"""Switching from NVFP4 to BF16 late in training: forward only, or forward and backward (docs/numerics.md, "Recipe").

Before the switch every run is the paper's NVFP4 recipe (last block(s) in BF16); from the switch step on, "all"
runs every GEMM in BF16 and "fwd" only Fprop (Dgrad and Wgrad stay NVFP4). Paper (12B): switching everything at
82% of the run matched FP8; forward only recovered most of the gap (1.5% -> 0.5%); backward only gave nothing.

    python -m experiments.precision_switch --preset smoke --out runs/switch_smoke
    python -m experiments.precision_switch --preset cpu --out runs/switch_cpu
    python -m experiments.precision_switch --preset gpu --out runs/switch_gpu
"""

import sys

from experiments import cli
from experiments import sweep

SEEDS = {"smoke": 1, "cpu": 2, "gpu": 1}
FRACTIONS = {"smoke": (0.5,), "cpu": (0.5, 0.8, 0.9), "gpu": (0.5, 0.82, 0.9)}


def get_config(preset: str) -> sweep.Sweep:
  """The switch sweep for `preset`: python -m experiments.precision_switch --preset PRESET --out runs/switch_PRESET."""
  base = sweep.base_overrides(preset)
  base["bf16_last"] = sweep.HIGH_PRECISION_LAST[preset]
  runs = [sweep.Run("bf16", {"recipe": "bf16", "bf16_last": 0}, "BF16"),
          # switch_at=None is what this run varies: a --set switch_at=F must not switch the no-switch baseline.
          sweep.Run("nvfp4", {"recipe": "nvfp4", "switch_at": None}, "NVFP4, no switch")]
  for f in FRACTIONS[preset]:
    pct = round(100 * f)
    runs += [sweep.Run(f"all_at{pct}", {"recipe": "nvfp4", "switch_at": f, "switch": "all"},
                       f"all GEMMs to BF16 at {pct}%"),
             sweep.Run(f"fwd_at{pct}", {"recipe": "nvfp4", "switch_at": f, "switch": "forward"},
                       f"forward to BF16 at {pct}%")]
  if preset == "smoke":
    runs = [r for r in runs if r.name in ("bf16", "nvfp4", "fwd_at50")]
  return sweep.Sweep(experiment="precision_switch", preset=preset, runs=tuple(runs), base=base,
                     seeds=SEEDS[preset], reference="bf16",
                     command=f"python -m experiments.precision_switch --preset {preset} --out runs/switch_{preset}",
                     description="NVFP4, switched to BF16 (forward only, or all GEMMs) at fractions of the run.")


def main(argv=None) -> int:
  """`python -m experiments.precision_switch` (see --help and the module docstring); returns the exit code."""
  return cli.main(get_config, argv, prog="python -m experiments.precision_switch", doc=__doc__)


if __name__ == "__main__":
  sys.exit(main())
