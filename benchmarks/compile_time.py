"""Compile time and step time of the train step against depth: the blocks as a Python loop or as one lax.scan.

    python benchmarks/compile_time.py                                # tiny widths, 2 and 8 layers, bf16 and nvfp4
    python benchmarks/compile_time.py --depths 2 4 8 16 --steps 20 --json out.json
    python benchmarks/compile_time.py --depths 16 --recipes nvfp4 --remat       # both modes rematerialise blocks

Each (depth, recipe) builds the donated train step twice, with `ModelConfig.scan_layers` off ("loop") and on
("scan"), from the same initial state. It reports each one's compile time, its median step time (the two stepped
alternately on the same batches and keys, so load changes on a shared machine hit both), the scan/loop ratios, and
the step's temp memory (XLA's compiled memory analysis: scratch incl. saved activations). The scan runs the model's
arithmetic unchanged: "first loss" says whether the first step's losses have the same bits. The optimizer's global
gradient norm may then differ in its last bit (XLA fuses that reduction differently in the two programs), so later
steps drift apart by float32 rounding: "max |dloss|" is the largest gap between the two runs' losses over all
steps, "loss" the scan run's last. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import train_step  # pylint: disable=wrong-import-position
from fp4jax.pretrain import data  # pylint: disable=wrong-import-position

MODES = ("loop", "scan")


def _step(run: dict, i: int) -> float:
  """One timed train step of `run` on batch/key i; returns its loss."""
  batch, key = run["batches"][i % len(run["batches"])], jax.random.fold_in(run["key"], i)
  t0 = time.perf_counter()
  state, metrics = run["step"](run["state"], batch, key)
  jax.block_until_ready((state, metrics))
  run["step_times"].append(time.perf_counter() - t0)
  run["state"] = state
  return float(metrics["loss"])


def benchmark(model: str, depths, recipes, *, steps: int, warmup: int, batch_size: int, remat: bool = False
              ) -> list[dict]:
  """One row per (depth, recipe): compile seconds and median step ms of loop and scan, their ratios, and how far
  apart the two runs' losses are."""
  dataset = data.load_dataset(data.DataConfig())
  rows = []
  for depth in depths:
    for recipe in recipes:
      print(f"{depth} layers, {recipe}: compiling loop and scan, then {warmup + steps} steps each", file=sys.stderr,
            flush=True)
      runs = {mode: train_step._setup(model, recipe, batch_size, None, dataset,  # pylint: disable=protected-access
                                      {"n_layers": depth, "scan_layers": mode == "scan", "remat": remat})
              for mode in MODES}
      losses = {mode: [] for mode in MODES}
      for i in range(warmup + steps):
        for mode in MODES:
          losses[mode].append(_step(runs[mode], i))
      loop, scan = ({"compile_s": runs[m]["compile_s"],
                     "step_ms": 1e3 * float(np.median(runs[m]["step_times"][warmup:])),
                     "temp_mb": runs[m]["memory"]["temp"] / 2**20} for m in MODES)
      rows.append({"model": model, "layers": depth, "recipe": recipe, "remat": remat,
                   "loop_compile_s": loop["compile_s"], "scan_compile_s": scan["compile_s"],
                   "compile_ratio": scan["compile_s"] / loop["compile_s"],
                   "loop_step_ms": loop["step_ms"], "scan_step_ms": scan["step_ms"],
                   "step_ratio": scan["step_ms"] / loop["step_ms"],
                   "loop_temp_mb": loop["temp_mb"], "scan_temp_mb": scan["temp_mb"],
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
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--remat", action="store_true", help="rematerialise each block in both modes (model.remat)")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = parser.parse_args(argv)
  rows = benchmark(args.model, args.depths, args.recipes, steps=args.steps, warmup=args.warmup,
                   batch_size=args.batch_size, remat=args.remat)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; {args.model} widths, "
        f"batch {args.batch_size}; {args.steps} timed steps per mode{'; remat' if args.remat else ''}")
  print(common.format_table(
      ["layers", "recipe", "compile s loop", "scan", "x", "step ms loop", "scan", "x", "temp MB loop", "scan",
       "first loss", "max |dloss|", "loss"],
      [[r["layers"], r["recipe"], f"{r['loop_compile_s']:.1f}", f"{r['scan_compile_s']:.1f}",
        f"{r['compile_ratio']:.2f}", f"{r['loop_step_ms']:.1f}", f"{r['scan_step_ms']:.1f}", f"{r['step_ratio']:.2f}",
        f"{r['loop_temp_mb']:.1f}", f"{r['scan_temp_mb']:.1f}", "same" if r["first_loss_same"] else "DIFFERS",
        f"{r['max_loss_diff']:.1e}", f"{r['loss']:.5f}"]
       for r in rows], align="rl" + "r" * 11))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
