"""Tests for `python -m experiments.NAME` as a user drives it: reruns of some runs (--runs) into a sweep folder, and
the report of such a folder. Finished runs are written by hand (no training): `train` is replaced by a stub that
fails the test if the command would train anything."""

import json
import pathlib
import shutil

import pytest

from experiments import components
from experiments import formats
from experiments import high_precision_layers
from experiments import merge
from experiments import precision_switch
from experiments import recipes
from experiments import report
from experiments import rht_size
from experiments import sweep as sweep_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def no_training(monkeypatch):
  def train(*args, **kwargs):
    raise AssertionError("this command must not train")
  monkeypatch.setattr(sweep_lib.trainer, "train", train)


def _finish(out, sweep, name, loss, seed=0, **changes):
  """A finished run folder of `sweep`'s run `name`, as run_sweep leaves it (config changed by `changes`)."""
  run = next(r for r in sweep.runs if r.name == name)
  folder = sweep_lib.run_dir(out, name, seed)
  config = sweep.config(run, seed, folder).replace(**changes)
  folder.mkdir(parents=True)
  records = [{"step": s, "loss": loss + 1.0 / (s + 1), "tokens_per_s": 100.0, "step_time": 0.1}
             for s in range(config.steps)] + [{"step": config.steps, "val_loss": loss}]
  (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  summary = sweep_lib._summarize(sweep, run, seed, config, folder, "finished", 1.0,  # pylint: disable=protected-access
                                 {"final_val_loss": loss, "final_loss": loss})
  sweep_lib._write_json(folder / sweep_lib.SUMMARY_FILE, summary)  # pylint: disable=protected-access


def test_runs_subset_refuses_other_runs_with_other_settings(tmp_path, capsys, no_training):
  """`--set bf16_last=2 --runs nvfp4` then `--runs mxfp4`: the reference (its own bf16_last) passed the check, so
  the report mixed two BF16-block settings under one "shared settings" line."""
  sweep = formats.get_config("smoke")
  _finish(tmp_path, sweep, "nvfp4", 2.0, bf16_last=2)
  assert formats.main(["--preset", "smoke", "--out", str(tmp_path), "--runs", "mxfp4", "--quiet"]) == 2
  assert "nvfp4/seed0 holds a finished run with different settings (bf16_last)" in capsys.readouterr().err
  assert not (tmp_path / "mxfp4").exists() and not (tmp_path / "bf16").exists()


def test_runs_subset_keeps_the_sweeps_run_order_and_labels(tmp_path, no_training):
  """sweep.json held only the --runs selection: the report put the other runs last, alphabetically."""
  sweep = formats.get_config("smoke")
  for name, loss in (("bf16", 2.0), ("nvfp4", 2.1), ("mxfp4", 2.2)):
    _finish(tmp_path, sweep, name, loss)
  assert formats.main(["--preset", "smoke", "--out", str(tmp_path), "--runs", "mxfp4", "--quiet"]) == 0
  meta = json.loads((tmp_path / "sweep.json").read_text())
  assert [r["name"] for r in meta["runs"]] == ["bf16", "nvfp4", "mxfp4"] and "--runs mxfp4" in meta["command"]
  table = (tmp_path / report.RESULTS_MD).read_text()
  rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:]
  assert rows == ["bf16", "nvfp4", "mxfp4"]


def test_set_switch_at_leaves_the_no_switch_baseline_alone(tmp_path):
  """`precision_switch --set switch_at=0.5` switched the "NVFP4, no switch" run too (a run's own settings win)."""
  sweep = precision_switch.get_config("smoke").with_overrides({"switch_at": 0.5})
  run = next(r for r in sweep.runs if r.name == "nvfp4")
  assert sweep.config(run, 0, tmp_path).policy.switch_at is None


@pytest.mark.parametrize("changes", [{"bf16_last": 1}, {"bf16_first": 1}])
def test_set_bf16_blocks_leaves_each_high_precision_run_its_own_blocks(tmp_path, changes):
  """`high_precision_layers --set bf16_last=1` turned "none" (NVFP4 everywhere) and "first1" into other settings."""
  sweep = high_precision_layers.get_config("cpu").with_overrides(changes)
  blocks = {r.name: sweep.config(r, 0, tmp_path).policy.bf16_blocks(4) for r in sweep.runs if r.name != "bf16"}
  assert blocks == {"none": (), "first1": (0,), "last1": (3,), "first1_last1": (0, 3), "first2": (0, 1),
                    "last2": (2, 3)}


