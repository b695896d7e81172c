"""Tests for experiments/: every entry point's smoke preset end to end, resuming an interrupted sweep, the report,
and clear errors for unknown presets and override keys. Runs share one CompileCache, so each graph compiles once.
The formats smoke sweep is the README's main job: trained once per session (tests/conftest.py), checked here and
run from the README's command in tests/test_readme.py. The slow tests are one xdist unit (one compile cache)."""

import importlib
import json
import math
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from readme_blocks import MAIN_JOB_GROUP
from experiments import report
from experiments import sweep as sweep_lib
from fp4jax.pretrain import trainer

EXPERIMENTS = ("formats", "rht_size", "high_precision_layers", "components", "precision_switch", "recipes")
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def cache(compile_cache):
  return compile_cache


def _module(name):
  return importlib.import_module(f"experiments.{name}")


# --- presets and configs (no training) ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", EXPERIMENTS)
@pytest.mark.parametrize("preset", sweep_lib.PRESETS)
def test_every_preset_builds_valid_configs(name, preset, tmp_path):
  sweep = _module(name).get_config(preset)
  assert sweep.preset == preset and sweep.reference == "bf16"
  assert f"--preset {preset}" in sweep.command and f"experiments.{name}" in sweep.command
  assert f"python -m experiments.{name} --preset {preset}" in _module(name).__doc__
  configs = [sweep.config(run, seed, tmp_path / run.name) for run in sweep.runs for seed in range(sweep.seeds)]
  # Runs differ from each other in what they compute (no two identical settings under different names).
  distinct = {json.dumps({k: v for k, v in c.to_dict().items() if k != "out"}, sort_keys=True) for c in configs}
  assert len(distinct) == len(configs)
  if preset == "gpu":
    assert configs[0].model.n_layers == 20 and configs[0].model.d_model == 2048
    assert all(c.model.remat and c.model.scan_layers for c in configs)  # one compiled block body per run of blocks
  if preset == "smoke":
    assert sweep.seeds == 1 and len(sweep.runs) <= 3 and configs[0].steps <= 20


def test_ablation_settings_reach_the_recipe(tmp_path):
  sweep = _module("components").get_config("cpu")
  recipes = {r.name: sweep.config(r, 0, tmp_path).policy for r in sweep.runs}
  full = recipes["full"].recipe
  assert full.wgrad.rht and full.dgrad.lhs.rounding == "stochastic" and full.fprop.rhs.block_2d
  assert not recipes["no_rht"].recipe.wgrad.rht
  assert recipes["no_sr"].recipe.dgrad.lhs.rounding == "nearest"
  assert not recipes["no_2d"].recipe.fprop.rhs.block_2d
  assert recipes["full"].bf16_blocks(4) == (3,) and recipes["no_hp_layers"].bf16_blocks(4) == ()
  assert not recipes["bf16"].recipe.is_quantized
  rht = _module("rht_size").get_config("cpu")
  got = {r.name: rht.config(r, 0, tmp_path).policy.recipe for r in rht.runs}
  assert {got[f"rht{d}"].rht_size for d in (2, 4, 16, 64, 128)} == {2, 4, 16, 64, 128}
  assert got["rht16"].rht_signs == "fixed" and got["rht16_nosigns"].rht_signs == "none"
  assert got["rht16_per_call"].rht_signs == "per_call" and not got["rht_none"].wgrad.rht
  switch = _module("precision_switch").get_config("cpu")
  fwd = switch.config(next(r for r in switch.runs if r.name == "fwd_at80"), 0, tmp_path).policy
  assert fwd.switch == "forward" and fwd.switch_step(300) == 240


# --- overrides and errors ------------------------------------------------------------------------------------------

def test_parse_overrides_types():
  got = sweep_lib.parse_overrides(["steps=100", "model.d_model=128", "recipe=nvfp4:rht_size=4,random_signs=false",
                                   "switch_at=0.5", "bf16_blocks=1,3-4", "progress=false", "data.tokenizer=bpe"])
  assert got == {"steps": 100, "model.d_model": 128, "recipe": "nvfp4:rht_size=4,random_signs=false",
                 "switch_at": 0.5, "bf16_blocks": (1, 3, 4), "progress": False, "data.tokenizer": "bpe"}


