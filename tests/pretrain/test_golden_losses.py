"""Golden losses: 4-step runs of the tiny model (five recipes, one with BF16 last block and a precision switch)
reproduce, float32 for float32, the losses the trainer produced before the pretraining package was restructured.

golden_losses.json was written by the pre-restructure trainer (commit 7588ce6) from these exact configs, on an
AVX-512 host. Stochastic rounding then drew its bits with threefry; the default is now the counter-based hash
(fp4jax.prng), so the SR recipes run with `sr_bits=threefry` here, which must reproduce the old bits exactly; and the
quantized recipes with `gemm_mode=f32`, the float32 GEMMs those runs used.

XLA:CPU's float32 sums come out in another order on another instruction set (tests/platform_numerics.py), so the
losses are recorded per platform: exact where this platform has a record, within RTOL of the first record elsewhere
(with a warning). On an AVX2 host (AMD Zen 3) they differ from the AVX-512 host's by up to 1.1e-3 (relative; fp8,
whose rounding decisions flip; 1.2e-4 for bf16, 0 for mxfp4), while recipe components move them by ~1e-2. A
platform's record is added, from a commit that passes exactly on a recorded platform, with
`python tests/pretrain/test_golden_losses.py --record`.
"""

import json
import pathlib
import sys
import tempfile
import warnings

import pytest

from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from platform_numerics import platform

GOLDEN_FILE = pathlib.Path(__file__).parent / "golden_losses.json"
GOLDEN = json.loads(GOLDEN_FILE.read_text())["platforms"]  # platform -> recipe -> {"losses", "val_losses"}
RECIPES = sorted(next(iter(GOLDEN.values())))
RTOL = 5e-3


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


def golden_run(recipe: str, out: pathlib.Path) -> dict:
  """{"losses": [...], "val_losses": {"4": ...}} of the recipe's golden config."""
  summary = trainer.train(golden_config(recipe, out), log=None)
  return {"losses": summary["losses"], "val_losses": {str(k): v for k, v in summary["val_losses"].items()}}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_match_golden(recipe, tmp_path):
  got = golden_run(recipe, tmp_path)
  if platform() in GOLDEN:
    assert got == GOLDEN[platform()][recipe]  # float32 values, compared exactly
    return
  first, want = next(iter(GOLDEN.items()))
  want = want[recipe]
  assert got["losses"] == pytest.approx(want["losses"], rel=RTOL)
  assert got["val_losses"] == pytest.approx(want["val_losses"], rel=RTOL)
  warnings.warn(f"No golden losses recorded for {platform()!r}: {recipe} matched those of {first!r} within "
                f"rtol {RTOL}, not exactly.")


def record() -> None:
  """Adds this platform's losses to golden_losses.json (refused if it has them)."""
  data = json.loads(GOLDEN_FILE.read_text())
  if platform() in data["platforms"]:
    raise SystemExit(f"{GOLDEN_FILE} already has {platform()!r}.")
  with tempfile.TemporaryDirectory() as out:
    data["platforms"][platform()] = {r: golden_run(r, pathlib.Path(out) / str(i)) for i, r in enumerate(RECIPES)}
  GOLDEN_FILE.write_text(json.dumps(data, indent=1) + "\n")
  print(f"Recorded {platform()!r} in {GOLDEN_FILE}.")


if __name__ == "__main__":
  if sys.argv[1:] != ["--record"]:
    raise SystemExit(f"usage: python {sys.argv[0]} --record")
  record()