@pytest.mark.parametrize("changes", [{"bf16_blocks": (0,)}, {"bf16_pattern": r".*mlp.*"}])
@pytest.mark.parametrize("module", [high_precision_layers, components])
def test_set_bf16_layers_leaves_the_runs_that_vary_them_alone(tmp_path, module, changes):
  """`--set bf16_blocks=0` gave "NVFP4 everywhere" block 0 in BF16 (the same run as "first1" under two labels) and
  components' "all NVFP4" run BF16 layers; `--set bf16_pattern` likewise."""
  plain, changed = module.get_config("cpu"), module.get_config("cpu").with_overrides(changes)
  for run in plain.runs:
    if run.name.startswith(("none", "first", "last", "no_hp_layers")):
      assert changed.config(run, 0, tmp_path).policy == plain.config(run, 0, tmp_path).policy, run.name


def test_every_high_precision_run_keeps_a_block_in_nvfp4(tmp_path):
  """The cpu preset's "first 2 + last 2 BF16" covered all 4 blocks: a BF16 run reported as an NVFP4 variant."""
  for preset in ("smoke", "cpu", "gpu"):
    sweep = high_precision_layers.get_config(preset)
    for run in sweep.runs:
      if run.name != "bf16":
        config = sweep.config(run, 0, tmp_path)
        assert len(config.policy.bf16_blocks(config.model.n_layers)) < config.model.n_layers, (preset, run.name)
  assert "first4_last4" in [r.name for r in high_precision_layers.get_config("gpu").runs]
  # The preset's runs are fixed before `--set model.n_layers=2`: each sweep's configs refuse a run left with none.
  shallow = high_precision_layers.get_config("cpu").with_overrides({"model.n_layers": 2})
  with pytest.raises(ValueError, match=r"run 'first1_last1': its precision policy keeps every linear layer of the "
                                       r"2-block model in BF16, so it would train the BF16 run under the label "
                                       r"'first 1 \+ last 1 BF16'"):
    shallow.config(next(r for r in shallow.runs if r.name == "first1_last1"), 0, tmp_path)
  shallow.config(next(r for r in shallow.runs if r.name == "first1"), 0, tmp_path)


def test_empty_out_is_refused(tmp_path, monkeypatch, capsys, no_training):
  """`--out "$DIR"` with an empty DIR ran the sweep in the working directory."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    formats.main(["--preset", "smoke", "--out", "", "--quiet"])
  assert exit_info.value.code == 2 and "--out needs a folder name" in capsys.readouterr().err
  assert not any(tmp_path.iterdir())


def test_another_experiments_folder_is_refused(tmp_path, capsys, no_training):
  """`experiments.formats --out` the folder of an rht_size sweep: the bf16 reference matched, the rest trained, and
  results.md listed both sweeps' runs under the formats header."""
  (tmp_path / "sweep.json").write_text(json.dumps({"experiment": "rht_size", "runs": []}))
  assert formats.main(["--preset", "smoke", "--out", str(tmp_path), "--quiet"]) == 2
  assert "holds the 'rht_size' sweep (sweep.json), not 'formats'" in capsys.readouterr().err


def test_report_of_a_copied_folder_measures_gaps_against_its_own_reference(tmp_path, capsys):
  """`report DIR --reference nvfp4`, then `report DIR`: the table said "gap to bf16" over the gaps to nvfp4 that
  results.jsonl held from the first call."""
  folder = tmp_path / "formats_cpu"
  shutil.copytree(REPO / "experiments" / "results" / "formats_cpu", folder)
  before = (folder / report.RESULTS_MD).read_text(encoding="utf-8")
  assert report.main([str(folder), "--reference", "nvfp4"]) == 0
  assert report.main([str(folder)]) == 0
  capsys.readouterr()
  assert (folder / report.RESULTS_MD).read_text(encoding="utf-8") == before


