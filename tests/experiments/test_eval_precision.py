"""`python -m experiments.eval_precision`: a sweep's runs evaluated in other precisions."""

import json
import shutil

import pytest

from experiments import eval_precision
from fp4jax.pretrain.config import TrainConfig
from readme_blocks import MAIN_JOB_GROUP


@pytest.mark.slow
@pytest.mark.xdist_group(MAIN_JOB_GROUP)
def test_formats_smoke_sweep_evaluated_in_bf16(tmp_path, capsys, request):
  folder, records = request.getfixturevalue("formats_smoke_sweep")
  shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
  assert eval_precision.main([str(tmp_path), "--recipes", "bf16", "--quiet"]) == 0
  rows = [json.loads(line) for line in (tmp_path / eval_precision.JSONL).read_text().splitlines()]
  assert [(r["run"], r["recipe"]) for r in rows] == [(run, recipe) for run in ("bf16", "nvfp4", "mxfp4")
                                                     for recipe in ("own", "bf16")]
  loss = {(r["run"], r["recipe"]): r["val_loss"] for r in rows}
  for record in records:  # the own column is the run's final validation
    assert loss[record["run"], "own"] == pytest.approx(record["summary"]["final_val_loss"], rel=1e-6)
  assert loss["bf16", "bf16"] == loss["bf16", "own"]  # the BF16 run's own recipe: the same graph, the same bits
  assert loss["nvfp4", "bf16"] != loss["nvfp4", "own"] and loss["mxfp4", "bf16"] != loss["mxfp4", "own"]
  assert {r["recipe_spec"] for r in rows if r["run"] == "nvfp4"} == {"nvfp4", "bf16"}
  text = (tmp_path / eval_precision.MARKDOWN).read_text()
  assert "| nvfp4 (nvfp4) | 1 |" in text and f"{loss['nvfp4', 'bf16'] - loss['nvfp4', 'own']:+.4f}" in text
  assert text in capsys.readouterr().out
  assert (tmp_path / eval_precision.PNG).stat().st_size > 10_000


def test_refuses_a_folder_without_runs_and_a_bad_recipe(tmp_path, capsys, monkeypatch):
  assert eval_precision.main([str(tmp_path), "--quiet"]) == 2
  assert "No finished runs" in capsys.readouterr().err

  row = {"run": "nvfp4", "seed": 0, "status": "finished", "label": "NVFP4"}
  monkeypatch.setattr(eval_precision.report, "collect", lambda folder: ({}, [row], {}))
  config = TrainConfig.from_options(model="tiny", recipe="nvfp4")
  monkeypatch.setattr(eval_precision.trainer, "eval_setup", lambda *a, **k: type("S", (), {"config": config}))
  evaluated = []
  monkeypatch.setattr(eval_precision.trainer, "evaluate", lambda *a, **k: evaluated.append(k))
  assert eval_precision.main([str(tmp_path), "--recipes", "bf16", "nvpf4", "--quiet"]) == 2
  err = capsys.readouterr().err
  assert "nvfp4/seed0: recipe 'nvpf4'" in err and "did you mean 'nvfp4'" in err
  assert not evaluated  # refused before the first evaluation
  # A recipe listed twice was evaluated twice, and each seed counted twice in the std.
  assert eval_precision.main([str(tmp_path), "--recipes", "bf16", "mxfp4", "bf16", "--quiet"]) == 2
  assert "--recipes lists 'bf16' more than once" in capsys.readouterr().err
  assert not evaluated


