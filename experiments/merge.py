"""Merging a rerun of some runs of a sweep into its stored results (e.g. experiments/results/recipes_cpu).

`python -m experiments.NAME --preset P --runs a,b --out NEW --merge-into STORED` reruns runs a and b (and the
reference, which --runs keeps) and then rewrites STORED's results.jsonl, results.csv, curves.csv, results.md,
sweep.json and plots: the rows and curves of the rerun runs (new runs included) come from NEW, every other run's
from STORED, unchanged. The reference is not replaced: its rerun must reproduce the stored losses exactly (same
seeds, same data order), else the merge refuses, since the stored runs' gaps would be measured against another
reference than the new ones'. The kept runs must still have the settings the sweep gives them, and have been
trained under the recipe (defaults spelled out) and resolved GEMM mode this code and machine give those settings, as
their rows record (else rerun them too; rows stored before they recorded these cannot be checked, which the merge
says), and the two sweeps the same experiment, preset, shared settings and seed count. The result is what a full
run would have written, except for the kept runs' throughput and wall times, which a full run would measure again.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

from experiments import report
from experiments.common import SWEEP_FILE, has_provenance, jsonable


def _check_same_reference(reference: str, stored_rows, new_rows) -> None:
  def losses(rows):
    return {r["seed"]: (r["final_val_loss"], r.get("val_losses")) for r in rows if r["run"] == reference}
  old, new = losses(stored_rows), losses(new_rows)
  differ = sorted(s for s in set(old) & set(new) if old[s] != new[s])
  if differ or not set(new) <= set(old):
    raise ValueError(f"The rerun's reference run {reference!r} does not reproduce the stored one (seeds "
                     f"{differ or sorted(set(new) - set(old))} differ or are missing): the stored runs' gaps would "
                     "be measured against another reference; rerun the whole sweep instead.")


def _same_settings(base: Mapping[str, Any], a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
  """Whether two runs' own overrides give the same results on `base` (e.g. bf16_first=0 added: the default)."""
  # Imported here: building a TrainConfig imports JAX, which the rest of the merge (and the report) does not need.
  from experiments import sweep as sweep_lib  # pylint: disable=import-outside-toplevel
  from fp4jax.pretrain import config as config_lib  # pylint: disable=import-outside-toplevel
  try:
    a, b = (jsonable(config_lib.config_from_overrides(sweep_lib.merge_overrides(base, o or {})).to_dict())
            for o in (a, b))
  except (TypeError, ValueError):  # settings the current code no longer builds: compared as written
    return False
  return not config_lib.result_differences(a, b)


def _check_kept_runs(stored, stored_meta: Mapping[str, Any], meta: Mapping[str, Any], rerun) -> None:
  """The stored runs that are not rerun keep their rows: they must still be the runs the sweep defines, else their
  numbers would be listed under settings they did not run with (a run's definition edited since)."""
  old = {r["name"]: r.get("overrides") for r in stored_meta.get("runs") or []}
  gone = sorted(set(old) - {r["name"] for r in meta.get("runs") or []})
  if gone:
    raise ValueError(f"Runs {gone} of the stored results in {stored} are not in this sweep's run list: the merged "
                     "table would keep runs the sweep no longer defines; rerun the whole sweep instead.")
  changed = [(r["name"], old[r["name"]], r.get("overrides")) for r in meta.get("runs") or []
             if r["name"] in old and r["name"] not in rerun and r.get("overrides") != old[r["name"]]
             and not _same_settings(meta.get("base") or {}, old[r["name"]], r.get("overrides"))]
  if changed:
    listed = "; ".join(f"{name}: stored {a}, now {b}" for name, a, b in changed)
    raise ValueError(f"Runs of the stored results in {stored} that this merge keeps have other settings in this "
                     f"sweep ({listed}): their rows would be listed under the new settings; rerun them too (--runs).")


def _check_kept_provenance(stored, stored_rows, meta: Mapping[str, Any], rerun) -> list[str]:
  """The kept runs' rows must have been trained under the numerics this code and machine give their settings: the
  recipe in full (a default such as sr_bits changed since) and the GEMM mode "auto" resolves to (another CPU type or
  platform), else they would sit beside rerun runs trained otherwise. Returns the kept run x seeds that could not be
  checked (stored before results recorded these fields)."""
  from experiments import sweep as sweep_lib  # pylint: disable=import-outside-toplevel  (imports JAX)
  from fp4jax.pretrain import config as config_lib  # pylint: disable=import-outside-toplevel
  overrides = {r["name"]: r.get("overrides") or {} for r in meta.get("runs") or []}
  current, differ, unchecked = {}, [], []
  for row in stored_rows:
    name = row["run"]
    if name in rerun or name not in overrides:  # a run the sweep no longer defines is refused by _check_kept_runs
      continue
    if not has_provenance(row):
      unchecked.append(f"{name}/seed{row['seed']}")
      continue
    if name not in current:
      try:
        config = config_lib.config_from_overrides(sweep_lib.merge_overrides(meta.get("base") or {}, overrides[name]))
      except (TypeError, ValueError) as e:
        raise ValueError(f"Run {name!r} of the stored results in {stored}: the current code does not build its "
                         f"settings ({e}); rerun the whole sweep instead.") from e
      current[name] = sweep_lib.provenance(config)
    changed = sweep_lib.provenance_differences(row, current[name])
    if changed:
      differ.append(f"{name}/seed{row['seed']}: {sweep_lib.describe_differences(changed)}")
  if differ:
    runs = ",".join(dict.fromkeys(d.split("/")[0] for d in differ))
    raise ValueError(f"Runs of the stored results in {stored} that this merge keeps were trained under other "
                     f"numerics than this code gives their settings on this machine ({'; '.join(differ)}): their "
                     f"rows would sit beside runs trained otherwise; rerun them too (--runs {runs}), or rerun the "
                     "whole sweep.")
  return unchecked


