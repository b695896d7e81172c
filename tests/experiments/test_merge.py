"""Tests for experiments.merge: a rerun of some runs merged into stored results gives the files a full run writes."""

import json
import pathlib
import shutil

import pytest

from experiments import cli
from experiments import components
from experiments import merge
from experiments import report
from experiments import sweep as sweep_lib

TABLES = (report.RESULTS_JSONL, report.RESULTS_CSV, report.CURVES_CSV, report.RESULTS_MD, "sweep.json")
BASE = {"steps": 4, "lr": 0.01}
REPO = pathlib.Path(__file__).resolve().parents[2]


def _meta(runs, base=BASE):
  return {"experiment": "toy", "preset": "cpu", "seeds": 2, "reference": "bf16", "command": "python -m toy",
          "description": "toy sweep", "base": dict(base),
          "runs": [{"name": n, "label": n.upper(), "overrides": {"recipe": n}} for n in runs]}


def _write_run(folder: pathlib.Path, run: str, seed: int, final: float, extra=None) -> None:
  """A finished run folder as the sweep leaves it: summary.json and metrics.jsonl (4 steps, 2 validations).
  `extra`: more summary fields (the provenance a sweep records)."""
  d = folder / run / f"seed{seed}"
  d.mkdir(parents=True)
  records = [{"step": s, "loss": final + 1.0 / (s + 1) + 1e-7 * seed} for s in range(4)]
  records += [{"step": 0, "val_loss": final + 2.0}, {"step": 4, "val_loss": final}]
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  summary = {"experiment": "toy", "preset": "cpu", "run": run, "label": run.upper(), "seed": seed,
             "overrides": {"recipe": run}, "status": "finished", "steps": 4, "tokens_per_step": 8, "tokens": 32,
             "wall_time": 1.5 + seed, "tokens_per_s": 100.0 + final, "final_val_loss": final,
             "final_loss": final + 0.25, "val_losses": {"0": final + 2.0, "4": final}, "bf16_blocks": [],
             "recipe": f"Recipe(name='{run}')", **(extra or {})}
  (d / "summary.json").write_text(json.dumps(summary))


def _write_sweep(folder: pathlib.Path, meta, losses, extra=None) -> pathlib.Path:
  """`extra`: {run: more summary fields} (see _write_run)."""
  for (run, seed), final in losses.items():
    _write_run(folder, run, seed, final, (extra or {}).get(run))
  (folder / "sweep.json").write_text(json.dumps(meta, indent=1))
  return folder


OLD = {("bf16", 0): 2.0, ("bf16", 1): 2.1, ("a", 0): 2.2, ("a", 1): 2.3, ("b", 0): 2.4, ("b", 1): 2.5}
NEW = {("bf16", 0): 2.0, ("bf16", 1): 2.1, ("b", 0): 2.15, ("b", 1): 2.45, ("c", 0): 2.05, ("c", 1): 2.2}


def _stored(tmp_path, losses=OLD, runs=("bf16", "a", "b"), extra=None) -> pathlib.Path:
  """A copied results folder (tables and sweep.json, no run folders), as experiments/results/* holds."""
  full = _write_sweep(tmp_path / "old_runs", _meta(runs), losses, extra)
  report.write_report(full)
  stored = tmp_path / "stored"
  stored.mkdir()
  for name in TABLES:
    shutil.copy(full / name, stored / name)
  return stored


def test_merge_writes_what_a_full_run_writes(tmp_path):
  stored = _stored(tmp_path)
  rerun = _write_sweep(tmp_path / "rerun", _meta(["bf16", "b", "c"]), NEW)
  meta = _meta(["bf16", "a", "c", "b"])  # the full sweep: c is new, b is rerun, a is kept
  written = merge.merge_into(stored, rerun, meta)
  assert {p.name for p in written} >= set(TABLES) | {report.LOSS_PNG, report.GAP_PNG}

  everything = {**{k: v for k, v in OLD.items() if k[0] == "a"}, **NEW}
  full = _write_sweep(tmp_path / "full", meta, everything)
  report.write_report(full)
  for name in TABLES:
    assert (stored / name).read_text() == (full / name).read_text(), name
  _, rows, _ = report.read_results(stored)
  assert [(r["run"], r["seed"]) for r in rows] == [(n, s) for n in ("bf16", "a", "c", "b") for s in (0, 1)]
  b0 = next(r for r in rows if r["run"] == "b" and r["seed"] == 0)
  assert b0["final_val_loss"] == 2.15 and b0["gap_pct"] == pytest.approx(7.5)


def test_merge_keeps_the_other_runs_byte_identical(tmp_path):
  stored = _stored(tmp_path)
  before = (stored / report.RESULTS_JSONL).read_text().splitlines()
  rerun = _write_sweep(tmp_path / "rerun", _meta(["bf16", "b"]), {k: v for k, v in NEW.items() if k[0] != "c"})
  merge.merge_into(stored, rerun, _meta(["bf16", "a", "b"]))
  after = (stored / report.RESULTS_JSONL).read_text().splitlines()
  assert after[:4] == before[:4] and after[4:] != before[4:]  # bf16 and a unchanged, b replaced


def _redefined(meta, run, overrides):
  """`meta` with `run`'s own settings changed (its definition edited in the experiment's module)."""
  return dict(meta, runs=[dict(r, overrides=overrides) if r["name"] == run else r for r in meta["runs"]])


