"""Compile time and step time of the train step against depth: the blocks as a Python loop or as one lax.scan.

    python benchmarks/compile_time.py                                # tiny widths, 2 and 8 layers, bf16 and nvfp4
    python benchmarks/compile_time.py --depths 2 4 8 16 --steps 20 --compiles 6 --json out.json
    python benchmarks/compile_time.py --depths 16 --recipes nvfp4 --remat       # both modes rematerialise blocks

Each (depth, recipe) builds the donated train step with `ModelConfig.scan_layers` off ("loop") and on ("scan"), from
the same initial state, compiles each once to warm the process up (not reported), then `--compiles` more times, the
two modes alternating (loop scan, scan loop, ...) so that a drift of the machine's speed hits both alike. Every one of
these is a fresh compile: a new step function, JAX's in-memory caches cleared, and JAX's persistent compilation cache
off (`persistent_cache_off`: a program read from disk would time the read, not XLA; the run stops with an error if
one was served anyway). It reports each mode's median and min compile seconds and the ratio of the medians (scan over
loop), each one's median step time (the two stepped alternately on the same batches and keys, so load changes on a
shared machine hit both), the scan/loop ratio, and the step's temp memory (XLA's compiled memory analysis: scratch
incl. saved activations). The scan runs the model's arithmetic unchanged: "first loss" says whether the first step's
losses have the same bits. The optimizer's global gradient norm may then differ in its last bit (XLA fuses that
reduction differently in the two programs), so later steps drift apart by float32 rounding: "max |dloss|" is the
largest gap between the two runs' losses over all steps, "loss" the scan run's last. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Callable

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import train_step  # pylint: disable=wrong-import-position
from fp4jax.pretrain import data  # pylint: disable=wrong-import-position

MODES = ("loop", "scan")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax.monitoring's event for a persistent-cache hit


@contextlib.contextmanager
def persistent_cache_off():
  """JAX's persistent compilation cache off inside, restored after. Raises RuntimeError on exit if a compile inside
  was served from it anyway (the timing would be a file read)."""
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  hits = []

  def on_event(event: str, **kwargs) -> None:
    del kwargs
    if event == CACHE_HIT_EVENT:
      hits.append(event)

  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # JAX decides once per process whether to use the cache: make it decide again
  jax.monitoring.register_event_listener(on_event)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_listener(on_event)
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()
  if hits:
    raise RuntimeError(f"{len(hits)} compile(s) timed with the persistent compilation cache off were read from it; "
                       "the compile times would be cache reads. Unset JAX_COMPILATION_CACHE_DIR and rerun.")


def alternating_compiles(compile_fns: dict[str, Callable[[], float]], rounds: int
                         ) -> tuple[dict[str, list[float]], list[list[str]]]:
  """Seconds of `rounds` compiles of each entry (each fn compiles once and returns its seconds), the order
  alternating round by round (A B, B A, ...). JAX's in-memory caches are cleared before every compile and the
  persistent cache is off throughout. Returns ({name: seconds per round}, each round's order)."""
  if rounds < 1:
    raise ValueError(f"need at least 1 compile per configuration; got {rounds}.")
  names = list(compile_fns)
  seconds, orders = {name: [] for name in names}, []
  with persistent_cache_off():
    for r in range(rounds):
      order = names if r % 2 == 0 else names[::-1]
      for name in order:
        jax.clear_caches()  # the nested jits' traces and lowerings too, or the later compiles skip that work
        seconds[name].append(compile_fns[name]())
      orders.append(list(order))
  return seconds, orders


def _recompile(run: dict) -> float:
  """Seconds to trace, lower and compile `run`'s train step afresh (its state not yet stepped: not donated)."""
  return train_step.compile_step(run["graphdef"], run["optimizer"], run["state"], run["batches"][0], run["key"])[1]


def _step(run: dict, i: int) -> float:
  """One timed train step of `run` on batch/key i; returns its loss."""
  batch, key = run["batches"][i % len(run["batches"])], jax.random.fold_in(run["key"], i)
  t0 = time.perf_counter()
  state, metrics = run["step"](run["state"], batch, key)
  jax.block_until_ready((state, metrics))
  run["step_times"].append(time.perf_counter() - t0)
  run["state"] = state
  return float(metrics["loss"])


def benchmark(model: str, depths, recipes, *, steps: int, warmup: int, batch_size: int, remat: bool = False,
              compiles: int = 4) -> list[dict]:
  """One row per (depth, recipe): median and min compile seconds of loop and scan over `compiles` fresh compiles
  each (alternating), median step ms, their ratios, and how far apart the two runs' losses are."""
  dataset = data.load_dataset(data.DataConfig())
  rows = []
  for depth in depths:
    for recipe in recipes:
      print(f"{depth} layers, {recipe}: compiling loop and scan {1 + compiles} times each, then {warmup + steps} "
            f"steps each", file=sys.stderr, flush=True)
      runs = {mode: train_step._setup(model, recipe, batch_size, None, dataset,  # pylint: disable=protected-access
                                      {"n_layers": depth, "scan_layers": mode == "scan", "remat": remat})
              for mode in MODES}
      compile_s, orders = alternating_compiles({m: lambda m=m: _recompile(runs[m]) for m in MODES}, compiles)
      losses = {mode: [] for mode in MODES}
      for i in range(warmup + steps):
        for mode in MODES:
          losses[mode].append(_step(runs[mode], i))
      loop, scan = ({"compile_s": statistics.median(compile_s[m]), "compile_min_s": min(compile_s[m]),
                     "step_ms": 1e3 * float(np.median(runs[m]["step_times"][warmup:])),
                     "temp_mib": runs[m]["memory"]["temp"] / 2**20} for m in MODES)
      rows.append({"model": model, "layers": depth, "recipe": recipe, "remat": remat,
                   "loop_compile_s": loop["compile_s"], "scan_compile_s": scan["compile_s"],
                   "loop_compile_min_s": loop["compile_min_s"], "scan_compile_min_s": scan["compile_min_s"],
                   "compile_ratio": scan["compile_s"] / loop["compile_s"],
                   "loop_compiles_s": compile_s["loop"], "scan_compiles_s": compile_s["scan"],
                   "compile_order": orders,
                   "loop_step_ms": loop["step_ms"], "scan_step_ms": scan["step_ms"],
                   "step_ratio": scan["step_ms"] / loop["step_ms"],
                   "loop_temp_mib": loop["temp_mib"], "scan_temp_mib": scan["temp_mib"],
                   "first_loss_same": losses["loop"][0] == losses["scan"][0],
                   "max_loss_diff": max(abs(a - b) for a, b in zip(losses["loop"], losses["scan"])),
                   "loss": losses["scan"][-1]})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="tiny", help="model preset whose widths are used")
  parser.add_argument("--depths", type=int, nargs="+", default=[2, 8], help="numbers of blocks")
  parser.add_argument("--recipes", nargs="+", default=["bf16", "nvfp4"], help="recipes (CLI form)")
  parser.add_argument("--steps", type=int, default=6, help="timed steps per mode")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
  parser.add_argument("--compiles", type=int, default=4,
                      help="fresh compiles per mode and configuration, the modes alternating (after one untimed)")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--remat", action="store_true", help="rematerialise each block in both modes (model.remat)")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = parser.parse_args(argv)
  if args.compiles < 1:
    parser.error(f"--compiles must be at least 1 (fresh compiles per mode); got {args.compiles}.")
  rows = benchmark(args.model, args.depths, args.recipes, steps=args.steps, warmup=args.warmup,
                   batch_size=args.batch_size, remat=args.remat, compiles=args.compiles)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; {args.model} widths, "
        f"batch {args.batch_size}; {args.steps} timed steps per mode{'; remat' if args.remat else ''}; "
        f"{args.compiles} fresh compiles per mode, alternating, persistent cache off")
  print(common.format_table(
      ["layers", "recipe", "compile s loop", "(min)", "scan", "(min)", "x med", "step ms loop", "scan", "x",
       "temp MiB loop", "scan", "first loss", "max |dloss|", "loss"],
      [[r["layers"], r["recipe"], f"{r['loop_compile_s']:.2f}", f"{r['loop_compile_min_s']:.2f}",
        f"{r['scan_compile_s']:.2f}", f"{r['scan_compile_min_s']:.2f}", f"{r['compile_ratio']:.2f}",
        f"{r['loop_step_ms']:.1f}", f"{r['scan_step_ms']:.1f}", f"{r['step_ratio']:.2f}",
        f"{r['loop_temp_mib']:.1f}", f"{r['scan_temp_mib']:.1f}", "same" if r["first_loss_same"] else "DIFFERS",
        f"{r['max_loss_diff']:.1e}", f"{r['loss']:.5f}"]
       for r in rows], align="rl" + "r" * 13))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