def test_sweep_without_validation_finishes(tmp_path, monkeypatch):
  """`--set eval_batches=0`: every run's final_val_loss is None, and the progress line crashed on it (TypeError)
  after the first run, so the sweep stopped at each run."""
  monkeypatch.setattr(sweep_lib.trainer, "train", lambda *a, **k: {"final_val_loss": None, "final_loss": 3.5})
  sweep = sweep_lib.Sweep(experiment="noval", preset="smoke", reference="a",
                          base=dict(sweep_lib.base_overrides("smoke"), eval_batches=0),
                          runs=(sweep_lib.Run("a", {"recipe": "bf16"}), sweep_lib.Run("b", {"recipe": "nvfp4"})))
  messages = []
  records = sweep_lib.run_sweep(sweep, tmp_path, progress=False, log=messages.append)
  assert [r["status"] for r in records] == ["finished", "finished"]
  assert "no val_loss (eval_batches=0), final train loss 3.5000" in messages[0]


def test_set_bf16_first_leaves_the_all_nvfp4_component_run_alone(tmp_path):
  """`components --set bf16_first=1` gave "no_hp_layers" (all NVFP4) a BF16 first block."""
  sweep = components.get_config("cpu").with_overrides({"bf16_first": 1})
  run = next(r for r in sweep.runs if r.name == "no_hp_layers")
  assert sweep.config(run, 0, tmp_path).policy.bf16_blocks(4) == ()


def test_list_refuses_settings_the_run_would_refuse(tmp_path, capsys):
  """`recipes --preset cpu --set steps=40 --list` listed nine runs and exited 0; the same command without --list
  refuses the sweep (OutControl's calibration ends after step 40)."""
  assert recipes.main(["--preset", "cpu", "--out", str(tmp_path), "--set", "steps=40", "--list"]) == 2
  assert "run 'tetrajet-v2-outcontrol': invalid settings: OutControl" in capsys.readouterr().err
  assert recipes.main(["--preset", "cpu", "--out", str(tmp_path), "--list"]) == 0
  assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("window", ["0", "-3"])
def test_report_refuses_a_window_below_one_step(tmp_path, window, capsys):
  """`report DIR --smooth 0` drew the default window; `--smooth -3` labelled the plots "average over -3 steps"."""
  folder = tmp_path / "formats_cpu"
  shutil.copytree(REPO / "experiments" / "results" / "formats_cpu", folder)
  with pytest.raises(SystemExit) as exit_info:
    report.main([str(folder), "--smooth", window])
  assert exit_info.value.code == 2 and "--smooth must be a window of >= 1 steps" in capsys.readouterr().err


def test_missing_corpus_is_a_clear_error(tmp_path, monkeypatch, capsys):
  """`--set data.corpus=/nonexistent` ended in a FileNotFoundError traceback from the first run's data loading
  (`fp4jax train` reports the same error in one line, exit 2)."""
  def train(*args, **kwargs):
    raise FileNotFoundError("Corpus path does not exist: /nonexistent")
  monkeypatch.setattr(sweep_lib.trainer, "train", train)
  argv = ["--preset", "smoke", "--out", str(tmp_path), "--set", "data.corpus=/nonexistent", "--quiet"]
  assert formats.main(argv) == 2
  assert "error: Corpus path does not exist: /nonexistent" in capsys.readouterr().err


def test_runs_subset_need_not_make_the_other_runs_valid(tmp_path, monkeypatch):
  """`recipes --preset cpu --set steps=40 --runs nvidia`: the OutControl run (calibration beyond step 40) is not
  selected and has no folder, so it must not stop the selected runs."""
  monkeypatch.setattr(sweep_lib.trainer, "train", lambda *a, **k: {"final_val_loss": 2.0, "final_loss": 2.0})
  argv = ["--preset", "cpu", "--out", str(tmp_path), "--seeds", "1", "--set", "steps=40", "--runs", "nvidia",
          "--quiet", "--no-report"]
  assert recipes.main(argv) == 0
  assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["bf16", "nvidia"]


def test_out_that_is_a_file_is_refused(tmp_path, capsys, no_training):
  """`--out` naming a file ended in a FileExistsError traceback from the sweep's mkdir."""
  path = tmp_path / "notes.txt"
  path.write_text("x")
  with pytest.raises(SystemExit) as exit_info:
    formats.main(["--preset", "smoke", "--out", str(path), "--quiet"])
  assert exit_info.value.code == 2 and "is a file, not a sweep folder" in capsys.readouterr().err


