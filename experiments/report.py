"""Tables and plots of a sweep: `python -m experiments.report RUN_DIR [--reference NAME] [--smooth STEPS]`.

Reads OUT/<run>/seed<k>/{summary.json, metrics.jsonl} (and OUT/sweep.json for the run order, labels and reference)
and writes into OUT:
  results.jsonl / results.csv  one row per run x seed: final val loss, gap to the reference (%), tokens/s, ...
                               (results.jsonl also: recipe_spec, the recipe in full, gemm_mode as "auto" resolved,
                               jax_version and platform; rows from before these were recorded lack them)
  curves.csv                   per-step train loss and validation loss of every run x seed (to replot elsewhere)
  results.md                   mean +- std over seeds per run, gap to the reference in %, tokens/s
  loss_curves.png              smoothed train loss (mean over seeds) and validation loss over tokens
  loss_gap.png                 relative loss gap to the reference over tokens, as in the paper's figures
The plots average the seeds the table does (a run's finished ones; a run without any: its diverged ones).
A run with a late switch to BF16 (precision_switch) has a dotted line in its color at the switch step.
The gap of a run is computed per seed against the reference run with the same seed (same initialisation and data
order), then averaged: (loss - loss_ref) / loss_ref * 100. `read_results(dir)` reads the written files back (a
copied results folder needs only results.jsonl, curves.csv and sweep.json; `python -m experiments.report` redraws
such a folder, e.g. experiments/results/formats_cpu, from them).
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common import PROBE_REPORT_COMMANDS, PROBE_RESULTS, PROVENANCE_FIELDS, SUMMARY_FILE, SWEEP_FILE
from experiments.common import fmt, has_provenance, probe_kind, table

RESULTS_JSONL, RESULTS_CSV, CURVES_CSV, RESULTS_MD = "results.jsonl", "results.csv", "curves.csv", "results.md"
LOSS_PNG, GAP_PNG = "loss_curves.png", "loss_gap.png"
_SEED_FOLDER = re.compile(r"seed(0|[1-9][0-9]*)")  # what run_dir names; seed0_old (a set-aside copy) is not one
_ROW_FIELDS = ("experiment", "preset", "run", "label", "seed", "status", "final_val_loss", "gap_pct", "final_loss",
               "tokens_per_s", "steps", "tokens", "wall_time", "diverged_step", "bf16_blocks", "recipe_name")


# --- reading ---------------------------------------------------------------------------------------------------

def _read_meta(folder: pathlib.Path) -> dict[str, Any]:
  path = folder / SWEEP_FILE
  return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ordered_runs(meta: Mapping[str, Any], names: Sequence[str]) -> list[str]:
  order = [r["name"] for r in meta.get("runs", [])]
  return [n for n in order if n in names] + sorted(n for n in set(names) if n not in order)


def _row(summary: Mapping[str, Any]) -> dict[str, Any]:
  row = {k: summary.get(k) for k in _ROW_FIELDS if k in summary}
  row["recipe_name"] = summary.get("recipe", "").split("'")[1] if "'" in summary.get("recipe", "") else None
  row["val_losses"] = summary.get("val_losses", {})
  row["overrides"] = summary.get("overrides", {})
  row["switch_step"] = summary["switch_step"] if "switch_step" in summary else _switch_step(summary)
  # Summaries from before these were recorded lack them: their rows do too (see _provenance_lines).
  row.update({k: summary[k] for k in PROVENANCE_FIELDS if summary.get(k) is not None})
  return row


def _switch_step(summary: Mapping[str, Any]) -> int | None:
  """The step of a run's late switch to BF16 from its config, for summaries written before they recorded it
  (PrecisionPolicy.switch_step: a fraction of the run rounds with Python's round)."""
  switch_at = (summary.get("config") or {}).get("policy", {}).get("switch_at")
  if switch_at is None or summary.get("steps") is None:
    return None
  return round(switch_at * summary["steps"]) if isinstance(switch_at, float) else int(switch_at)


def collect(folder: str | pathlib.Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[tuple[str, int], dict]]:
  """(meta, rows, curves) of the sweep in `folder` from its run folders; raises FileNotFoundError if none finished,
  ValueError if a summary.json sits in another run x seed's folder (a copy: one result counted twice, one lost).

  meta: sweep.json contents (or {} if absent), with "left_out" listing run folders of seeds beyond its "seeds"
  (an earlier command's, not read); rows: one dict per finished run x seed, in sweep order;
  curves: {(run, seed): {"step", "loss", "val_step", "val_loss"} numpy arrays}; a validation loss at step s is
  measured before update s (after s steps), the final one at s == steps.
  """
  folder = pathlib.Path(folder)
  meta = _read_meta(folder)
  found = {}
  for path in sorted(folder.glob(f"*/seed*/{SUMMARY_FILE}")):
    name = _SEED_FOLDER.fullmatch(path.parent.name)
    if name is None:  # e.g. seed0_old: a folder set aside by hand, whose summary would replace seed0's
      continue
    summary = json.loads(path.read_text(encoding="utf-8"))
    if (summary["run"], summary["seed"]) != (path.parent.parent.name, int(name.group(1))):
      # A folder copied by hand: its result would replace the run x seed it names and leave its own place empty.
      raise ValueError(f"{path} is the summary of {summary['run']}/seed{summary['seed']}, not of its folder "
                       f"{path.parent.relative_to(folder)}: move it back or delete that folder.")
    found[summary["run"], summary["seed"]] = (path.parent, summary)
  if not found:
    if (folder / PROBE_RESULTS).is_file():  # a probes folder (experiments.probes), which has its own report
      kind = probe_kind(json.loads((folder / PROBE_RESULTS).read_text()))
      raise FileNotFoundError(f"{folder} holds {kind} probe results ({PROBE_RESULTS}), not a sweep's runs: redraw "
                              f"its report with `{PROBE_REPORT_COMMANDS[kind].format(out=folder)}`.")
    raise FileNotFoundError(f"No finished runs (*/seed*/{SUMMARY_FILE}) under {folder}.")
  seeds = meta.get("seeds")
  if isinstance(seeds, int) and not isinstance(seeds, bool):
    # Folders of seeds beyond the sweep's --seeds (left by an earlier command with more) are not this sweep's runs.
    left_out = sorted(k for k in found if k[1] >= seeds)
    if left_out and len(left_out) < len(found):
      meta = dict(meta, left_out=[f"{run}/seed{seed}" for run, seed in left_out])
      for k in left_out:
        del found[k]
  rows, curves = [], {}
  for name in _ordered_runs(meta, [k[0] for k in found]):
    for (run, seed) in sorted(k for k in found if k[0] == name):
      run_folder, summary = found[run, seed]
      rows.append(_row(summary))
      curves[run, seed] = _curve(run_folder)
      mismatch = _curve_mismatch(summary, curves[run, seed])
      if mismatch:
        meta = dict(meta, inconsistent=[*meta.get("inconsistent", []), f"{run}/seed{seed}: {mismatch}"])
  _add_gaps(rows, meta.get("reference"))
  return meta, rows, curves


def _curve_mismatch(summary: Mapping[str, Any], curve: Mapping[str, np.ndarray]) -> str | None:
  """What a finished run's metrics.jsonl lacks of its summary.json (a log truncated or replaced by hand), or None.
  The table reads the summary, the plots the log: they must be the same run."""
  if summary.get("status") != "finished":
    return None
  steps, final = summary.get("steps"), summary.get("final_val_loss")
  if final is not None and np.isfinite(final):
    logged = dict(zip(curve["val_step"].tolist(), curve["val_loss"].tolist()))
    if steps not in logged:
      last = int(curve["step"][-1]) if len(curve["step"]) else None
      return (f"its metrics.jsonl has no validation at step {steps} (train records end at step {last}); the table "
              f"shows the summary's final val loss {final:.4f}")
    if logged[steps] != final:
      return f"its metrics.jsonl's validation at step {steps} is {logged[steps]:.6g}, the summary's {final:.6g}"
  return None


def _curve(run_folder: pathlib.Path) -> dict[str, np.ndarray]:
  """Train loss per logged step and validation loss per evaluated step (taken before that step's update)."""
  # Imported here: the rest of the report (and redrawing a copied results folder) runs without JAX.
  from fp4jax.pretrain import metrics  # pylint: disable=import-outside-toplevel
  records = metrics.read_metrics(run_folder)  # an unfinished last line (a killed run) left out
  steps = [r for r in records if "loss" in r]
  vals = [r for r in records if "val_loss" in r]
  return {"step": np.array([r["step"] for r in steps], int), "loss": np.array([r["loss"] for r in steps], float),
          "val_step": np.array([r["step"] for r in vals], int),
          "val_loss": np.array([r["val_loss"] for r in vals], float)}


def _finite_val(row: Mapping[str, Any]) -> bool:
  """A finished run with a finite final val loss (a NaN one is stored as finished: training stops on train loss)."""
  v = row.get("final_val_loss")
  return row["status"] == "finished" and v is not None and bool(np.isfinite(v))


def _unvalidated(row: Mapping[str, Any]) -> bool:
  """A finished run that took no val loss (eval_batches=0): counted as a seed, with no val loss or gap."""
  return row["status"] == "finished" and row.get("final_val_loss") is None


_COMPARED = ("experiment", "preset", "steps", "tokens")  # what a gap's two runs must share


def _setting(row: Mapping[str, Any]) -> tuple:
  return tuple(row.get(k) for k in _COMPARED)


def _add_gaps(rows: list[dict[str, Any]], reference: str | None) -> None:
  """Sets row["gap_pct"] against the reference run with the same seed (None without one, or where the two differ in
  experiment, preset, steps or tokens: runs copied into one folder by hand)."""
  ref = {r["seed"]: r for r in rows if r["run"] == reference and _finite_val(r)}
  for row in rows:
    base = ref.get(row["seed"])
    ok = base is not None and _finite_val(row) and _setting(row) == _setting(base)
    row["gap_pct"] = 100.0 * (row["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"] if ok else None


def read_results(folder: str | pathlib.Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict]:
  """(meta, rows, curves) from a folder's written results.jsonl and curves.csv (and sweep.json if present)."""
  folder = pathlib.Path(folder)
  path = folder / RESULTS_JSONL
  if not path.is_file():
    raise FileNotFoundError(f"No {RESULTS_JSONL} in {folder}: run `python -m experiments.report` on the sweep first.")
  meta = _read_meta(folder)
  rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
  curves: dict[tuple[str, int], dict[str, list]] = {}
  curves_path = folder / CURVES_CSV
  if curves_path.is_file():
    with open(curves_path, newline="", encoding="utf-8") as f:
      for rec in csv.DictReader(f):
        c = curves.setdefault((rec["run"], int(rec["seed"])), {"step": [], "loss": [], "val_step": [],
                                                               "val_loss": []})
        for column, step_key in (("loss", "step"), ("val_loss", "val_step")):
          if rec[column]:
            c[step_key].append(int(rec["step"]))
            c[column].append(float(rec[column]))
  curves = {k: {name: np.asarray(v) for name, v in c.items()} for k, c in curves.items()}
  # The stored gaps are to whichever --reference last wrote the file; the tables label them with the sweep's.
  _add_gaps(rows, meta.get("reference"))
  return meta, rows, curves


# --- tables ------------------------------------------------------------------------------------------------------

def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
  values = [v for v in values if v is not None]
  if not values:
    return None, None
  return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """One dict per run (in row order): seeds, diverged, val loss mean/std, gap mean/std (%) over the gap_seeds seeds
  whose reference run finished, tokens/s mean."""
  out = []
  for name in dict.fromkeys(r["run"] for r in rows):
    mine = [r for r in rows if r["run"] == name]
    done = [r for r in mine if _finite_val(r)]
    unvalidated = [r for r in mine if _unvalidated(r)]
    val_mean, val_std = _mean_std([r["final_val_loss"] for r in done])
    gaps = [r.get("gap_pct") for r in done if r.get("gap_pct") is not None]
    gap_mean, gap_std = _mean_std(gaps)
    # A diverged seed's few steps are mostly compile: its throughput is left out.
    tps, _ = _mean_std([r.get("tokens_per_s") for r in done + unvalidated])
    out.append({"run": name, "label": mine[0].get("label", name), "seeds": len(done) + len(unvalidated),
                "unvalidated": len(unvalidated),
                "diverged": [r.get("diverged_step") for r in mine if r["status"] == "diverged"],
                "nonfinite_val": sum(r["status"] == "finished" and not _finite_val(r) and not _unvalidated(r)
                                     for r in mine),
                "val_loss_mean": val_mean, "val_loss_std": val_std, "gap_pct_mean": gap_mean,
                "gap_pct_std": gap_std, "gap_seeds": len(gaps), "tokens_per_s": tps, "steps": mine[0].get("steps"),
                "tokens": mine[0].get("tokens"), "bf16_blocks": mine[0].get("bf16_blocks")})
  return out


def _count(n: float) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def _shared_settings(meta: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the base settings every run uses, those only the runs without their own value use). A base key that every
  run overrides is left out: no run used it (e.g. `--set recipe=...` on a sweep over recipes)."""
  base = dict(meta.get("base") or {})
  own = [set(r.get("overrides") or {}) for r in meta.get("runs") or []]
  if not own:
    return base, {}
  every, some = set.intersection(*own), set.union(*own)
  return ({k: v for k, v in base.items() if k not in some},
          {k: v for k, v in base.items() if k in some and k not in every})


def _missing(meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """The sweep's run x seed jobs (sweep.json's runs, seeds 0..seeds-1) without a row: unfinished, or never run."""
  seeds, runs = meta.get("seeds"), [r["name"] for r in meta.get("runs") or []]
  if not isinstance(seeds, int) or isinstance(seeds, bool):
    return []
  have = {(r["run"], r["seed"]) for r in rows}
  return [f"{run}/seed{seed}" for run in runs for seed in range(seeds) if (run, seed) not in have]


def _provenance_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """The GEMM modes ("auto" resolved) and jax / platform the rows record, and which rows record none (stored before
  results recorded them: a merge cannot check those against the current code)."""
  recorded = [r for r in rows if has_provenance(r)]
  lines = []
  if recorded:
    modes: dict[str, list[str]] = {}
    for r in recorded:
      modes.setdefault(r["gemm_mode"], [])
      if r["run"] not in modes[r["gemm_mode"]]:
        modes[r["gemm_mode"]].append(r["run"])
    where = sorted({f"jax {r.get('jax_version')} on {r.get('platform')}" for r in recorded})
    lines += ["GEMM mode: " + "; ".join(f"{m} ({', '.join(runs)})" for m, runs in modes.items())
              + f". Trained with {', '.join(where)}."]
  unrecorded = [f"{r['run']}/seed{r['seed']}" for r in rows if not has_provenance(r)]
  if unrecorded and not recorded:
    lines += ["Full recipe and GEMM mode not recorded (results stored before they were): a merge cannot check these "
              "runs against the current code."]
  elif unrecorded:
    lines += [f"**Not recorded** (full recipe and GEMM mode; stored before they were, not checked against the current "
              f"code): {', '.join(unrecorded)}."]
  return lines


def markdown_table(meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
  """The results.md text: a header describing the sweep, the per-run table, and how to read it."""
  reference = meta.get("reference")
  agg = aggregate(rows)
  first = rows[0]
  n_seeds = max(a["seeds"] + len(a["diverged"]) + a["nonfinite_val"] for a in agg)
  ref_rows = [r for r in rows if r["run"] == reference]
  first = ref_rows[0] if ref_rows else first  # the header describes the reference's setting
  lines = [f"# {meta.get('experiment', first.get('experiment', 'sweep'))} (preset {first.get('preset', '?')})", ""]
  if meta.get("description"):
    lines += [meta["description"], ""]
  if meta.get("command"):
    lines += [f"Command: `{meta['command']}`", ""]
  lines += [f"{first['steps']} steps, {_count(first['tokens'])} tokens per run, up to {n_seeds} seed(s) per run."]
  others = [r for r in rows if r["status"] == "finished" and _setting(r) != _setting(first)]
  if others:
    differs = lambda r: ", ".join(f"{k} {r.get(k)}" for k in _COMPARED if r.get(k) != first.get(k))
    listed = "; ".join(f"{r['run']}/seed{r['seed']}: {differs(r)}" for r in others)
    ours = ", ".join(f"{k} {first.get(k)}" for k in _COMPARED)
    lines += [f"**Not comparable** (no gap): {listed} (the reference's: {ours})."]
  missing = _missing(meta, rows)
  if missing:
    lines += [f"**Missing** (not finished, not in the table): {', '.join(missing)}."]
  if meta.get("inconsistent"):
    lines += [f"**Log and summary disagree** (the table reads summary.json, the plots metrics.jsonl): "
              f"{'; '.join(meta['inconsistent'])}."]
  if meta.get("left_out"):
    lines += [f"Left out: {', '.join(meta['left_out'])} (seeds beyond this sweep's {meta.get('seeds')}, from an "
              "earlier command; rerun with more --seeds to include them)."]
  lines += _provenance_lines(rows)
  shared, unless_own = _shared_settings(meta)
  if shared:
    lines += [f"Shared settings: `{json.dumps(shared)}`."]
  if unless_own:
    lines += [f"For runs that do not set their own: `{json.dumps(unless_own)}`."]
  lines += [""]
  gap_head = f"gap to {reference} (%)" if reference else "gap (%)"
  table_rows = []
  for a in agg:
    run_rows = [r for r in rows if r["run"] == a["run"]]
    setting = a["label"] if a["label"] != a["run"] else ", ".join(
        f"{k}={v}" for k, v in (run_rows[0].get("overrides") or {}).items()) or a["run"]
    seeds = f"{a['seeds']}" + (f" (+{len(a['diverged'])} diverged at step "
                               f"{', '.join(map(str, a['diverged']))})" if a["diverged"] else "") + (
                                   f" (+{a['nonfinite_val']} non-finite val loss)" if a["nonfinite_val"] else "") + (
                                   f" ({a['unvalidated']} without validation)" if a["unvalidated"] else "")
    gap = "reference" if a["run"] == reference else fmt(a["gap_pct_mean"], a["gap_pct_std"], 2, signed=True)
    if a["run"] != reference and 0 < a["gap_seeds"] < a["seeds"]:  # the reference diverged (or is missing) there
      gap += f" ({a['gap_seeds']} of {a['seeds']} seeds)"
    tps = f"{a['tokens_per_s']:.0f}" if a["tokens_per_s"] else "-"
    blocks = ",".join(map(str, a["bf16_blocks"])) if a["bf16_blocks"] else "none"
    table_rows.append([a["run"], setting, blocks, seeds, fmt(a["val_loss_mean"], a["val_loss_std"], 4), gap, tps])
  lines += [table(["run", "setting", "BF16 blocks", "seeds", "final val loss", gap_head, "tokens/s"], table_rows)]
  if reference and not any(a["run"] == reference and a["seeds"] > a["unvalidated"] for a in agg):
    why = ("took no val loss (eval_batches=0)" if any(a["run"] == reference and a["seeds"] for a in agg) else
           "has no finished seed here")
    lines += ["", f"No gaps: the reference run {reference!r} {why}."]
  lines += ["", "Final val loss: mean ± std over seeds on fixed held-out batches. Gap: (val loss - reference val "
            "loss) / reference val loss, computed per seed against the reference run with the same seed (same "
            "initialisation and data order), then mean ± std. Tokens/s: mean over seeds of each run's median training "
            "throughput, with the low-precision formats emulated (quantize, dequantize, bf16 or float32 matmul) on "
            "the machine that ran the sweep: not the speed of FP4 hardware.", ""]
  return "\n".join(lines)


def write_tables(folder: pathlib.Path, meta, rows, curves) -> list[pathlib.Path]:
  """Writes results.jsonl, results.csv, curves.csv and results.md into `folder`."""
  paths = [folder / RESULTS_JSONL, folder / RESULTS_CSV, folder / CURVES_CSV, folder / RESULTS_MD]
  paths[0].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  with open(paths[1], "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=_ROW_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
      writer.writerow({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()})
  with open(paths[2], "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(["run", "seed", "step", "loss", "val_loss"])
    for (run, seed), c in curves.items():
      val = dict(zip(c["val_step"].tolist(), c["val_loss"].tolist()))
      for step, loss in zip(c["step"].tolist(), c["loss"].tolist()):
        writer.writerow([run, seed, step, f"{loss:.6f}", f"{val.pop(step):.6f}" if step in val else ""])
      for step, v in sorted(val.items()):  # the final evaluation (step == steps) has no train loss
        writer.writerow([run, seed, step, "", f"{v:.6f}"])
  paths[3].write_text(markdown_table(meta, rows), encoding="utf-8")
  return paths


# --- plots -------------------------------------------------------------------------------------------------------

def smooth(values: np.ndarray, window: int, steps: np.ndarray | None = None) -> np.ndarray:
  """Trailing moving average over `window` entries, or, given the entries' increasing `steps`, over those of the
  last `window` steps (s - window < step <= s): a run logged every 10 steps (log_every) averages window / 10
  entries. The first entries average what is available."""
  values = np.asarray(values, float)
  if window <= 1 or len(values) == 0:
    return values
  csum = np.cumsum(np.insert(values, 0, 0.0))
  idx = np.arange(1, len(values) + 1)
  if steps is None:
    lo = np.maximum(idx - window, 0)
  else:
    steps = np.asarray(steps)
    lo = np.searchsorted(steps, steps - window, side="right")
  return (csum[idx] - csum[lo]) / (idx - lo)


def _default_window(curves) -> int:
  """1/20 of the longest run's logged steps, in steps (not in logged entries: those are fewer with log_every > 1)."""
  longest = max((int(c["step"][-1] - c["step"][0]) + 1 for c in curves.values() if len(c["step"])), default=1)
  return max(1, longest // 20)


def _plotted_seeds(rows, run: str) -> set[int]:
  """The seeds of `run` the plots average: the finished ones the table averages (a diverged seed's curve would cut
  the mean at its divergence step), or all of them for a run with none (its curves show where it diverged)."""
  mine = [r for r in rows if r["run"] == run]
  done = {r["seed"] for r in mine if r["status"] == "finished" and (
      r.get("final_val_loss") is None or bool(np.isfinite(r["final_val_loss"])))}  # None: run without validation
  return done or {r["seed"] for r in mine}


def _plot_label(rows, run: str) -> tuple[str, bool]:
  """(the legend entry of `run`, whether its plotted seeds all diverged). The table's seed count is said where
  the plots average fewer seeds than the run has, and a run with only diverged seeds says where they diverged."""
  mine = [r for r in rows if r["run"] == run]
  label = mine[0].get("label", run)
  diverged = [r.get("diverged_step") for r in mine if r["status"] == "diverged"]
  if not diverged:
    return label, False
  if len(diverged) == len(mine):
    return f"{label} (diverged at step {', '.join(map(str, diverged))})", True
  return f"{label} ({len(mine) - len(diverged)} of {len(mine)} seeds; {len(diverged)} diverged)", False


def _mean_curve(curves, run: str, key: str, step_key: str, window: int = 1, seeds=None):
  """(steps, mean over seeds (all, or those in `seeds`) of the smoothed curve) on the steps every seed logged."""
  mine = [c for (name, seed), c in sorted(curves.items())
          if name == run and (seeds is None or seed in seeds) and len(c[step_key])]
  if not mine:
    return None, None
  common = sorted(set.intersection(*(set(c[step_key].tolist()) for c in mine)))
  if not common:
    return None, None
  stacked = []
  for c in mine:
    values = smooth(c[key], window, c[step_key]) if window > 1 else c[key]
    lookup = dict(zip(c[step_key].tolist(), values))
    stacked.append([lookup[s] for s in common])
  return np.asarray(common), np.mean(stacked, axis=0)


def _paired_gap(curves, run: str, reference: str, key: str, step_key: str, window: int, seeds=None):
  """(steps, mean over seeds (all, or those in `seeds`) of 100 * (run - ref) / ref) using the smoothed curves of
  matching seeds."""
  gaps, steps = [], None
  for (name, seed), c in sorted(curves.items()):
    ref = curves.get((reference, seed))
    if name != run or ref is None or not len(c[step_key]) or not len(ref[step_key]) or (
        seeds is not None and seed not in seeds):
      continue
    a = dict(zip(c[step_key].tolist(), smooth(c[key], window, c[step_key]) if window > 1 else c[key]))
    b = dict(zip(ref[step_key].tolist(), smooth(ref[key], window, ref[step_key]) if window > 1 else ref[key]))
    common = sorted(set(a) & set(b))
    steps = common if steps is None else sorted(set(steps) & set(common))
    gaps.append({s: 100.0 * (a[s] - b[s]) / b[s] for s in common})
  if not gaps or not steps:
    return None, None
  return np.asarray(steps), np.mean([[g[s] for s in steps] for g in gaps], axis=0)


def _tokens_per_step(rows, run: str) -> float:
  row = next(r for r in rows if r["run"] == run)
  return row["tokens"] / row["steps"]


def _new_figure():
  # A bare Figure (no pyplot): no global backend state, renders with Agg when saved, displays inline in notebooks.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(8, 5))
  return fig, fig.add_subplot()


def _save(fig, path: pathlib.Path) -> pathlib.Path:
  fig.savefig(path, dpi=110)
  return path


_SWITCH_NOTE = " (dotted lines: a run's switch to BF16, in its color)"


def _mark_switches(ax, rows, run: str, color: str) -> bool:
  """A dotted line at each step where `run`'s seeds switch to BF16; whether it drew one."""
  tps = _tokens_per_step(rows, run)
  steps = {r.get("switch_step") for r in rows if r["run"] == run} - {None}
  for step in sorted(steps):
    ax.axvline(step * tps / 1e6, color=color, ls=":", lw=1.0)
  return bool(steps)


def loss_curves_figure(meta, rows, curves, window: int | None = None):
  """Figure: smoothed train loss (mean over seeds, lines) and validation loss (markers) over tokens, per run."""
  window = window or _default_window(curves)
  fig, ax = _new_figure()
  tail_values, switched = [], False
  for i, name in enumerate(dict.fromkeys(r["run"] for r in rows)):
    label, diverged = _plot_label(rows, name)
    color = f"C{i % 10}"
    switched |= _mark_switches(ax, rows, name, color)
    tps = _tokens_per_step(rows, name)
    seeds = _plotted_seeds(rows, name)
    steps, loss = _mean_curve(curves, name, "loss", "step", window, seeds)
    if steps is not None:
      ax.plot(steps * tps / 1e6, loss, color=color, lw=1.2, label=label)
      finite = np.flatnonzero(np.isfinite(loss))
      if diverged and len(finite):  # where it was last finite; its short curve does not set the zoom
        ax.plot(steps[finite[-1]] * tps / 1e6, loss[finite[-1]], "x", color=color, ms=8, mew=2)
      elif not diverged:
        tail_values.extend(loss[len(loss) // 10:])
    vsteps, vloss = _mean_curve(curves, name, "val_loss", "val_step", 1, seeds)
    if vsteps is not None:
      ax.plot(vsteps * tps / 1e6, vloss, "o", color=color, ms=3.5)
      if not diverged:
        tail_values.extend(vloss[len(vloss) // 4:])
  tail_values = [v for v in tail_values if np.isfinite(v)]  # a diverged run ends in NaN / inf
  if tail_values:  # zoom on the part of training where recipes differ, not the initial drop
    lo, hi = float(np.min(tail_values)), float(np.max(tail_values))
    pad = 0.05 * (hi - lo) if hi > lo else 0.05
    ax.set_ylim(lo - pad, hi + pad)
  ax.set_xlabel("tokens (M)" + _SWITCH_NOTE * switched)
  ax.set_ylabel(f"loss (train: moving average over {window} steps; dots: validation)")
  ax.set_title(f"{meta.get('experiment', '')} ({rows[0].get('preset', '')}): loss, mean over seeds")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def loss_gap_figure(meta, rows, curves, reference: str, window: int | None = None):
  """Figure: relative loss gap to `reference` (%) over tokens; smoothed train loss (lines), validation (markers)."""
  window = window or _default_window(curves)
  fig, ax = _new_figure()
  ax.axhline(0.0, color="k", lw=0.8)
  switched = False
  for i, name in enumerate(dict.fromkeys(r["run"] for r in rows)):
    if name == reference:
      continue
    label, _ = _plot_label(rows, name)
    color, tps = f"C{i % 10}", _tokens_per_step(rows, name)
    switched |= _mark_switches(ax, rows, name, color)
    seeds = _plotted_seeds(rows, name) & _plotted_seeds(rows, reference)  # the seeds the table's gap averages
    steps, gap = _paired_gap(curves, name, reference, "loss", "step", window, seeds)
    if steps is not None:
      skip = len(steps) // 20  # the first steps' gaps are dominated by the warmup
      ax.plot(steps[skip:] * tps / 1e6, gap[skip:], color=color, lw=1.2, label=label)
    vsteps, vgap = _paired_gap(curves, name, reference, "val_loss", "val_step", 1, seeds)
    if vsteps is not None:
      keep = vsteps > 0
      ax.plot(vsteps[keep] * tps / 1e6, vgap[keep], "o", color=color, ms=3.5)
  ax.set_xlabel("tokens (M)" + _SWITCH_NOTE * switched)
  ax.set_ylabel(f"relative loss gap to {reference} (%)")
  ax.set_title(f"{meta.get('experiment', '')}: (loss - loss_{reference}) / loss_{reference}, paired seeds "
               f"(lines: train, {window}-step average; dots: validation)", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


# --- entry points ------------------------------------------------------------------------------------------------

def write_report(folder: str | pathlib.Path, *, reference: str | None = None, window: int | None = None
                 ) -> list[pathlib.Path]:
  """Collects the runs under `folder` and writes the tables and plots there; returns the written paths.

  A folder without run folders but with written results (a copied results folder such as experiments/results/*)
  is redrawn from its results.jsonl and curves.csv.
  """
  folder = pathlib.Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"{folder} does not exist (or is not a folder): give a sweep's --out folder.")
  if not any(folder.glob("*/seed*/summary.json")) and (folder / RESULTS_JSONL).is_file():
    meta, rows, curves = read_results(folder)
  else:
    meta, rows, curves = collect(folder)
  if reference is not None:
    if reference not in {r["run"] for r in rows}:
      raise ValueError(f"Reference run {reference!r} has no finished seeds under {folder}; runs: "
                       f"{sorted({r['run'] for r in rows})}.")
    meta = dict(meta, reference=reference)
  # Always recomputed: a copied folder's results.jsonl holds the gaps to whatever --reference last wrote it.
  _add_gaps(rows, meta.get("reference"))
  written = write_tables(folder, meta, rows, curves)
  written.append(_save(loss_curves_figure(meta, rows, curves, window), folder / LOSS_PNG))
  ref = meta.get("reference")
  if ref and any(r["run"] == ref for r in rows) and len({r["run"] for r in rows}) > 1:
    written.append(_save(loss_gap_figure(meta, rows, curves, ref, window), folder / GAP_PNG))
  elif (folder / GAP_PNG).is_file():  # an earlier report's, against a reference these rows no longer have
    (folder / GAP_PNG).unlink()
  return written


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m experiments.report` (see --help and the module docstring); returns the exit code."""
  parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir", help="a sweep's --out folder")
  parser.add_argument("--reference", default=None, help="run the gaps are measured against (default: the sweep's)")
  parser.add_argument("--smooth", type=int, default=None, help="moving-average window in steps (default: 1/20 run)")
  args = parser.parse_args(argv)
  if args.smooth is not None and args.smooth < 1:  # 0 silently meant the default; negatives labelled the plots
    parser.error(f"--smooth must be a window of >= 1 steps; got {args.smooth}.")
  try:
    written = write_report(args.run_dir, reference=args.reference, window=args.smooth)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print((pathlib.Path(args.run_dir) / RESULTS_MD).read_text(encoding="utf-8"))
  print("Wrote: " + ", ".join(str(p) for p in written))
  return 0


if __name__ == "__main__":
  sys.exit(main())