def _unchecked_note(stored, unchecked: list[str]) -> str:
  return (f"Note: {len(unchecked)} kept run x seed(s) of {stored} ({', '.join(unchecked)}) were stored before results "
          "recorded the full recipe and GEMM mode: whether this code would train them the same way could not be "
          "checked.")


def _check_same_sweep(stored, stored_meta: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
  for key in ("experiment", "preset"):
    if stored_meta.get(key) != meta.get(key):
      raise ValueError(f"The stored results in {stored} are of {key} {stored_meta.get(key)!r}, this sweep's "
                       f"{meta.get(key)!r}: merge into that {key}'s results.")
  if stored_meta.get("base") != meta.get("base"):
    raise ValueError(f"The stored results in {stored} have other shared settings ({stored_meta.get('base')}) than "
                     f"this sweep ({meta.get('base')}); rerun the whole sweep instead.")
  if meta.get("seeds") != stored_meta.get("seeds"):  # else the rerun runs replace all stored seeds with fewer/more
    raise ValueError(f"The stored results in {stored} have {stored_meta.get('seeds')} seed(s) per run, this sweep "
                     f"{meta.get('seeds')}: the merged table would mix seed counts; rerun with --seeds "
                     f"{stored_meta.get('seeds')}.")
  if meta.get("reference") != stored_meta.get("reference"):
    raise ValueError(f"The stored results' reference {stored_meta.get('reference')!r} is not "
                     f"{meta.get('reference')!r}.")


def check_mergeable(stored: str | pathlib.Path, meta: Mapping[str, Any], rerun=None) -> None:
  """What merge_into checks of the sweeps themselves (experiment, preset, shared settings, reference and, given the
  names of the runs to rerun, the settings of the kept runs), before any run is trained."""
  stored_meta = report.read_results(stored)[0]
  _check_same_sweep(stored, stored_meta, meta)
  if rerun is not None:
    _check_kept_runs(stored, stored_meta, meta, set(rerun) | {meta.get("reference")})
    _check_kept_provenance(stored, report.read_results(stored)[1], meta, set(rerun) | {meta.get("reference")})


def merge_results(stored: str | pathlib.Path, new: str | pathlib.Path, meta: Mapping[str, Any], *,
                  log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], dict]:
  """(meta, rows, curves): STORED's written results with the runs of the sweep folder NEW replacing or adding theirs.

  meta: the full sweep's description (its run order, labels, reference, shared settings and command). The
  reference's rows stay STORED's (its rerun must match them); rows follow meta's run order; gaps are recomputed
  (the same numbers for the kept runs). `log` gets a note naming the kept runs whose numerics could not be checked.
  """
  stored_meta, stored_rows, stored_curves = report.read_results(stored)
  new_meta, new_rows, new_curves = report.collect(new)
  reference = meta.get("reference")
  _check_same_sweep(stored, stored_meta, meta)
  if reference is not None:
    _check_same_reference(reference, stored_rows, new_rows)
  replaced = {r["run"] for r in new_rows} - {reference}
  _check_kept_runs(stored, stored_meta, meta, replaced | {reference})
  unchecked = _check_kept_provenance(stored, stored_rows, meta, replaced | {reference})
  if unchecked and log is not None:
    log(_unchecked_note(stored, unchecked))
  rows = [r for r in stored_rows if r["run"] not in replaced] + [r for r in new_rows if r["run"] in replaced]
  order = [r["name"] for r in meta.get("runs", [])]
  unknown = sorted({r["run"] for r in rows} - set(order))
  if unknown:
    raise ValueError(f"Runs {unknown} are not in the sweep's run list {order}.")
  curves = {k: c for k, c in stored_curves.items() if k[0] not in replaced}
  curves.update({k: c for k, c in new_curves.items() if k[0] in replaced})
  rows.sort(key=lambda r: (order.index(r["run"]), r["seed"]))
  curves = {(r["run"], r["seed"]): curves[r["run"], r["seed"]] for r in rows if (r["run"], r["seed"]) in curves}
  report._add_gaps(rows, reference)  # pylint: disable=protected-access
  # A merged run whose log disagrees with its summary is said in the merged results.md (kept in its sweep.json).
  inconsistent = [n for n in new_meta.get("inconsistent", []) if n.split("/", 1)[0] in replaced]
  return dict(meta, **({"inconsistent": inconsistent} if inconsistent else {})), rows, curves


def merge_into(stored: str | pathlib.Path, new: str | pathlib.Path, meta: Mapping[str, Any], *,
               log: Callable[[str], None] | None = None) -> list[pathlib.Path]:
  """Writes the merge of `new` into the results folder `stored` (tables, sweep.json, plots); returns the paths."""
  stored = pathlib.Path(stored)
  meta, rows, curves = merge_results(stored, new, meta, log=log)
  report.write_tables(stored, meta, rows, curves)
  (stored / SWEEP_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
  # Redrawn from the written files, as any copied results folder is (curves at the CSV's precision).
  return report.write_report(stored) + [stored / SWEEP_FILE]


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  print(__doc__.strip(), file=sys.stderr)
  print("\nexperiments.merge has no command of its own: pass --merge-into to the sweep (python -m experiments.NAME).",
        file=sys.stderr)
  sys.exit(2)
