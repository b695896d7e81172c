"""A sweep's trained runs evaluated in other precisions: `python -m experiments.eval_precision RUN_DIR`.

    python -m experiments.formats --preset smoke --out runs/formats
    python -m experiments.eval_precision runs/formats --recipes bf16 nvfp4 mxfp4

Every finished run x seed of the sweep folder (OUT/<run>/seed<k>/) is evaluated from its last checkpoint with each
recipe of --recipes in the layers its precision policy quantizes (`fp4jax eval --recipe`:
fp4jax.pretrain.trainer.with_forward_recipe; BF16 layers stay BF16, a late BF16 switch is dropped), next to its own
recipe. Read across a row: `bf16` is the run's weights without forward quantization, so own minus bf16 is what
quantizing the forward costs the trained model and bf16 minus the BF16 run's loss is what training in low precision
did to the weights; a BF16 run's row in nvfp4 is quantization after training (in every layer its policy quantizes:
all of them where it keeps no block in BF16, unlike FP4 runs that keep some, so compare columns within a row). All
columns use the run's own validation batches and eval key. A run whose last checkpoint lies past a late BF16 switch
(experiments.precision_switch) ran its forward in BF16 there, with either switch mode, so its own column is its BF16
forward and the table says so; the nvfp4 column, which drops the switch, gives what quantizing its forward costs.

Writes into OUT:
  eval_precision.jsonl  one row per run x seed x recipe (recipe "own": the run's own), val loss and checkpoint step
  eval_precision.md     mean ± std over seeds, runs by recipe, and each column's difference to the own column
  eval_precision.png    the table as grouped bars
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tqdm

from fp4jax import cli_values
from fp4jax.pretrain import compile_cache
from fp4jax.pretrain import trainer

from experiments import report
from experiments.common import fmt, table
from experiments.sweep import run_dir

JSONL, MARKDOWN, PNG = "eval_precision.jsonl", "eval_precision.md", "eval_precision.png"
OWN = "own"
DEFAULT_RECIPES = ("bf16", "nvfp4")


def evaluate_sweep(folder: str | pathlib.Path, recipes: Sequence[str] = DEFAULT_RECIPES, *,
                   progress: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """(the sweep's meta, one row per finished run x seed x recipe): {"run", "label", "seed", "recipe" (OWN for the
  run's own, else the spec asked for), "recipe_spec" (the policy's recipe), "phase" (1: past the run's late BF16
  switch, whose forward is BF16), "step", "val_loss"}.

  Recipes are checked against every run before anything is evaluated (a ValueError names the run); one listed twice
  is refused (each seed would count twice in the std).
  """
  repeated = sorted({r for r in recipes if list(recipes).count(r) > 1})
  if repeated:
    raise ValueError(f"--recipes lists {', '.join(map(repr, repeated))} more than once: each would be evaluated and "
                     "counted twice per seed.")
  folder = pathlib.Path(folder)
  meta, rows, _ = report.collect(folder)
  finished = [r for r in rows if r["status"] == "finished"]
  if not finished:
    raise FileNotFoundError(f"No finished runs under {folder}: nothing to evaluate.")
  runs = [(r, run_dir(folder, r["run"], r["seed"])) for r in finished]
  for row, run_folder in runs:  # a recipe a model cannot run is an error now, not after an hour of evaluations
    config = trainer.eval_setup(run_folder, eval_batches=None, log=None).config
    for recipe in recipes:
      try:
        trainer.with_forward_recipe(config, recipe)
      except ValueError as e:
        raise ValueError(f"{row['run']}/seed{row['seed']}: recipe {recipe!r}: {e}") from e
  out = []
  todo = [(row, run_folder, recipe) for row, run_folder in runs for recipe in (OWN, *recipes)]
  for row, run_folder, recipe in tqdm.tqdm(todo, desc="eval_precision", disable=not progress):
    result = trainer.evaluate(run_folder, recipe=None if recipe == OWN else recipe, log=None)
    out.append({"run": row["run"], "label": row.get("label", row["run"]), "seed": row["seed"], "recipe": recipe,
                "recipe_spec": result["recipe"], "phase": result["phase"], "step": result["step"],
                "val_loss": result["val_loss"]})
  return meta, out


def summarize(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[str], dict]:
  """(runs in order, recipe columns in order (OWN first), {(run, recipe): (mean, std over seeds, seeds)})."""
  runs = list(dict.fromkeys(r["run"] for r in rows))
  recipes = list(dict.fromkeys(r["recipe"] for r in rows))
  cells = {}
  for run in runs:
    for recipe in recipes:
      values = [r["val_loss"] for r in rows if r["run"] == run and r["recipe"] == recipe]
      # Sample std (ddof=1), as the sweep's results.md (experiments.report): one estimator behind one label.
      cells[run, recipe] = (float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else None,
                            len(values))
  return runs, recipes, cells


def markdown(rows: Sequence[dict[str, Any]], folder: pathlib.Path) -> str:
  """The table of eval_precision.md."""
  runs, recipes, cells = summarize(rows)
  # Rows written before "phase" was kept read as phase 0.
  specs = {r["run"]: r["recipe_spec"] + (", BF16 forward after its switch" if r.get("phase") else "")
           for r in rows if r["recipe"] == OWN}
  header = ["run (trained in)", "seeds", *(f"val loss: {r}" for r in recipes),
            *(f"{r} - own" for r in recipes if r != OWN)]
  body = []
  for run in runs:
    own = cells[run, OWN][0]
    body.append([f"{run} ({specs[run]})", cells[run, OWN][2], *(fmt(*cells[run, r][:2]) for r in recipes),
                 *(fmt(cells[run, r][0] - own, signed=True) for r in recipes if r != OWN)])
  return "\n".join([
      f"# Evaluated in other precisions: {folder}", "",
      "Validation loss of each run's last checkpoint with the recipe of each column in the layers its precision "
      "policy quantizes (BF16 layers stay BF16); `own`: the recipe it trained with (past a late BF16 switch: its "
      "BF16 forward). Mean ± std over seeds.", "",
      table(header, body), ""])


def paired_differences(rows: Sequence[dict[str, Any]], run: str, recipe: str) -> list[float]:
  """The val loss of `run` evaluated in `recipe` minus in its own, seed by seed (the seeds evaluated in both)."""
  own = {r["seed"]: r["val_loss"] for r in rows if r["run"] == run and r["recipe"] == OWN}
  return [r["val_loss"] - own[r["seed"]] for r in rows
          if r["run"] == run and r["recipe"] == recipe and r["seed"] in own]


def figure(rows: Sequence[dict[str, Any]]):
  """Grouped bars from zero: for each run, its val loss in each recipe column minus in its own recipe, paired by
  seed (the table's "- own" columns; mean over seeds, error bars the std over seeds of the paired differences where
  there are two or more). Differences of a few tenths of a percent stay visible, as absolute losses on a cut axis
  did not."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  runs, recipes, cells = summarize(rows)
  others = [r for r in recipes if r != OWN]
  fig = Figure(figsize=(min(12, max(6, 2 + 0.45 * len(runs) * max(len(others), 1))), 4.5))
  ax = fig.add_subplot()
  ax.axhline(0.0, color="k", lw=0.8)
  width = 0.8 / max(len(others), 1)
  x = np.arange(len(runs))
  seeds = max(cells[run, OWN][2] for run in runs)
  for i, recipe in enumerate(others):
    diffs = [paired_differences(rows, run, recipe) for run in runs]
    means = [float(np.mean(d)) if d else np.nan for d in diffs]
    stds = [float(np.std(d, ddof=1)) if len(d) > 1 else np.nan for d in diffs]
    ax.bar(x + (i - (len(others) - 1) / 2) * width, means, width, label=recipe,
           yerr=stds if seeds > 1 else None, capsize=2 if seeds > 1 else 0)
  ax.set_xticks(x, [f"{run}\nown: {cells[run, OWN][0]:.4f}" for run in runs])
  ax.set_xlabel("run (trained in), and its val loss in its own recipe")
  ax.set_ylabel("val loss minus in its own recipe")
  spread = "mean over seeds; error bars: std over seeds of the paired differences" if seeds > 1 else "1 seed"
  ax.set_title(f"Each run evaluated with each recipe, against its own\n({spread})", fontsize=10)
  if others:
    ax.legend(title="evaluated in")
  fig.tight_layout()
  return fig