@pytest.mark.parametrize("item, message", [
    ("stepz=3", "Unknown override key 'stepz' (did you mean 'steps'?); valid keys: model, recipe, bf16_first"),
    ("model.d_modle=3", "Unknown override key 'model.d_modle' (did you mean 'model.d_model'?); valid"),
    ("model.widht=3", "Unknown override key 'model.widht'; valid"),
    ("seed=3", "set by the sweep itself"),
    ("steps", "not of the form KEY=VALUE"),
    ("steps=many", "Bad value for override 'steps'"),
])
def test_bad_overrides_raise_clear_errors(item, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    sweep_lib.parse_overrides([item])


def test_unknown_preset_raises():
  with pytest.raises(ValueError, match="Unknown preset 'huge'; valid presets: smoke, cpu, gpu"):
    _module("formats").get_config("huge")


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "huge"], "valid presets: smoke, cpu, gpu"),
    (["--preset", "smoke", "--set", "stepz=3"], "valid keys: model, recipe"),
    (["--preset", "smoke", "--runs", "nope"], "runs: bf16, nvfp4, mxfp4"),
])
def test_cli_errors_name_the_valid_choices(argv, expected, tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    _module("formats").main(["--out", str(tmp_path), *argv])
  assert exit_info.value.code == 2
  assert expected in capsys.readouterr().err
  assert not (tmp_path / "sweep.json").exists()


def test_module_entry_point_runs():
  proc = subprocess.run([sys.executable, "-m", "experiments.formats", "--help"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "--preset" in proc.stdout and "--set KEY=VALUE" in proc.stdout


def test_cli_list_shows_runs_and_overrides(capsys, tmp_path):
  assert _module("components").main(["--preset", "cpu", "--out", str(tmp_path), "--list", "--set", "steps=40",
                                     "--set", "bf16_last=2"]) == 0
  out = capsys.readouterr().out
  for name in ("bf16", "full", "no_rht", "no_sr", "no_2d", "no_hp_layers"):
    assert name in out
  assert "'steps': 40" in out and "'bf16_last': 2" in out
  assert "keeps its own bf16_last" in out  # the no_hp_layers run keeps bf16_last=0
  assert not (tmp_path / "sweep.json").exists()


def test_new_model_preset_drops_old_model_fields():
  sweep = _module("formats").get_config("smoke").with_overrides({"model": "small"})
  assert "model.n_layers" not in sweep.base and sweep.base["model"] == "small"


# --- smoke sweeps ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.xdist_group(MAIN_JOB_GROUP)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_smoke_sweep_end_to_end(name, tmp_path, cache, request):
  sweep = _module(name).get_config("smoke")
  if name == "formats":  # trained once per session: the README's main job runs its command on this output
    folder, records = request.getfixturevalue("formats_smoke_sweep")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
  else:
    records = sweep_lib.run_sweep(sweep, tmp_path, compile_cache=cache, progress=False, log=None)
  assert [(r["run"], r["status"]) for r in records] == [(run.name, "finished") for run in sweep.runs]
  for r in records:
    s = r["summary"]
    assert math.isfinite(s["final_val_loss"]) and s["final_val_loss"] < math.log(256)  # learnt something
    assert s["tokens_per_s"] > 0 and s["steps"] == sweep.base["steps"]
    assert (tmp_path / r["run"] / "seed0" / sweep_lib.SUMMARY_FILE).is_file()
  written = report.write_report(tmp_path)
  names = {p.name for p in written}
  assert {report.RESULTS_MD, report.RESULTS_CSV, report.RESULTS_JSONL, report.LOSS_PNG, report.GAP_PNG} <= names
  for png in (report.LOSS_PNG, report.GAP_PNG):
    assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
  table = (tmp_path / report.RESULTS_MD).read_text()
  rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| run")]
  assert [row.split("|")[1].strip() for row in rows] == [run.name for run in sweep.runs]
  assert "| reference |" in rows[0]
  # The table's gap is the relative difference of the final validation losses.
  val = {r["run"]: r["summary"]["final_val_loss"] for r in records}
  other = sweep.runs[1].name
  gap = 100 * (val[other] - val["bf16"]) / val["bf16"]
  assert f"{gap:+.2f}" in rows[1]
  # The report reads back the files it wrote (what the notebook and committed results use).
  meta, rows_back, curves = report.read_results(tmp_path)
  assert meta["experiment"] == sweep.experiment and len(rows_back) == len(sweep.runs)
  assert set(curves) == {(run.name, 0) for run in sweep.runs}
  assert len(curves["bf16", 0]["loss"]) == sweep.base["steps"]


@pytest.mark.slow
@pytest.mark.xdist_group(MAIN_JOB_GROUP)
def test_interrupted_sweep_resumes_and_skips_finished_runs(tmp_path, cache):
  base = sweep_lib.base_overrides("smoke")
  # Two identical runs under different names: the resumed one must reproduce the uninterrupted one exactly.
  sweep = sweep_lib.Sweep(experiment="resume", preset="smoke", base=base, reference="a",
                          runs=(sweep_lib.Run("a", {"recipe": "bf16"}), sweep_lib.Run("b", {"recipe": "bf16"})))
  stop_at = base["checkpoint_every"] + 2  # after the first checkpoint

  def interrupt(step, record):
    del record
    if step == stop_at:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    sweep_lib.run_sweep(sweep, tmp_path, compile_cache=cache, progress=False, log=None,
                        hooks_for=lambda run, seed: [interrupt] if run == "b" else [])
  summary_a = tmp_path / "a" / "seed0" / sweep_lib.SUMMARY_FILE
  assert summary_a.is_file() and not (tmp_path / "b" / "seed0" / sweep_lib.SUMMARY_FILE).exists()
  stamp = summary_a.stat().st_mtime_ns
  # Resuming the interrupted run under changed settings is refused before anything runs; its checkpoint stays.
  changed = sweep.with_overrides({"lr": 1e-3}).replace(runs=sweep.runs[1:], reference="b")
  with pytest.raises(ValueError, match=rf"unfinished run \(checkpoint {base['checkpoint_every']}\) with different "
                                       r"settings \(lr\)"):
    sweep_lib.run_sweep(changed, tmp_path, progress=False, log=None)

  records = sweep_lib.run_sweep(sweep, tmp_path, compile_cache=cache, progress=False, log=None)
  assert [(r["run"], r["status"]) for r in records] == [("a", "skipped"), ("b", "finished")]
  assert summary_a.stat().st_mtime_ns == stamp
  assert f"Resumed from step {base['checkpoint_every']}" in (tmp_path / "b" / "seed0" / sweep_lib.LOG_FILE).read_text()
  steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "seed0" / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(base["steps"] + 1))  # each step once, then the final evaluation
  assert records[1]["summary"]["final_val_loss"] == records[0]["summary"]["final_val_loss"]

  # A third call runs nothing; changed settings on a finished folder are refused before anything runs.
  assert [r["status"] for r in sweep_lib.run_sweep(sweep, tmp_path, progress=False, log=None)] == ["skipped"] * 2
  with pytest.raises(ValueError, match=r"finished run with different settings \(lr\)"):
    sweep_lib.run_sweep(sweep.with_overrides({"lr": 1e-3}), tmp_path, progress=False, log=None)


@pytest.mark.slow
@pytest.mark.xdist_group(MAIN_JOB_GROUP)
def test_cli_on_finished_sweep_rewrites_report(tmp_path, capsys, request):
  folder, _ = request.getfixturevalue("formats_smoke_sweep")
  shutil.copytree(folder / "bf16", tmp_path / "bf16")  # a finished run of the formats smoke sweep
  assert _module("formats").main(["--preset", "smoke", "--out", str(tmp_path), "--runs", "bf16", "--quiet"]) == 0
  assert (tmp_path / report.RESULTS_MD).is_file() and (tmp_path / report.LOSS_PNG).is_file()
  assert report.main([str(tmp_path), "--smooth", "3"]) == 0
  assert "| bf16 | BF16 |" in capsys.readouterr().out
  assert report.main([str(tmp_path / "missing")]) == 2


def test_diverged_run_is_recorded_reported_and_not_rerun(tmp_path, monkeypatch):
  calls = []

  def diverging_train(config, hooks=(), *, log=None, compile_cache=None):
    del hooks, log, compile_cache
    calls.append(config.recipe.name)
    (tmp_path / "q" / "seed0" / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": NaN}\n')
    raise trainer.TrainingDiverged(1, float("nan"), float("nan"), None)

  sweep = sweep_lib.Sweep(experiment="div", preset="smoke", base=sweep_lib.base_overrides("smoke"), reference=None,
                          runs=(sweep_lib.Run("q", {"recipe": "nvfp4", "lr": 10.0}),))
  monkeypatch.setattr(sweep_lib.trainer, "train", diverging_train)
  (record,) = sweep_lib.run_sweep(sweep, tmp_path, progress=False, log=None)
  assert record["status"] == "diverged" and record["summary"]["diverged_step"] == 1
  assert record["summary"]["final_val_loss"] is None and "diverged at step 1" in record["summary"]["error"]
  assert [r["status"] for r in sweep_lib.run_sweep(sweep, tmp_path, progress=False, log=None)] == ["skipped"]
  assert calls == ["nvfp4"]
  report.write_report(tmp_path)
  table = (tmp_path / report.RESULTS_MD).read_text()
  assert "| q | recipe=nvfp4, lr=10.0 | none | 0 (+1 diverged at step 1) | - | - |" in table


def _sweep_on_own_corpus(tmp_path, *runs):
  """(text, corpus file, smoke Sweep of `runs` (name, recipe) on that corpus), the first run the reference."""
  text = "To be, or not to be, that is the question. " * 60
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(text)
  base = dict(sweep_lib.base_overrides("smoke"), **{"data.corpus": str(corpus), "data.cache_dir": str(tmp_path / "c")})
  sweep = sweep_lib.Sweep(experiment="data", preset="smoke", base=base, reference=runs[0][0],
                          runs=tuple(sweep_lib.Run(name, {"recipe": recipe}) for name, recipe in runs))
  return text, corpus, sweep


def test_an_unfinished_run_on_changed_data_is_refused_before_anything_runs(tmp_path, monkeypatch):
  # Resuming a sweep's run on an edited corpus was refused by the resume itself, mid-sweep, with advice to pass
  # --data-changed, which no sweep command takes (--set data_changed=true is refused: it needs a resume). Now the
  # sweep refuses before anything runs, naming the run folder and what its command can do.
  from fp4jax.pretrain import checkpoint as ckpt  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  text, corpus, sweep = _sweep_on_own_corpus(tmp_path, ("a", "bf16"))
  folder = sweep_lib.run_dir(tmp_path / "out", "a", 0)
  config = sweep.config(sweep.runs[0], 0, folder)
  recorded = data.load_dataset(config.data).identity
  manager = ckpt.open_manager(folder)  # what an interrupted run leaves: a checkpoint, no summary.json
  ckpt.save(manager, 6, {"w": np.zeros(3, np.float32)}, {"config": config.to_dict(), "data": recorded.to_dict()},
            force=True)
  manager.wait_until_finished()
  manager.close()
  resumed = []

  def train(config, hooks=(), *, log=None, compile_cache=None):
    del hooks, log, compile_cache
    resumed.append(config.checkpointing.resume)
    return {"final_val_loss": 1.0, "final_loss": 1.0}

  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  corpus.write_text(text.replace("question", "answer!!"))
  with pytest.raises(ValueError) as info:
    sweep_lib.run_sweep(sweep, tmp_path / "out", progress=False, log=None)
  assert str(info.value) == (
      f"{folder} holds an unfinished run (checkpoint 6) trained on other data than this sweep's: the corpus "
      f"'{recorded.corpus}' holds other text: 1 files, {len(text)} bytes, fingerprint "
      f"{data.load_dataset(config.data).identity.fingerprint} (it was 1 files, {len(text)} bytes, fingerprint "
      f"{recorded.fingerprint}). Restore the corpus at '{recorded.corpus}' and repeat the command to finish it; or "
      f"delete {folder} to rerun it from the start on this data (this sweep's finished runs may have trained on the "
      "old data: use another --out for a sweep on the new data).")
  assert resumed == [] and not (folder / sweep_lib.SUMMARY_FILE).exists()
  corpus.write_text(text)  # restored, as the message says: the run resumes
  (record,) = sweep_lib.run_sweep(sweep, tmp_path / "out", progress=False, log=None)
  assert record["status"] == "finished" and resumed == [True]


def test_a_finished_run_on_changed_data_is_refused_before_anything_runs(tmp_path, monkeypatch):
  # A sweep rerun on an edited corpus skipped its finished runs and trained the rest on the new text: one report
  # then compared runs trained on two corpora. Finished runs now record their data in summary.json.
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  text, corpus, sweep = _sweep_on_own_corpus(tmp_path, ("a", "bf16"), ("b", "nvfp4"))
  trained = []

  def train(config, hooks=(), *, log=None, compile_cache=None):
    del hooks, log, compile_cache
    trained.append(config.out)
    return {"final_val_loss": 1.0, "final_loss": 1.0, "data": data.load_dataset(config.data).identity.to_dict()}

  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  (record,) = sweep_lib.run_sweep(sweep.select(["a"]), tmp_path / "out", progress=False, log=None)
  folder = sweep_lib.run_dir(tmp_path / "out", "a", 0)
  recorded = data.DataIdentity.from_dict(sweep_lib.read_summary(folder)["data"])
  assert record["status"] == "finished" and recorded.fingerprint
  corpus.write_text(text.replace("question", "answer!!"))
  with pytest.raises(ValueError) as info:
    sweep_lib.run_sweep(sweep, tmp_path / "out", progress=False, log=None)
  edited = data.load_dataset(sweep.config(sweep.runs[0], 0, folder).data).identity
  assert str(info.value) == (
      f"{folder} holds a finished run trained on other data than this sweep's: the corpus '{recorded.corpus}' holds "
      f"other text: 1 files, {len(text)} bytes, fingerprint {edited.fingerprint} (it was 1 files, {len(text)} bytes, fingerprint {recorded.fingerprint}). Its results would not compare with "
      f"runs on this data: restore the corpus at '{recorded.corpus}' and repeat the command, or use another --out "
      "for a sweep on the new data.")
  assert len(trained) == 1
  corpus.write_text(text)  # restored: the finished run is skipped, the other one trains
  records = sweep_lib.run_sweep(sweep, tmp_path / "out", progress=False, log=None)
  assert [r["status"] for r in records] == ["skipped", "finished"] and len(trained) == 2


# --- report arithmetic ---------------------------------------------------------------------------------------------

def test_gaps_are_paired_by_seed_and_aggregated():
  rows = [{"run": "bf16", "seed": 0, "status": "finished", "final_val_loss": 2.0},
          {"run": "bf16", "seed": 1, "status": "finished", "final_val_loss": 3.0},
          {"run": "q", "seed": 0, "status": "finished", "final_val_loss": 2.2},
          {"run": "q", "seed": 1, "status": "finished", "final_val_loss": 3.0},
          {"run": "d", "seed": 0, "status": "diverged", "final_val_loss": None, "diverged_step": 7}]
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  assert rows[2]["gap_pct"] == pytest.approx(10.0) and rows[3]["gap_pct"] == pytest.approx(0.0)
  assert rows[4]["gap_pct"] is None
  agg = {a["run"]: a for a in report.aggregate(rows)}
  assert agg["q"]["gap_pct_mean"] == pytest.approx(5.0)
  assert agg["q"]["gap_pct_std"] == pytest.approx(np.std([10.0, 0.0], ddof=1))
  assert agg["q"]["val_loss_mean"] == pytest.approx(2.6) and agg["d"]["diverged"] == [7] and agg["d"]["seeds"] == 0
  assert agg["q"]["gap_seeds"] == 2


def test_a_gap_over_fewer_seeds_than_the_run_has_says_so():
  """Where the reference diverged on a seed, a run's gap averages fewer seeds than its val loss: the table says so."""
  rows = [{"run": "bf16", "seed": 0, "status": "finished", "final_val_loss": 2.0},
          {"run": "bf16", "seed": 1, "status": "diverged", "final_val_loss": None, "diverged_step": 3},
          {"run": "q", "seed": 0, "status": "finished", "final_val_loss": 2.2},
          {"run": "q", "seed": 1, "status": "finished", "final_val_loss": 3.0}]
  for r in rows:
    r.update(steps=5, tokens=640, experiment="x", preset="smoke", label=r["run"], overrides={})
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  agg = {a["run"]: a for a in report.aggregate(rows)}
  assert agg["q"]["gap_seeds"] == 1 and agg["q"]["seeds"] == 2 and agg["q"]["gap_pct_mean"] == pytest.approx(10.0)
  text = report.markdown_table({"reference": "bf16"}, rows)
  assert "| +10.00 (1 of 2 seeds) |" in text and "No gaps" not in text
  # The reference with no finished seed at all: every gap is "-", and the table says why.
  rows = [r for r in rows if r["run"] != "bf16" or r["status"] == "diverged"]
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  assert "No gaps: the reference run 'bf16' has no finished seed here." in report.markdown_table(
      {"reference": "bf16"}, rows)


def test_runs_of_another_length_preset_or_experiment_get_no_gap_and_are_named():
  """Runs copied into one folder by hand: a 6-step reference made the 12-step runs' gaps -3 % (true: -0.2 %) under a
  header taken from whichever row came first, with nothing flagged."""
  rows = [{"run": "bf16", "seed": 0, "status": "finished", "final_val_loss": 3.3, "steps": 6, "tokens": 768},
          {"run": "q", "seed": 0, "status": "finished", "final_val_loss": 3.2, "steps": 12, "tokens": 1536},
          {"run": "m", "seed": 0, "status": "finished", "final_val_loss": 3.1, "steps": 6, "tokens": 768,
           "experiment": "formats"}]
  for r in rows:
    r.setdefault("experiment", "x")
    r.update(preset="smoke", label=r["run"], overrides={})
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  assert [r["gap_pct"] for r in rows] == [0.0, None, None]
  text = report.markdown_table({"reference": "bf16"}, rows)
  assert "6 steps, 768 tokens per run" in text  # the reference's setting
  assert ("**Not comparable** (no gap): q/seed0: steps 12, tokens 1536; m/seed0: experiment formats (the "
          "reference's: experiment x, preset smoke, steps 6, tokens 768).") in text


def test_the_header_describes_the_reference_even_when_another_run_comes_first():
  """The header's steps and tokens, and the runs named not comparable, are measured from the reference run's
  setting, not from whichever row comes first (here a 12-step run listed before the 6-step reference)."""
  rows = [{"run": "q", "seed": 0, "status": "finished", "final_val_loss": 3.2, "steps": 12, "tokens": 1536},
          {"run": "bf16", "seed": 0, "status": "finished", "final_val_loss": 3.3, "steps": 6, "tokens": 768}]
  for r in rows:
    r.update(experiment="x", preset="smoke", label=r["run"], overrides={})
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  text = report.markdown_table({"reference": "bf16"}, rows)
  assert "6 steps, 768 tokens per run" in text
  assert ("**Not comparable** (no gap): q/seed0: steps 12, tokens 1536 (the reference's: experiment x, preset "
          "smoke, steps 6, tokens 768).") in text


def test_a_finished_run_with_a_nan_val_loss_is_counted_apart():
  """A NaN val loss (the trainer stops on a non-finite train loss only) averaged into the row, blanking it."""
  rows = [{"run": "bf16", "seed": s, "status": "finished", "final_val_loss": 3.0, "tokens_per_s": 100.0}
          for s in (0, 1)] + [
          {"run": "q", "seed": 0, "status": "finished", "final_val_loss": 3.3, "tokens_per_s": 90.0},
          {"run": "q", "seed": 1, "status": "finished", "final_val_loss": float("nan"), "tokens_per_s": 10.0}]
  for r in rows:
    r.update(steps=5, tokens=640, experiment="x", preset="smoke", label=r["run"], overrides={})
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  q = {a["run"]: a for a in report.aggregate(rows)}["q"]
  assert q["seeds"] == 1 and q["nonfinite_val"] == 1 and q["val_loss_mean"] == pytest.approx(3.3)
  assert q["gap_pct_mean"] == pytest.approx(10.0) and q["tokens_per_s"] == pytest.approx(90.0)
  assert "| 1 (+1 non-finite val loss) | 3.3000 | +10.00 |" in report.markdown_table({"reference": "bf16"}, rows)


def test_runs_without_validation_are_seeds_with_throughput_and_no_val_loss():
  """A sweep with eval_batches=0 (supported: its runs are done) was reported as "0 (+1 non-finite val loss)", with
  no tokens/s and "No gaps: the reference run 'bf16' has no finished seed here"."""
  rows = [{"run": run, "seed": 0, "status": "finished", "final_val_loss": None, "tokens_per_s": tps}
          for run, tps in (("bf16", 300.0), ("q", 200.0))]
  for r in rows:
    r.update(steps=5, tokens=640, experiment="x", preset="smoke", label=r["run"], overrides={})
  report._add_gaps(rows, "bf16")  # pylint: disable=protected-access
  q = {a["run"]: a for a in report.aggregate(rows)}["q"]
  assert q["seeds"] == 1 and q["unvalidated"] == 1 and q["nonfinite_val"] == 0 and q["val_loss_mean"] is None
  assert q["tokens_per_s"] == pytest.approx(200.0) and q["gap_pct_mean"] is None
  text = report.markdown_table({"reference": "bf16"}, rows)
  assert "| 1 (1 without validation) | - | - | 200 |" in text
  assert "No gaps: the reference run 'bf16' took no val loss (eval_batches=0)." in text


def test_report_on_a_missing_folder_says_it_does_not_exist(tmp_path, capsys):
  assert report.main([str(tmp_path / "nope")]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_smooth_is_a_trailing_moving_average():
  x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
  np.testing.assert_allclose(report.smooth(x, 2), [1.0, 1.5, 2.5, 3.5, 4.5])
  np.testing.assert_allclose(report.smooth(x, 1), x)


def test_report_on_a_probes_folder_points_to_its_own_report(tmp_path, capsys):
  """The hint named both probe commands, and each --report-only on the other kind's results ended in a KeyError."""
  from experiments.probes import recipe_gemms, run  # pylint: disable=g-import-not-at-top
  layers, recipes = tmp_path / "layers", tmp_path / "recipes"
  for folder, results in ((layers, {"layers": {}}), (recipes, {"runs": {}})):
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
  assert report.main([str(layers)]) == 2
  assert f"layers probe results (results.json), not a sweep's runs: redraw its report with `python -m " \
         f"experiments.probes --report-only --out {layers}`." in capsys.readouterr().err
  assert report.main([str(recipes)]) == 2
  assert f"`python -m experiments.probes recipes --report-only --out {recipes}`" in capsys.readouterr().err
  assert run.main(["--report-only", "--out", str(recipes)]) == 2
  assert ("holds the recipes probes' results, not the layers probes': redraw it with `python -m experiments.probes "
          f"recipes --report-only --out {recipes}`") in capsys.readouterr().err
  assert recipe_gemms.main(["--report-only", "--out", str(layers)]) == 2
  assert f"redraw it with `python -m experiments.probes --report-only --out {layers}`" in capsys.readouterr().err
  assert run.main(["--report-only", "--out", str(tmp_path)]) == 2
  assert "No results.json in" in capsys.readouterr().err


def test_shared_settings_leave_out_what_runs_set_themselves():
  """A base key every run overrides was used by none (`--set recipe=nvfp9` on a sweep over recipes); one some runs
  override holds only for the others; results.md must not list either as shared."""
  meta = {"base": {"steps": 5, "recipe": "nvfp9", "bf16_last": 1},
          "runs": [{"name": "a", "overrides": {"recipe": "bf16", "bf16_last": 0}},
                   {"name": "b", "overrides": {"recipe": "nvfp4"}}]}
  rows = [{"run": r, "seed": 0, "status": "finished", "final_val_loss": 2.0, "steps": 5, "tokens": 640,
           "experiment": "x", "preset": "smoke", "label": r, "overrides": {}} for r in ("a", "b")]
  text = report.markdown_table(meta, rows)
  assert 'Shared settings: `{"steps": 5}`.' in text
  assert 'For runs that do not set their own: `{"bf16_last": 1}`.' in text
  assert "nvfp9" not in text


@pytest.mark.parametrize("name", ["formats_cpu", "components_cpu", "recipes_cpu"])
def test_committed_results_tables_are_what_the_report_writes(name):
  folder = REPO / "experiments" / "results" / name
  meta, rows, _ = report.read_results(folder)
  assert report.markdown_table(meta, rows) == (folder / report.RESULTS_MD).read_text(encoding="utf-8")


def test_recipes_experiment_reaches_each_recipe(tmp_path):
  sweep = _module("recipes").get_config("cpu")
  assert sweep.seeds >= 5
  recipes = {r.name: sweep.config(r, 0, tmp_path).policy.recipe for r in sweep.runs}
  assert recipes["nvidia"].fprop.lhs.fmt.scale_rule == "nearest"
  assert recipes["nvidia-4over6"].fprop.lhs.fmt.scale_rule == "4over6"
  assert recipes["nvidia-unbiased-sr"].dgrad.lhs.fmt.scale_rule == "up"
  assert recipes["nvidia-unbiased-sr"].fprop.lhs.fmt.scale_rule == "nearest"
  assert recipes["tetrajet-v2"].fprop.lhs.fmt.double_block
  assert recipes["quartet2"].rht_size == 32 and recipes["quartet2-4over6"].fprop.lhs.fmt.scale_rule == "4over6"
  outcontrol = sweep.config(next(r for r in sweep.runs if r.name == "tetrajet-v2-outcontrol"), 0, tmp_path)
  assert outcontrol.policy.recipe == recipes["tetrajet-v2"] and outcontrol.outcontrol.fraction == 0.05
  assert 0 < outcontrol.outcontrol.start and outcontrol.outcontrol.select_step < outcontrol.steps // 4
  gpu_runs = {r.name: r.overrides for r in _module("recipes").get_config("gpu").runs}
  assert gpu_runs["tetrajet-v2-outcontrol"]["outcontrol_start"] + gpu_runs["tetrajet-v2-outcontrol"][
      "outcontrol_window"] < _module("recipes").get_config("gpu").base["steps"] // 4
  assert gpu_runs["quartet2"]["recipe"] == "quartet2:rht_size=128"
  assert recipes["quartet"].fprop.lhs.fmt.scale_rule == "quest" and recipes["quartet"].fprop.lhs.clip_mask
  assert "quartet" in [r.name for r in _module("recipes").get_config("gpu").runs]
  assert "quartet" not in [r.name for r in _module("recipes").get_config("smoke").runs]


def test_report_redraws_a_copied_results_folder(tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "formats_cpu"
  shutil.copytree(REPO / "experiments" / "results" / "formats_cpu", folder)
  (folder / report.LOSS_PNG).unlink(missing_ok=True)
  before = (folder / report.RESULTS_MD).read_text(encoding="utf-8")
  written = report.write_report(folder)
  assert (folder / report.RESULTS_MD).read_text(encoding="utf-8") == before
  assert folder / report.LOSS_PNG in written and (folder / report.LOSS_PNG).read_bytes()[:8] == PNG_MAGIC


def test_report_leaves_out_seeds_beyond_the_sweeps_and_says_so(tmp_path):
  """A rerun with fewer --seeds into the same --out left the earlier command's extra seed folders there; the report
  counted them as this sweep's runs."""
  (tmp_path / "sweep.json").write_text(json.dumps(
      {"experiment": "x", "seeds": 2, "reference": "a", "runs": [{"name": "a"}, {"name": "b"}]}))
  for run, losses in (("a", [2.0, 2.2, 9.0]), ("b", [2.1, 2.3, 9.0])):
    for seed, loss in enumerate(losses):
      folder = tmp_path / run / f"seed{seed}"
      folder.mkdir(parents=True)
      (folder / "summary.json").write_text(json.dumps(
          {"run": run, "seed": seed, "status": "finished", "final_val_loss": loss, "steps": 4, "tokens": 64,
           "experiment": "x", "preset": "smoke", "label": run, "overrides": {}}))
      (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": loss, "val_loss": loss}) + "\n")
  meta, rows, curves = report.collect(tmp_path)
  assert [(r["run"], r["seed"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
  assert set(curves) == {("a", 0), ("a", 1), ("b", 0), ("b", 1)}
  assert meta["left_out"] == ["a/seed2", "b/seed2"]
  text = report.markdown_table(meta, rows)
  assert "up to 2 seed(s) per run" in text and "Left out: a/seed2, b/seed2 (seeds beyond this sweep's 2" in text
  assert "| 2 | 2.1000 ± 0.1414 |" in text  # a: the mean over seeds 0 and 1 only