def test_table_has_a_difference_column_per_recipe():
  rows = [{"run": run, "label": run, "seed": seed, "recipe": recipe, "recipe_spec": spec, "step": 10,
           "val_loss": loss}
          for run, seed, recipe, spec, loss in [("a", 0, "own", "nvfp4", 2.0), ("a", 1, "own", "nvfp4", 2.2),
                                                ("a", 0, "bf16", "bf16", 1.9), ("a", 1, "bf16", "bf16", 2.1)]]
  text = eval_precision.markdown(rows, "runs/x")
  assert "| run (trained in) | seeds | val loss: own | val loss: bf16 | bf16 - own |" in text
  # The sample std over seeds (ddof=1: sqrt(0.02)), as experiments.report's results.md gives it.
  assert "| a (nvfp4) | 2 | 2.1000 ± 0.1414 | 2.0000 ± 0.1414 | -0.1000 |" in text


def test_a_run_past_its_bf16_switch_is_labelled_so():
  """precision_switch runs end past their switch, where the forward is BF16: `own` read "fwd_at50 (nvfp4)", and own
  minus bf16 (~0 there) passed for what quantizing the forward costs."""
  rows = [{"run": run, "label": run, "seed": 0, "recipe": recipe, "recipe_spec": spec, "phase": phase, "step": 10,
           "val_loss": loss}
          for run, recipe, spec, phase, loss in [
              ("fwd_at50", "own", "nvfp4", 1, 2.0), ("fwd_at50", "nvfp4", "nvfp4", 0, 2.1),
              ("nvfp4", "own", "nvfp4", 0, 2.2), ("nvfp4", "nvfp4", "nvfp4", 0, 2.2)]]
  text = eval_precision.markdown(rows, "runs/x")
  assert "| fwd_at50 (nvfp4, BF16 forward after its switch) | 1 |" in text and "| nvfp4 (nvfp4) | 1 |" in text
  assert "past a late BF16 switch: its BF16 forward" in text


def test_evaluate_sweep_keeps_the_phase_of_each_evaluation(tmp_path, monkeypatch):
  row = {"run": "all_at50", "seed": 0, "status": "finished", "label": "all at 50 %"}
  monkeypatch.setattr(eval_precision.report, "collect", lambda folder: ({}, [row], {}))
  config = TrainConfig.from_options(model="tiny", recipe="nvfp4", switch_at=0.5)
  monkeypatch.setattr(eval_precision.trainer, "eval_setup", lambda *a, **k: type("S", (), {"config": config}))
  monkeypatch.setattr(eval_precision.trainer, "evaluate", lambda *a, recipe, **k: {
      "recipe": "nvfp4", "phase": int(recipe is None), "step": 10, "val_loss": 2.0})
  _, rows = eval_precision.evaluate_sweep(tmp_path, ["nvfp4"])
  assert [(r["recipe"], r["phase"]) for r in rows] == [("own", 1), ("nvfp4", 0)]
  assert "| all_at50 (nvfp4, BF16 forward after its switch) |" in eval_precision.markdown(rows, tmp_path)


def test_figure_plots_paired_differences_to_the_own_recipe_from_zero():
  """Absolute losses on an axis cut at ~3.25 made a 0.6 % difference look like a bar twice as tall, the seed-to-seed
  std hid the paired effect the table reports, and one seed drew zero-length error bars as if measured."""
  rows = [{"run": "bf16", "seed": s, "recipe": r, "val_loss": v} for s, r, v in (
      (0, eval_precision.OWN, 3.30), (0, "nvfp4", 3.31), (1, eval_precision.OWN, 3.35), (1, "nvfp4", 3.37))]
  assert eval_precision.paired_differences(rows, "bf16", "nvfp4") == pytest.approx([0.01, 0.02])
  ax = eval_precision.figure(rows).axes[0]
  [bar] = ax.patches
  assert bar.get_y() == 0.0 and bar.get_height() == pytest.approx(0.015)
  assert "std over seeds of the paired differences" in ax.get_title() and ax.get_xticklabels()[0].get_text() == (
      "bf16\nown: 3.3250")
  one_seed = eval_precision.figure(rows[:2]).axes[0]
  assert "1 seed" in one_seed.get_title() and not one_seed.containers[0].errorbar
