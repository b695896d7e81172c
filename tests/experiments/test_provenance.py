"""A run's provenance (full recipe, resolved GEMM mode, jax, platform) in its summary and result row, and the checks
that keep runs trained under other numerics out of a merge or a resumed sweep. Synthetic run folders: no training."""

import json

import pytest

import fp4jax.gemm
from experiments import common
from experiments import merge
from experiments import report
from experiments import sweep as sweep_lib
from fp4jax.pretrain import config as config_lib

from test_merge import BASE, TABLES
from test_merge import _meta, _stored, _write_sweep  # pylint: disable=g-importing-member  (the merge tests' folders)

RUNS = ("bf16", "nvfp4", "fp8")  # run names that are recipe names: test_merge._meta sets {"recipe": name}
OLD = {(r, s): 2.0 + 0.1 * i + 0.01 * s for i, r in enumerate(RUNS) for s in (0, 1)}
NEW = {("bf16", 0): OLD["bf16", 0], ("bf16", 1): OLD["bf16", 1], ("fp8", 0): 2.3, ("fp8", 1): 2.31}


def _config(overrides, base=BASE):
  return config_lib.config_from_overrides(sweep_lib.merge_overrides(base, overrides))


def _current(run):
  """What the current code records for `run` of the toy sweep on this machine."""
  return sweep_lib.provenance(_config({"recipe": run}))


def _other_mode(mode):
  return "f32" if mode != "f32" else "bf16"


def _merge(tmp_path, stored_extra, log=None):
  """(stored folder, rerun folder, () -> merge of the rerun of bf16 and fp8 into it): nvfp4 is kept."""
  stored = _stored(tmp_path, OLD, RUNS, stored_extra)
  rerun = _write_sweep(tmp_path / "rerun", _meta(["bf16", "fp8"]), NEW, {r: _current(r) for r in RUNS})
  return stored, rerun, lambda: merge.merge_into(stored, rerun, _meta(list(RUNS)), log=log)


