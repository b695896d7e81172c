"""Train-step time and memory of quantized recipes relative to bf16, for the tiny and small models.

    python benchmarks/train_step.py                       # tiny and small, nvfp4 vs bf16
    python benchmarks/train_step.py --models small --recipes bf16 nvfp4 mxfp4 fp8 --steps 20 --json out.json

Per (model, recipe): compile time, median step time (the jitted fp4jax.pretrain.steps train step on real batches,
after a warmup, recipes interleaved step by step so load changes on a shared machine hit all alike), the
forward-only (eval) median, and memory from XLA's compiled memory analysis: temp (scratch, incl. saved activations
and residuals), argument and output bytes of the step (the state is donated, as in the trainer, so the output
reuses the argument's buffers); "faults" is the process's minor page faults per step
(median): XLA:CPU allocates the step's scratch afresh on every call (see common.malloc_note). Ratios are against
the first recipe (bf16 by default); with --runs N the timed steps come in N blocks, and "x med" / "x min" are the
median / min over blocks of each block's step-time ratio. "loss@step" is each recipe's training loss at its last
timed step (on that step's batch, before its update; every recipe sees the same batches and keys), so a ratio is
never read without what the timed run trains to. `--grad-accum 1 4` adds a row per recipe and number of
micro-batches per step ("nvfp4/accum4": the same batch in 4 micro-batches, steps.accumulated): what accumulation
costs in step time, and what it saves in temp memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import steps as steps_lib  # pylint: disable=wrong-import-position
from fp4jax.pretrain import trainer  # pylint: disable=wrong-import-position
from fp4jax.pretrain.config import TrainConfig  # pylint: disable=wrong-import-position


def _setup(model_name: str, recipe: str, batch_size: int, seq_len: int | None, dataset, model_overrides=None,
           grad_accum: int = 1):
  """Compiled train and eval steps, an initial state and a few batches for one (model, recipe, grad_accum);
  `model_overrides`: ModelConfig fields to replace, e.g. {"n_layers": 8}."""
  overrides = {f"model.{k}": v for k, v in (model_overrides or {}).items()}
  config = TrainConfig.from_options(model=model_name, recipe=recipe, batch_size=batch_size, seq_len=seq_len,
                                    steps=1000, progress=False, grad_accum=grad_accum, **overrides)
  keys = trainer.run_keys(0)
  model = trainer.build_model(config, keys["init"])
  graphdef = nnx.graphdef(model)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  params = nnx.state(model, nnx.Param)
  state = steps_lib.TrainState(params, jax.jit(optimizer.init)(params), jnp.asarray(0, jnp.int32))
  batches = [data.get_batch(dataset, "train", i, batch_size=batch_size, seq_len=config.train_seq_len, seed=0)
             for i in range(4)]
  step, compile_s = compile_step(graphdef, optimizer, state, batches[0], keys["step"], grad_accum)
  evaluate = jax.jit(steps_lib.make_eval_step(graphdef)).lower(params, batches[0], keys["step"]).compile()
  memory = memory_bytes(step)
  return {"config": config, "step": step, "eval": evaluate, "state": state, "batches": batches,
          "key": keys["step"], "compile_s": compile_s, "memory": memory, "graphdef": graphdef, "optimizer": optimizer,
          "tokens": batch_size * config.train_seq_len, "step_times": [], "eval_times": [], "step_faults": []}


def compile_step(graphdef, optimizer, state, batch, key, grad_accum: int = 1):
  """(the train step compiled for these arguments, the seconds it took to trace, lower and compile). A new step
  function every call; the jits nested in it keep their trace caches (benchmarks/compile_time.py clears them)."""
  t0 = time.perf_counter()
  # Donated, as the trainer's step is (steps.Phases): the new state is written over the old one.
  step = jax.jit(steps_lib.make_train_step(graphdef, optimizer, grad_accum=grad_accum),
                 donate_argnums=0).lower(state, batch, key).compile()
  return step, time.perf_counter() - t0


def memory_bytes(compiled, names=("temp", "argument", "output")) -> dict[str, int]:
  """{name: bytes} from XLA's memory analysis of a compiled function (0 where the backend reports none)."""
  mem = compiled.memory_analysis()
  return {name: int(getattr(mem, f"{name}_size_in_bytes", 0) or 0) for name in names}


def _time_once(run: dict, i: int) -> None:
  batch, key = run["batches"][i % len(run["batches"])], jax.random.fold_in(run["key"], i)
  faults, t0 = common.minor_faults(), time.perf_counter()
  state, metrics = run["step"](run["state"], batch, key)
  jax.block_until_ready((state, metrics))
  run["step_times"].append(time.perf_counter() - t0)
  run["step_faults"].append(common.minor_faults() - faults)
  run["state"] = state
  run["loss"], run["loss_step"] = float(metrics["loss"]), i  # the loss of step i's batch, before its update
  t0 = time.perf_counter()
  jax.block_until_ready(run["eval"](state.params, batch, key))
  run["eval_times"].append(time.perf_counter() - t0)


