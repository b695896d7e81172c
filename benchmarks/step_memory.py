"""What a train step needs in memory, by recipe and `--grad-accum`, from XLA's compiled memory analysis alone.

    python benchmarks/step_memory.py --model paper_1b --layers 2 --batch-size 8 --seq-len 1024 --grad-accum 1 4 8
    python benchmarks/step_memory.py --model small --recipes bf16 nvfp4 mxfp4

The step (the trainer's: donated state, fp4jax.pretrain.steps.make_train_step) is lowered on abstract arrays and
compiled, never run, so models far larger than this machine could step (`paper_1b`) are measured in seconds of
compile and no memory for parameters. Per row: temp (scratch: activations kept for the backward, residuals,
gradient sums), argument, output and aliased bytes, and the peak estimate arguments + outputs - aliased + temp.
Ratios are against the first row (the first recipe at the first grad_accum). The figures are XLA:CPU's buffer
assignment; a GPU's differs in detail (other fusions), not in what accumulation removes: activations of all but one
micro-batch.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import train_step  # pylint: disable=wrong-import-position
from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import steps as steps_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import trainer  # pylint: disable=wrong-import-position
from fp4jax.pretrain.config import TrainConfig  # pylint: disable=wrong-import-position

MIB = 2**20


def step_memory(model: str, recipe: str, *, batch_size: int, seq_len: int | None, grad_accum: int = 1,
                model_overrides: dict | None = None) -> dict:
  """XLA's memory analysis (bytes) and the compile seconds of one donated train step, compiled on abstract arrays."""
  overrides = {f"model.{k}": v for k, v in (model_overrides or {}).items()}
  config = TrainConfig.from_options(model=model, recipe=recipe, batch_size=batch_size, seq_len=seq_len,
                                    grad_accum=grad_accum, progress=False, **overrides)
  key = jax.random.key(0)
  model_abs = nnx.eval_shape(lambda: trainer.build_model(config, key))
  graphdef, params = nnx.graphdef(model_abs), nnx.state(model_abs, nnx.Param)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  state = steps_lib.TrainState(params, jax.eval_shape(optimizer.init, params), jax.ShapeDtypeStruct((), jnp.int32))
  tokens = jax.ShapeDtypeStruct((batch_size, config.train_seq_len), jnp.int32)
  compiled, compile_s = train_step.compile_step(graphdef, optimizer, state, {"inputs": tokens, "targets": tokens}, key,
                                                grad_accum)
  sizes = train_step.memory_bytes(compiled, ("temp", "argument", "output", "alias"))
  sizes["peak"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
  return {"model": model, "recipe": recipe, "grad_accum": grad_accum, "batch_size": batch_size,
          "seq_len": config.train_seq_len, "compile_s": compile_s, **sizes}


def table(rows: list[dict]) -> str:
  """The rows as a Markdown table, MiB and ratios to the first row."""
  base = rows[0]
  body = [[r["recipe"], r["grad_accum"], f"{r['compile_s']:.1f}", f"{r['temp'] / MIB:.1f}",
           f"{r['temp'] / max(base['temp'], 1):.2f}", f"{r['argument'] / MIB:.1f}", f"{r['peak'] / MIB:.1f}",
           f"{r['peak'] / max(base['peak'], 1):.2f}"] for r in rows]
  return common.format_table(["recipe", "grad_accum", "compile s", "temp MiB", "x", "args MiB", "peak MiB", "x"],
                             body)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="small", help="model preset")
  parser.add_argument("--layers", type=int, default=None, help="n_layers override (paper_1b has 20)")
  parser.add_argument("--recipes", nargs="+", default=["bf16", "nvfp4"], help="recipes (CLI form)")
  parser.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4], help="micro-batches per step")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
  args = parser.parse_args(argv)
  overrides = {} if args.layers is None else {"n_layers": args.layers}
  rows = [step_memory(args.model, r, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=a,
                      model_overrides=overrides) for r in args.recipes for a in args.grad_accum]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.model}"
        f"{'' if args.layers is None else f' (n_layers={args.layers})'}, batch {args.batch_size} x "
        f"{rows[0]['seq_len']} tokens; XLA's compiled memory analysis of the donated train step")
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
