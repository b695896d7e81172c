"""Golden losses: 4-step runs of the tiny model (five recipes, one with BF16 last block and a precision switch)
reproduce, float32 for float32, the losses the trainer produced before the pretraining package was restructured.

golden_losses.json was written by the pre-restructure trainer (commit 7588ce6) from these exact configs. Stochastic
rounding then drew its bits with threefry; the default is now the counter-based hash (fp4jax.prng), so the SR recipes
run with `sr_bits=threefry` here, which must reproduce the old bits exactly; and the quantized recipes with
`gemm_mode=f32`, the float32 GEMMs those runs used.
"""

import json
import pathlib

import pytest

from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden_losses.json").read_text())


def _as_produced(recipe: str) -> str:
  """The recipe as the golden runs ran it: float32 GEMMs ("auto" is now bf16, equal only up to summation order) and,
  for stochastic rounding, threefry bits."""
  if recipe == "bf16":
    return recipe
  opts = ["gemm_mode=f32"]
  if "stochastic_rounding=false" not in recipe and recipe != "fp8":
    opts.append("sr_bits=threefry")
  return recipe + ("," if ":" in recipe else ":") + ",".join(opts)


def golden_config(recipe: str, out: pathlib.Path) -> TrainConfig:
  switched = recipe == "nvfp4"  # one run covers the BF16 last block and the switch to BF16 at step 3
  return TrainConfig.from_options(out=str(out), model="tiny", recipe=_as_produced(recipe), steps=4, batch_size=4,
                                  seq_len=32, eval_every=0, eval_batches=1, checkpoint_every=100, progress=False, seed=0,
                                  overwrite=True, bf16_last=1 if switched else 0, switch_at=3 if switched else None)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(GOLDEN))
def test_losses_match_golden(recipe, tmp_path):
  summary = trainer.train(golden_config(recipe, tmp_path), log=None)
  assert summary["losses"] == GOLDEN[recipe]["losses"]  # float32 values, compared exactly
  assert {str(k): v for k, v in summary["val_losses"].items()} == GOLDEN[recipe]["val_losses"]