def benchmark(models, recipes, *, steps: int, warmup: int, batch_size: int, seq_len: int | None,
              runs: int = 1, grad_accums=(1,)) -> list[dict]:
  """One result row per (model, recipe, grad_accum); the first recipe at the first grad_accum is the baseline.
  With runs > 1 the timed steps repeat in `runs` blocks (after one warmup) and each row also gets the median and min
  over blocks of the block's median step-time ratio."""
  dataset = data.load_dataset(data.DataConfig())
  rows = []
  entries = {(r if a == 1 else f"{r}/accum{a}"): (r, a) for a in grad_accums for r in recipes}
  recipes = list(entries)
  for model_name in models:
    setups = {label: _setup(model_name, r, batch_size, seq_len, dataset, grad_accum=a)
              for label, (r, a) in entries.items()}
    for i in range(warmup):
      for r in recipes:
        _time_once(setups[r], i)
    for r in recipes:
      setups[r]["step_times"], setups[r]["eval_times"], setups[r]["step_faults"] = [], [], []
    block_ratios = {r: [] for r in recipes}
    for b in range(runs):
      for i in range(steps):
        for r in recipes:  # interleaved: a load spike on a shared machine hits every recipe
          _time_once(setups[r], warmup + b * steps + i)
      base_block = float(np.median(setups[recipes[0]]["step_times"][b * steps:]))
      for r in recipes:
        block_ratios[r].append(float(np.median(setups[r]["step_times"][b * steps:])) / base_block)
    base = setups[recipes[0]]
    base_step = float(np.median(base["step_times"]))
    base_eval = float(np.median(base["eval_times"]))
    for r in recipes:
      run = setups[r]
      step_s = float(np.median(run["step_times"]))
      eval_s = float(np.median(run["eval_times"]))
      mem = run["memory"]
      rows.append({
          "model": model_name, "recipe": r, "tokens_per_step": run["tokens"], "compile_s": run["compile_s"],
          "step_ms": 1e3 * step_s, "step_ratio": step_s / base_step, "eval_ms": 1e3 * eval_s,
          "eval_ratio": eval_s / base_eval, "tokens_per_s": run["tokens"] / step_s,
          "ratio_median": float(np.median(block_ratios[r])), "ratio_min": float(np.min(block_ratios[r])),
          "temp_mib": mem["temp"] / 2**20, "temp_ratio": mem["temp"] / max(base["memory"]["temp"], 1),
          "argument_mib": mem["argument"] / 2**20, "output_mib": mem["output"] / 2**20,
          "faults_per_step": float(np.median(run["step_faults"])), "loss": run["loss"],
          "loss_step": run["loss_step"]})
  return rows


def _print(rows: list[dict]) -> None:
  width = max(7, *(len(r["recipe"]) for r in rows))
  head = (f"{'model':<6} {'recipe':<{width}} {'compile s':>9} {'step ms':>8} {'x':>6} {'fwd ms':>7} {'x':>6} "
          f"{'tok/s':>8} {'temp MiB':>8} {'x':>6} {'args MiB':>8} {'x med':>6} {'x min':>6} {'loss@step':>12} "
          f"{'faults':>7}")
  print(head)
  for r in rows:
    print(f"{r['model']:<6} {r['recipe']:<{width}} {r['compile_s']:>9.1f} {r['step_ms']:>8.1f} {r['step_ratio']:>6.2f} "
          f"{r['eval_ms']:>7.1f} {r['eval_ratio']:>6.2f} {r['tokens_per_s']:>8.0f} {r['temp_mib']:>8.2f} "
          f"{r['temp_ratio']:>6.2f} {r['argument_mib']:>8.2f} {r['ratio_median']:>6.2f} {r['ratio_min']:>6.2f} "
          f"{r['loss']:>7.4f}@{r['loss_step']:<4d} {r['faults_per_step']:>7.0f}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="tiny,small", help="comma-separated model presets")
  parser.add_argument("--recipes", nargs="+", default=["bf16", "nvfp4"],
                      help="recipes (CLI form, e.g. nvfp4:stochastic_rounding=false); the first is the baseline")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per recipe")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
  parser.add_argument("--runs", type=int, default=1,
                      help="blocks of --steps timed steps; 'x med' / 'x min': median / min of the blocks' ratios")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--grad-accum", type=int, nargs="+", default=[1],
                      help="micro-batches per step; several values give a row each per recipe")
  parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = parser.parse_args(argv)
  for flag in ("steps", "runs", "batch_size"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}.")
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0; got {args.warmup}.")
  if min(args.grad_accum) < 1:
    parser.error(f"--grad-accum must be >= 1 (each value); got {args.grad_accum}.")
  if args.seq_len is not None and args.seq_len < 1:
    parser.error(f"--seq-len must be >= 1; got {args.seq_len}.")
  rows = benchmark(args.models.split(","), args.recipes, steps=args.steps, warmup=args.warmup,
                   batch_size=args.batch_size, seq_len=args.seq_len, runs=args.runs, grad_accums=args.grad_accum)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; batch {args.batch_size}; "
        f"{common.malloc_note()}")
  _print(rows)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