def test_gemm_mode_is_the_one_auto_resolves_to_per_layer_kind(monkeypatch):
  """Rows said gemm_mode "auto": on an AVX-512 CPU the quantized layers multiply in bf16, elsewhere in float32, and
  BF16 layers (bf16_last, the BF16 recipe) in float32 on every CPU."""
  fp4 = _config({"recipe": "nvfp4", "bf16_last": 1, "model.n_layers": 2})
  monkeypatch.setattr(fp4jax.gemm, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
  assert sweep_lib.run_gemm_mode(fp4) == "bf16 (BF16 layers: f32)"
  assert sweep_lib.run_gemm_mode(_config({"recipe": "nvfp4"})) == "bf16"  # no BF16 layer
  assert sweep_lib.run_gemm_mode(_config({"recipe": "nvfp4:gemm_mode=f32", "bf16_last": 1})) == "f32"
  assert sweep_lib.run_gemm_mode(_config({"recipe": "bf16"})) == "f32"
  monkeypatch.setattr(fp4jax.gemm, "cpu_flags", lambda: frozenset({"avx2"}))
  assert sweep_lib.run_gemm_mode(fp4) == "f32"


def test_summary_and_row_record_the_full_recipe_and_resolved_gemm_mode(tmp_path):
  sweep = sweep_lib.Sweep("toy", "smoke", (sweep_lib.Run("nvfp4", {"recipe": "nvfp4"}),), dict(BASE), reference=None)
  run = sweep.runs[0]
  config = sweep.config(run, 0, tmp_path)
  summary = sweep_lib._summarize(sweep, run, 0, config, tmp_path, "finished", 1.0,  # pylint: disable=protected-access
                                 {"final_val_loss": 2.0, "final_loss": 2.1, "data": None})
  assert "sr_bits='hash'" in summary["recipe_spec"] and "rht_size=16" in summary["recipe_spec"]
  assert "name=" not in summary["recipe_spec"].split("fprop=")[0]  # the label is not numerics
  assert summary["gemm_mode"] == fp4jax.gemm.resolve_gemm_mode(config.policy.recipe) != "auto"
  assert summary["jax_version"] and summary["platform"].startswith("cpu")
  row = report._row(summary)  # pylint: disable=protected-access
  assert {k: row[k] for k in common.PROVENANCE_FIELDS} == {k: summary[k] for k in common.PROVENANCE_FIELDS}
  before = {k: v for k, v in summary.items() if k not in common.PROVENANCE_FIELDS}  # a summary stored before
  old = report._row(before)  # pylint: disable=protected-access
  assert not set(common.PROVENANCE_FIELDS) & set(old)  # read as before


@pytest.mark.parametrize("field, stored, message", [
    ("gemm_mode", lambda cur: _other_mode(cur["gemm_mode"]),
     lambda cur: f"nvfp4/seed0: gemm_mode: recorded '{_other_mode(cur['gemm_mode'])}', now '{cur['gemm_mode']}'"),
    ("recipe_spec", lambda cur: cur["recipe_spec"].replace("sr_bits='hash'", "sr_bits='threefry'"),
     lambda cur: "nvfp4/seed0: recipe_spec: recorded `...sr_bits='threefry', gemm_mode='auto'\\)`, now "
                 "`...sr_bits='hash', gemm_mode='auto'\\)`"),
])
def test_merge_refuses_kept_runs_trained_under_other_numerics(tmp_path, field, stored, message):
  """An nvfp4 run stored where "auto" gave another GEMM mode, or before a recipe default changed, was kept beside
  rerun runs without a word."""
  cur = _current("nvfp4")
  extra = {r: _current(r) for r in RUNS}
  extra["nvfp4"] = dict(cur, **{field: stored(cur)})
  stored_dir, _, run = _merge(tmp_path, extra)
  before = {name: (stored_dir / name).read_text() for name in TABLES}
  with pytest.raises(ValueError, match=message(cur)) as e:
    run()
  assert "rerun them too (--runs nvfp4)" in str(e.value)
  assert before == {name: (stored_dir / name).read_text() for name in TABLES}  # nothing written
  with pytest.raises(ValueError, match=message(cur)):  # the cli's check before any run trains
    merge.check_mergeable(stored_dir, _meta(list(RUNS)), rerun=["fp8"])


def test_merge_keeps_runs_with_the_same_numerics_and_says_which_it_could_not_check(tmp_path):
  notes = []
  stored_dir, _, run = _merge(tmp_path / "same", {r: _current(r) for r in RUNS}, log=notes.append)
  run()
  _, rows, _ = report.read_results(stored_dir)
  assert not notes and all(r["gemm_mode"] == _current(r["run"])["gemm_mode"] for r in rows)
  assert "Not recorded" not in (stored_dir / report.RESULTS_MD).read_text()
  # Rows stored before the fields existed: merged, with a note in the output and in results.md.
  stored_dir, _, run = _merge(tmp_path / "old", None, log=notes.append)
  run()
  assert len(notes) == 1 and "nvfp4/seed0, nvfp4/seed1" in notes[0] and "could not be checked" in notes[0]
  text = (stored_dir / report.RESULTS_MD).read_text()
  assert "**Not recorded** (full recipe and GEMM mode; stored before they were, not checked against the current " \
         "code): bf16/seed0, bf16/seed1, nvfp4/seed0, nvfp4/seed1." in text  # the reference's rows stay the stored
  assert f"GEMM mode: {_current('fp8')['gemm_mode']} (fp8). Trained with jax " in text


def _finished_sweep(tmp_path, **changes):
  """A sweep folder whose one run finished (summary.json as the sweep writes it, with `changes`)."""
  sweep = sweep_lib.Sweep("toy", "smoke", (sweep_lib.Run("nvfp4", {"recipe": "nvfp4"}),), dict(BASE), reference=None)
  folder = sweep_lib.run_dir(tmp_path, "nvfp4", 0)
  folder.mkdir(parents=True)
  config = sweep.config(sweep.runs[0], 0, folder)
  summary = {"experiment": "toy", "preset": "smoke", "run": "nvfp4", "seed": 0, "status": "finished",
             "config": common.jsonable(config.to_dict()), "data": None, **sweep_lib.provenance(config)}
  summary.update(changes)
  (folder / common.SUMMARY_FILE).write_text(json.dumps({k: v for k, v in summary.items() if v is not None}))
  return sweep


def test_a_sweep_refuses_to_reuse_a_finished_run_trained_under_other_numerics(tmp_path, monkeypatch):
  def train(*args, **kwargs):
    raise AssertionError("this sweep must not train")
  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  cur = _current("nvfp4")
  sweep = _finished_sweep(tmp_path / "other", gemm_mode=_other_mode(cur["gemm_mode"]))
  with pytest.raises(ValueError, match=f"gemm_mode: recorded '{_other_mode(cur['gemm_mode'])}', now "
                                       f"'{cur['gemm_mode']}'.*delete that folder to rerun it"):
    sweep_lib.run_sweep(sweep, tmp_path / "other", progress=False, log=None)
  notes = []
  sweep = _finished_sweep(tmp_path / "same")
  assert sweep_lib.run_sweep(sweep, tmp_path / "same", progress=False, log=notes.append)[0]["status"] == "skipped"
  assert not notes
  sweep = _finished_sweep(tmp_path / "old", recipe_spec=None, gemm_mode=None)  # finished before they were recorded
  assert sweep_lib.run_sweep(sweep, tmp_path / "old", progress=False, log=notes.append)[0]["status"] == "skipped"
  assert len(notes) == 1 and "could not be checked" in notes[0]