def write(folder: str | pathlib.Path, rows: Sequence[dict[str, Any]]) -> list[pathlib.Path]:
  """eval_precision.jsonl, .md and .png in `folder`."""
  folder = pathlib.Path(folder)
  paths = [folder / JSONL, folder / MARKDOWN, folder / PNG]
  paths[0].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  paths[1].write_text(markdown(rows, folder), encoding="utf-8")
  figure(rows).savefig(paths[2], dpi=110)
  return paths


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] = print) -> int:
  """`python -m experiments.eval_precision` (see --help and the module docstring); returns the exit code."""
  parser = cli_values.ArgumentParser(prog="python -m experiments.eval_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("folder", help="a sweep folder (python -m experiments.NAME --out FOLDER)")
  parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                      help=f"recipes (CLI form) to evaluate every run with (default: {' '.join(DEFAULT_RECIPES)})")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)
  compile_cache.enable(log=lambda line: print(line, file=sys.stderr))  # before the first compile
  try:
    _, rows = evaluate_sweep(args.folder, args.recipes, progress=not args.quiet)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  paths = write(args.folder, rows)
  log(markdown(rows, pathlib.Path(args.folder)))
  log("Wrote " + ", ".join(str(p) for p in paths))
  return 0


if __name__ == "__main__":
  sys.exit(main())