@pytest.mark.parametrize("change, message", [
    (dict(losses={**NEW, ("bf16", 1): 2.1000001}), "does not reproduce the stored one"),
    (dict(meta=_meta(["bf16", "a", "c", "b"], base={"steps": 5})), "other shared settings"),
    (dict(meta=_meta(["bf16", "a", "b"])), r"Runs \['c'\] are not in the sweep's run list"),
    # a kept, not rerun: its stored rows were listed under its new settings
    (dict(meta=_redefined(_meta(["bf16", "a", "c", "b"]), "a", {"recipe": "a2"})),
     r"merge keeps have other settings in this sweep \(a: stored \{'recipe': 'a'\}, now \{'recipe': 'a2'\}"),
    (dict(meta=dict(_meta(["bf16", "a", "c", "b"]), experiment="other")),
     "are of experiment 'toy', this sweep's 'other'"),
])
def test_merge_refuses_what_a_full_run_would_not_give(tmp_path, change, message):
  stored = _stored(tmp_path)
  before = {name: (stored / name).read_text() for name in TABLES}
  rerun = _write_sweep(tmp_path / "rerun", _meta(["bf16", "b", "c"]), change.get("losses", NEW))
  with pytest.raises(ValueError, match=message):
    merge.merge_into(stored, rerun, change.get("meta", _meta(["bf16", "a", "c", "b"])))
  assert before == {name: (stored / name).read_text() for name in TABLES}  # nothing written


def _toy_config(preset):
  runs = [sweep_lib.Run("bf16", {"recipe": "bf16"}), sweep_lib.Run("nvidia", {"recipe": "nvfp4"}),
          sweep_lib.Run("late", {"recipe": "nvfp4", "switch_at": 0.5})]
  return sweep_lib.Sweep(experiment="toy", preset=preset, runs=tuple(runs), base=dict(BASE), seeds=2,
                         command=f"python -m toy --preset {preset} --out runs/toy")


def test_full_sweep_meta_and_a_missing_merge_folder(tmp_path, capsys):
  parser = cli.make_parser("toy", "")
  args = parser.parse_args(["--preset", "cpu", "--out", "x", "--runs", "late", "--set", "lr=0.02",
                            "--merge-into", "y"])
  meta = cli.full_sweep_meta(_toy_config, args)
  assert [r["name"] for r in meta["runs"]] == ["bf16", "nvidia", "late"] and meta["base"]["lr"] == 0.02
  assert meta["command"] == "python -m toy --preset cpu --out runs/toy --set lr=0.02"
  rc = cli.main(_toy_config, ["--preset", "cpu", "--out", str(tmp_path / "o"), "--merge-into", str(tmp_path)],
                prog="toy", doc="")
  assert rc == 2 and "no results.jsonl there to merge into" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()  # refused before any run


def test_a_merge_into_other_shared_settings_is_refused_before_any_run(tmp_path, capsys):
  stored = _stored(tmp_path)  # stored with lr 0.01: the rerun's --set makes it another sweep
  rc = cli.main(_toy_config, ["--preset", "cpu", "--out", str(tmp_path / "o"), "--runs", "late", "--set", "lr=0.02",
                              "--merge-into", str(stored)], prog="toy", doc="")
  assert rc == 2 and "other shared settings" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()  # refused before any run


def test_a_merge_that_keeps_a_redefined_run_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
  """The stored "nvidia" ran {"recipe": "nvidia"}, the sweep now defines it as nvfp4: a rerun of "late" alone merged
  and listed the stored numbers under the new definition."""
  def train(*args, **kwargs):
    raise AssertionError("this command must not train")
  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  stored = _stored(tmp_path, {(r, s): 2.0 + s for r in ("bf16", "nvidia", "late") for s in (0, 1)},
                   runs=("bf16", "nvidia", "late"))
  rc = cli.main(_toy_config, ["--preset", "cpu", "--out", str(tmp_path / "o"), "--runs", "late", "--merge-into",
                              str(stored)], prog="toy", doc="")
  assert rc == 2 and "nvidia: stored {'recipe': 'nvidia'}, now {'recipe': 'nvfp4'}" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()  # refused before any run
  # A stored run the sweep no longer defines was refused only after every rerun run had trained.
  stored = _stored(tmp_path / "gone", {(r, s): 2.0 + s for r in ("bf16", "old", "late") for s in (0, 1)},
                   runs=("bf16", "old", "late"))
  rc = cli.main(_toy_config, ["--preset", "cpu", "--out", str(tmp_path / "o"), "--runs", "late", "--merge-into",
                              str(stored)], prog="toy", doc="")
  assert rc == 2 and "Runs ['old'] of the stored results" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()


def test_the_stored_components_results_keep_their_runs_under_equivalent_definitions():
  """no_hp_layers was stored as {recipe, bf16_last: 0} and is now defined with bf16_first: 0 too (the default): the
  same run, which a merge keeps."""
  meta = components.get_config("cpu").replace(seeds=4).to_dict()
  merge.check_mergeable(REPO / "experiments" / "results" / "components_cpu", meta, rerun=["bf16", "full"])
  with pytest.raises(ValueError, match="full: stored"):
    merge.check_mergeable(REPO / "experiments" / "results" / "components_cpu",
                          _redefined(meta, "full", {"recipe": "nvfp4:rht=false"}), rerun=["bf16"])


def test_a_merged_run_whose_log_disagrees_with_its_summary_is_said(tmp_path):
  stored = _stored(tmp_path)
  rerun = _write_sweep(tmp_path / "rerun", _meta(["bf16", "b", "c"]), NEW)
  log = rerun / "c" / "seed1" / "metrics.jsonl"
  log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))  # cut short after the run
  merge.merge_into(stored, rerun, _meta(["bf16", "a", "c", "b"]))
  assert ("**Log and summary disagree** (the table reads summary.json, the plots metrics.jsonl): c/seed1: its "
          "metrics.jsonl has no validation at step 4") in (stored / report.RESULTS_MD).read_text()
