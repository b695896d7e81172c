"""NVFP4 with Random Hadamard Transform sizes {none, 2, 4, 16, 64, 128} and sign choices (docs/numerics.md,
"Random Hadamard transform").

Everything else is the paper's recipe (RHT on Wgrad only, SR, 2D weights, last block(s) in BF16). Signs: "fixed"
is one random sign vector for the whole run (the paper's default, `random_signs=True`); "nosigns" is a plain
Hadamard transform (`random_signs=False`); "per_call" draws fresh signs at every GEMM. Sign ablations use size 16.
Paper: at 1.2B sizes 2, 4, 16 and 128 made no difference; at 12B size 4 was worse, 128 a minor gain; no signs was worse;
fresh signs per call gave no gain.

    python -m experiments.rht_size --preset smoke --out runs/rht_size_smoke
    python -m experiments.rht_size --preset cpu --out runs/rht_size_cpu
    python -m experiments.rht_size --preset gpu --out runs/rht_size_gpu
"""

import sys

from experiments import cli
from experiments import sweep

SEEDS = {"smoke": 1, "cpu": 2, "gpu": 1}
SIZES = (2, 4, 16, 64, 128)


def get_config(preset: str) -> sweep.Sweep:
  """The RHT sweep for `preset`: python -m experiments.rht_size --preset PRESET --out runs/rht_size_PRESET."""
  base = sweep.base_overrides(preset)
  base["bf16_last"] = sweep.HIGH_PRECISION_LAST[preset]
  runs = [sweep.Run("bf16", {"recipe": "bf16", "bf16_last": 0}, "BF16"),
          sweep.Run("rht_none", {"recipe": "nvfp4:rht=false"}, "NVFP4, no RHT")]
  runs += [sweep.Run(f"rht{d}", {"recipe": "nvfp4" if d == 16 else f"nvfp4:rht_size={d}"},
                     f"NVFP4, RHT {d}, fixed signs" + (" (paper)" if d == 16 else "")) for d in SIZES]
  runs += [sweep.Run("rht16_nosigns", {"recipe": "nvfp4:random_signs=false"}, "NVFP4, RHT 16, no signs"),
           sweep.Run("rht16_per_call", {"recipe": "nvfp4:random_signs=per_call"}, "NVFP4, RHT 16, signs per call")]
  if preset == "smoke":
    runs = [r for r in runs if r.name in ("bf16", "rht16", "rht4")]
  return sweep.Sweep(experiment="rht_size", preset=preset, runs=tuple(runs), base=base, seeds=SEEDS[preset],
                     reference="bf16", command=f"python -m experiments.rht_size --preset {preset} "
                                               f"--out runs/rht_size_{preset}",
                     description="NVFP4 with RHT sizes none/2/4/16/64/128 (fixed signs) and size 16 with no signs "
                                 "or per-call signs.")


def main(argv=None) -> int:
  """`python -m experiments.rht_size` (see --help and the module docstring); returns the exit code."""
  return cli.main(get_config, argv, prog="python -m experiments.rht_size", doc=__doc__)


if __name__ == "__main__":
  sys.exit(main())
