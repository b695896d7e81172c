"""Train-step time and state size with OsciReset on, relative to the same recipe with it off.

    python benchmarks/osci_reset.py                            # tiny model, tetrajet_v2, 20 timed steps
    python benchmarks/osci_reset.py --model small --steps 10 --json out.json

One compiled step without OsciReset and one with it; the OsciReset step is timed at step counters that select each
branch of its schedule (none, snapshot, track, reset), all interleaved step by step with the baseline so load
changes on a shared machine hit all alike. Ratios are median step times over the baseline's median; "state MiB" is
the compiled step's argument size (params, optimizer state and, when on, the three statistics copies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import data  # pylint: disable=wrong-import-position
from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import steps as steps_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import trainer  # pylint: disable=wrong-import-position
from fp4jax.pretrain.config import TrainConfig  # pylint: disable=wrong-import-position

# Step counters that select each branch with start=0, every=200, window=50.
COUNTERS = {"none": 120, "snapshot": 200, "track": 210, "reset": 251}


def _compiled(config, batch, key):
  model = trainer.build_model(config, trainer.run_keys(0)["init"])
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  state = trainer.initial_state(config, nnx.state(model, nnx.Param), jax.jit(optimizer.init))
  step = jax.jit(steps_lib.make_train_step(nnx.graphdef(model), optimizer, config.osci_reset))
  compiled = step.lower(state, batch, key).compile()
  return compiled, state, int(compiled.memory_analysis().argument_size_in_bytes)


def benchmark(model: str, recipe: str, *, steps: int, warmup: int, batch_size: int, seq_len: int | None) -> dict:
  base = TrainConfig.from_options(model=model, recipe=recipe, batch_size=batch_size, seq_len=seq_len, steps=1000,
                                  progress=False)
  on = base.replace(osci_reset_start=0)
  seq_len = base.train_seq_len
  dataset = data.load_dataset(data.DataConfig())
  batch = data.get_batch(dataset, "train", 0, batch_size=batch_size, seq_len=seq_len, seed=0)
  key = trainer.run_keys(0)["step"]
  off_step, off_state, off_bytes = _compiled(base, batch, key)
  on_step, on_state, on_bytes = _compiled(on, batch, key)
  runs = {"off": (off_step, off_state)}
  for name, counter in COUNTERS.items():
    runs[name] = (on_step, on_state._replace(step=jnp.asarray(counter, jnp.int32)))
  # The same state every call: each run stays on its branch.
  med = common.interleaved_medians({name: (fn, (state, batch, key)) for name, (fn, state) in runs.items()},
                                   steps=steps, warmup=warmup)
  return {"model": model, "recipe": recipe, "steps": steps, "median_s": med,
          "ratio": {name: med[name] / med["off"] for name in runs},
          "state_mib": {"off": off_bytes / 2**20, "on": on_bytes / 2**20}}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="tiny")
  parser.add_argument("--recipe", default="tetrajet_v2")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
  parser.add_argument("--json", default=None, help="also write the result here")
  args = parser.parse_args(argv)
  row = benchmark(args.model, args.recipe, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                  seq_len=args.seq_len)
  print(f"{row['model']} {row['recipe']} ({jax.default_backend()}), median of {row['steps']} steps, vs OsciReset off:")
  for name, ratio in row["ratio"].items():
    print(f"  {name:9s} {row['median_s'][name] * 1e3:8.2f} ms  x{ratio:.3f}")
  print(f"  state MiB: off {row['state_mib']['off']:.2f}, on {row['state_mib']['on']:.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(row, f, indent=1)


if __name__ == "__main__":
  main()
