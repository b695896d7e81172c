"""Which transformer blocks stay in BF16: none, the first k, the last k, the first k and last k (docs/numerics.md,
"Recipe").

Every other block runs the paper's NVFP4 recipe. Paper (1.2B, 20 blocks): all-NVFP4 diverged; the last 4 blocks in
BF16 stabilised training, the first 4 alone did not; first 2 + last 2 worked. At 12B: first 2 + last 8 of 62.

    python -m experiments.high_precision_layers --preset smoke --out runs/hp_layers_smoke
    python -m experiments.high_precision_layers --preset cpu --out runs/hp_layers_cpu
    python -m experiments.high_precision_layers --preset gpu --out runs/hp_layers_gpu
"""

import sys

from experiments import cli
from experiments import sweep
from fp4jax.pretrain import model as model_lib

SEEDS = {"smoke": 1, "cpu": 2, "gpu": 1}
# Block counts per preset (smoke and cpu models have 2 and 4 blocks; paper_1b has 20). "first k + last k" runs only
# where it leaves a block in NVFP4 (not k = 2 on the cpu preset's 4 blocks).
KS = {"smoke": (1,), "cpu": (1, 2), "gpu": (1, 2, 4)}


# The runs pin every BF16-layer setting (what the experiment varies), so that a --set of one (bf16_first,
# bf16_blocks, bf16_pattern, ...) cannot turn "none" or "first k" into another run's setting under its label.
def _bf16(first: int, last: int) -> dict:
  return {"recipe": "nvfp4", "bf16_first": first, "bf16_last": last, "bf16_blocks": (), "bf16_pattern": None}


def _n_layers(base: dict) -> int:
  return base.get("model.n_layers", model_lib.MODEL_PRESETS[base["model"]].n_layers)


def get_config(preset: str) -> sweep.Sweep:
  """The BF16-layer sweep for `preset`: python -m experiments.high_precision_layers --preset PRESET --out DIR."""
  base = sweep.base_overrides(preset)
  runs = [sweep.Run("bf16", {"recipe": "bf16"}, "BF16"),
          sweep.Run("none", _bf16(0, 0), "NVFP4 everywhere")]
  for k in KS[preset]:
    runs += [sweep.Run(f"first{k}", _bf16(k, 0), f"first {k} BF16"),
             sweep.Run(f"last{k}", _bf16(0, k), f"last {k} BF16")]
    if 2 * k < _n_layers(base):  # else no block is left in NVFP4: the BF16 run under another name
      runs.append(sweep.Run(f"first{k}_last{k}", _bf16(k, k), f"first {k} + last {k} BF16"))
  if preset == "smoke":
    runs = [r for r in runs if r.name in ("bf16", "none", "last1")]
  return sweep.Sweep(experiment="high_precision_layers", preset=preset, runs=tuple(runs), base=base,
                     seeds=SEEDS[preset], reference="bf16",
                     command=f"python -m experiments.high_precision_layers --preset {preset} "
                             f"--out runs/hp_layers_{preset}",
                     description="NVFP4 with no, the first k, the last k, or the first k + last k blocks in BF16.")


def main(argv=None) -> int:
  """`python -m experiments.high_precision_layers` (see --help and the module docstring); returns the exit code."""
  return cli.main(get_config, argv, prog="python -m experiments.high_precision_layers", doc=__doc__)


if __name__ == "__main__":
  sys.exit(main())