def test_merge_with_another_seed_count_is_refused_before_any_run(tmp_path, capsys, no_training):
  """`recipes --preset cpu --seeds 1 --runs quartet2 --merge-into experiments/results/recipes_cpu` replaced the stored
  5 seeds of quartet2 by 1, in a table whose other rows keep 5."""
  stored = tmp_path / "stored"
  shutil.copytree(REPO / "experiments" / "results" / "recipes_cpu", stored)
  argv = ["--preset", "cpu", "--out", str(tmp_path / "new"), "--runs", "quartet2", "--merge-into", str(stored)]
  assert recipes.main([*argv, "--seeds", "1", "--quiet"]) == 2
  assert "have 5 seed(s) per run, this sweep 1" in capsys.readouterr().err
  assert not (tmp_path / "new").exists()
  merge.check_mergeable(stored, recipes.get_config("cpu").to_dict())  # the stored sweep's own seed count merges


@pytest.mark.parametrize("preset", ["smoke", "cpu"])
def test_the_formats_description_names_the_formats_its_preset_runs(preset):
  """The smoke preset's results.md said "BF16 vs FP8 vs NVFP4 vs MXFP4" over a table without FP8."""
  config = formats.get_config(preset)
  compared = config.description.split(";")[0].split(" (")[0].split(" vs ")
  assert compared == [r.name.upper() for r in config.runs]


def test_runs_that_would_train_the_same_settings_are_said_before_training(tmp_path, no_training):
  """`precision_switch --preset cpu --set steps=5` trained "switch at 80 %" and "at 90 %" both from step 4: one result
  twice under two labels (the report compared them as two findings), with no word of it. Not refused: identical
  runs on purpose check reproducibility (tests/experiments/test_experiments.py does)."""
  short = precision_switch.get_config("cpu").with_overrides({"steps": 5})
  said = []
  with pytest.raises(AssertionError, match="must not train"):
    sweep_lib.run_sweep(short, tmp_path / "out", log=said.append)
  assert said[0].startswith("Note: these runs train the same model on the same settings: 'all_at80' and "
                            "'all_at90'; 'fwd_at80' and 'fwd_at90' (")
  # Every preset of every experiment has distinct runs.
  for module in (formats, components, high_precision_layers, precision_switch, recipes, rht_size):
    for preset in ("smoke", "cpu", "gpu"):
      sweep = module.get_config(preset)
      assert sweep_lib.same_settings_runs({(r.name, 0): sweep.config(r, 0, tmp_path / r.name) for r in sweep.runs}) \
          == [], (module.__name__, preset)
  same = high_precision_layers.get_config("smoke")
  bf16 = same.config(same.runs[0], 0, tmp_path / "a")
  assert sweep_lib.same_settings_runs({("a", 0): bf16, ("b", 0): bf16.replace(out=str(tmp_path / "b"))}) == [("a", "b")]


def test_the_recipes_docstring_names_the_smoke_runs():
  """The module docstring (also `--help`) marked two runs "not in the smoke preset", implying the others were."""
  assert sorted(r.name for r in recipes.get_config("smoke").runs) == ["bf16", "nvidia-4over6", "quartet2"]
  said = " ".join(recipes.__doc__.split())
  assert "The smoke preset runs BF16, NVIDIA + 4/6 and Quartet II only." in said and "not in the smoke" not in said


def test_a_run_train_would_refuse_stops_the_sweep_before_any_run(tmp_path, no_training):
  """recipes --set switch_at=0.1: the OutControl run (channels chosen at step 49, every GEMM BF16 from step 30) was
  refused only on its turn, after the runs before it had trained, leaving its folder behind."""
  sweep = recipes.get_config("cpu").with_overrides({"switch_at": 0.1})
  with pytest.raises(ValueError, match=r"run 'tetrajet-v2-outcontrol': OutControl chooses its channels at step 49"):
    sweep_lib.run_sweep(sweep, tmp_path / "out", log=None)
  assert not (tmp_path / "out").exists()
