"""The training loop's period: `fp4jax train`'s overlapped loop against the same loop made synchronous.

  python benchmarks/trainer_loop.py [--model tiny] [--recipes bf16 nvfp4] [--steps 100] [--skip 10] [--rounds 3]
      [--corpus shakespeare]

`fp4jax.pretrain.trainer.train` sends step s + 1 to the device before it reads step s's loss, so the host's work
between steps (the batch, the step call, the metrics) overlaps the device's step. A hook that reads the train state
after every step makes the loop wait for each step before sending the next: the synchronous loop, the baseline
(what the trainer did until 2026-12-06). Per recipe the two modes run `--rounds` times each, alternating (one
compile, shared through a CompileCache; the first run also warms up the process), and each mode reports its
fastest run: the median period of a hook's clock over the steps after `--skip`, the median `step_time` of those
steps (in the synchronous loop: the step call until its loss is on the host, so period minus step is the host's
work between steps) and the loss after the last step, which must be the same in both modes (the overlap changes
when the host reads, not what the device computes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import config as config_lib  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import data as data_lib  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import steps as steps_lib  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import trainer  # noqa: E402  pylint: disable=wrong-import-position

MODES = ("overlapped", "synchronous")


def run_once(model: str, recipe: str, mode: str, *, steps: int, skip: int, batch_size: int,
             cache: steps_lib.CompileCache, corpus: str = data_lib.BUILTIN_CORPUS) -> dict:
  """One `trainer.train` run in `mode` on `corpus` (`--corpus`): {"period", "step"} (seconds, medians from step
  `skip` on) and "loss"."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
  if steps < skip + 4:
    raise ValueError(f"need at least 4 timed steps: steps {steps} with skip {skip}.")
  clock, step_s = [], []

  def on_record(step, record):
    clock.append(time.perf_counter())
    if "step_time" in record:
      step_s.append(record["step_time"])

  hooks = [on_record] + ([trainer.Hook(lambda info: None)] if mode == "synchronous" else [])
  with tempfile.TemporaryDirectory() as out:
    config = config_lib.config_from_overrides(dict(
        model=model, recipe=recipe, steps=steps, batch_size=batch_size, out=out, progress=False, eval_every=0,
        data=corpus,
        checkpoint_every=10**6, log_every=steps))
    result = trainer.train(config, hooks, log=lambda _: None, compile_cache=cache)
  # clock[-1] is the final call after the last step; the record hook runs once per step before it.
  periods = [b - a for a, b in zip(clock[skip:-2], clock[skip + 1:-1])]
  return {"period": statistics.median(periods), "step": statistics.median(step_s[skip:]),
          "loss": result["final_loss"], "counted": len(periods)}


def loop_periods(model: str, recipe: str, *, steps: int, skip: int, rounds: int, batch_size: int,
                 corpus: str = data_lib.BUILTIN_CORPUS) -> dict:
  """{mode: the fastest of `rounds` runs (run_once)}, the modes alternating, one compile."""
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1; got {rounds}.")
  cache, best = steps_lib.CompileCache(), {}
  for _ in range(rounds):
    for mode in MODES:
      run = run_once(model, recipe, mode, steps=steps, skip=skip, batch_size=batch_size, cache=cache,
                     corpus=corpus)
      if mode not in best or run["period"] < best[mode]["period"]:
        best[mode] = run
  return best


def row(recipe: str, best: dict) -> list:
  """A table row: periods in ms, their ratio, the synchronous loop's step and host work, both losses."""
  over, sync = best["overlapped"], best["synchronous"]
  return [recipe, f"{1e3 * over['period']:.2f}", f"{1e3 * sync['period']:.2f}", f"{over['period'] / sync['period']:.3f}",
          f"{1e3 * sync['step']:.2f}", f"{1e3 * (sync['period'] - sync['step']):.2f}", f"{over['loss']:.6f}",
          "same" if over["loss"] == sync["loss"] else f"DIFFERS: {sync['loss']:.6f}"]


HEADERS = ["recipe", "overlapped ms", "synchronous ms", "ratio", "sync step ms", "sync host ms", "loss", "sync loss"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="tiny")
  parser.add_argument("--recipes", nargs="+", default=["bf16", "nvfp4"])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--skip", type=int, default=10, help="first steps not counted (compile, warm-up)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--corpus", default=data_lib.BUILTIN_CORPUS, help="as `fp4jax train --corpus`")
  args = parser.parse_args(argv)
  if args.skip < 0:
    parser.error(f"--skip must be >= 0; got {args.skip}.")
  if args.steps < args.skip + 4:
    parser.error(f"--steps must be at least --skip + 4 (4 timed steps); got --steps {args.steps} --skip {args.skip}.")
  if args.rounds < 1:
    parser.error(f"--rounds must be >= 1; got {args.rounds}.")
  if args.batch_size < 1:
    parser.error(f"--batch-size must be >= 1; got {args.batch_size}.")
  rows, counted = [], set()
  for recipe in args.recipes:
    best = loop_periods(args.model, recipe, steps=args.steps, skip=args.skip, rounds=args.rounds,
                        batch_size=args.batch_size, corpus=args.corpus)
    rows.append(row(recipe, best))
    counted.update(run["counted"] for run in best.values())
    print(f"{recipe} done", file=sys.stderr, flush=True)
  print(f"trainer loop, {args.model}, batch {args.batch_size}, {args.steps} steps "
        f"({'/'.join(map(str, sorted(counted)))} periods counted), fastest of {args.rounds} runs per mode, alternating")
  print(common.format_table(HEADERS, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
