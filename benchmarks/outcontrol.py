"""Train-step time with OutControl's phases, relative to the same recipe with OutControl off.

    python benchmarks/outcontrol.py                            # tiny model, nvfp4, 5 % outliers, 20 timed steps
    python benchmarks/outcontrol.py --model small --fraction 0.1 --steps 10 --json out.json

Three compiled steps: the plain recipe ("off"), OutControl's "record" phase (the plain GEMMs plus the per-channel
input statistics) and its "on" phase (outlier channels through the MXFP8 GEMMs, the rest zeroed in the recipe's),
timed interleaved step by step so load changes on a shared machine hit all alike. Ratios are median step times over
the "off" median. The "on" step uses fixed outlier channels (the first k of each layer): the time does not depend
on which channels they are.
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
from fp4jax.pretrain import outcontrol  # pylint: disable=wrong-import-position
from fp4jax.pretrain import steps as steps_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import trainer  # pylint: disable=wrong-import-position
from fp4jax.pretrain.config import TrainConfig  # pylint: disable=wrong-import-position


def benchmark(model: str, recipe: str, fraction: float, *, steps: int, warmup: int, batch_size: int,
              seq_len: int | None) -> dict:
  config = TrainConfig.from_options(model=model, recipe=recipe, batch_size=batch_size, seq_len=seq_len, steps=1000,
                                    progress=False, outcontrol_fraction=fraction, outcontrol_start=0)
  dataset = data.load_dataset(data.DataConfig())
  batch = data.get_batch(dataset, "train", 0, batch_size=batch_size, seq_len=config.train_seq_len, seed=0)
  key = trainer.run_keys(0)["step"]
  model_ = trainer.build_model(config, trainer.run_keys(0)["init"])
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  state = trainer.initial_state(config, nnx.state(model_, nnx.Param), jax.jit(optimizer.init))
  idx = jax.tree.map(lambda i: jnp.arange(i.shape[0], dtype=jnp.int32), state.outcontrol.idx)
  state = state._replace(outcontrol=state.outcontrol._replace(idx=idx))
  graphdef = nnx.graphdef(model_)
  runs = {}
  for phase in outcontrol.PHASES:
    fn = jax.jit(steps_lib.make_train_step(graphdef, optimizer, None, config.outcontrol, phase))
    runs[phase] = fn.lower(state, batch, key).compile()
  med = common.interleaved_medians({name: (fn, (state, batch, key)) for name, fn in runs.items()}, steps=steps,
                                   warmup=warmup)  # the same state every call
  return {"model": model, "recipe": recipe, "fraction": fraction, "steps": steps, "median_s": med,
          "ratio": {name: med[name] / med["off"] for name in runs}}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="tiny")
  parser.add_argument("--recipe", default="nvfp4")
  parser.add_argument("--fraction", type=float, default=0.05)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
  parser.add_argument("--json", default=None, help="also write the result here")
  args = parser.parse_args(argv)
  row = benchmark(args.model, args.recipe, args.fraction, steps=args.steps, warmup=args.warmup,
                  batch_size=args.batch_size, seq_len=args.seq_len)
  print(f"{row['model']} {row['recipe']} ({jax.default_backend()}), OutControl fraction {row['fraction']}, median "
        f"of {row['steps']} steps, vs OutControl off:")
  for name, ratio in row["ratio"].items():
    print(f"  {name:7s} {row['median_s'][name] * 1e3:8.2f} ms  x{ratio:.3f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(row, f, indent=1)


if __name__ == "__main__":
  main()
