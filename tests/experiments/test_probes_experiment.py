"""Tests for experiments.probes: presets and variants, the summaries and report of a stored smoke results.json
(fast), and the smoke preset end to end, which must reproduce that stored results.json (slow)."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from experiments.probes import presets, report, run, summary
from fp4jax.pretrain import model as model_lib
from stored_results import check_reproduces
from stored_results import stored

# `python -m experiments.probes --preset smoke` on CPU (checkpoint path and run time blanked).
STORED = pathlib.Path(__file__).parent / "data" / "probes_smoke_results.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_variants_and_presets():
  assert presets.parse_variant("nvfp4-noSR+first1+last2") == ("nvfp4-noSR", 1, 2)
  assert presets.parse_variant("mxfp4") == ("mxfp4", 0, 0)
  with pytest.raises(ValueError, match="Bad variant"):
    presets.parse_variant("nvfp5+last1")
  with pytest.raises(ValueError, match="Unknown preset"):
    presets.get_preset("tpu")
  gpu = model_lib.get_model_config(presets.get_preset("gpu").model, **dict(presets.get_preset("gpu").model_overrides))
  assert gpu.n_layers == 20 and gpu.remat and gpu.scan_layers
  names = [f"blocks.{b}.{s}" for b in range(3) for s in model_lib.SUBLAYERS]
  got = presets.variant_recipes("nvfp4+last1", names, 3)
  assert [got[f"blocks.{b}.mlp.down"].is_quantized for b in range(3)] == [True, True, False]
  got = presets.blocks_recipes(presets.probes.recipe_variants()["nvfp4"], [1], names, 3)
  assert [got[f"blocks.{b}.attn.q"].is_quantized for b in range(3)] == [True, False, True]


def test_summaries_on_small_cases():
  cont = {"runs": {"bf16": {"1": {"val_own": 2.0, "val_bf16": 2.0}, "2": {"val_own": 3.0, "val_bf16": 3.0}},
                   "nvfp4": {"1": {"val_own": 2.5, "val_bf16": 2.1}, "2": {"val_own": 3.1, "val_bf16": 3.1}}}}
  deltas = summary.continuation_deltas(cont)
  assert "delta_own" not in deltas["bf16"] and deltas["nvfp4"]["seeds"] == 2
  np.testing.assert_allclose(deltas["nvfp4"]["delta_own"], (0.3, 0.2))  # paired by seed: (0.5, 0.1)
  np.testing.assert_allclose(deltas["nvfp4"]["delta_bf16"], (0.1, 0.0), atol=1e-12)  # (0.1, 0.1): no spread
  # Keeping block 2 in BF16 recovers the most loss: it ranks first.
  mp = {"n_layers": 3, "variants": {"nvfp4": {"seq_dloss": [0.3, 0.5]}},
        "all_but": {"0": {"seq_dloss": [0.3, 0.4]}, "1": {"seq_dloss": [0.2, 0.5]}, "2": {"seq_dloss": [0.0, 0.1]}}}
  assert summary.sensitivity_ranking(mp) == [2, 0, 1]
  np.testing.assert_allclose(summary.recovered_dloss(mp, 2), (0.35, 0.05))
  assert summary.significance(1.0, 0.25) == "+4.0 SE" and summary.significance(0.1, 0.25).endswith("(no effect)")
  assert summary.significance(0.0, 0.0) == "exact"


def test_report_of_the_stored_smoke_results(tmp_path):
  shutil.copy(STORED, tmp_path / report.RESULTS_FILE)
  written = report.write_report(tmp_path)
  assert {p.name for p in written} == {report.REPORT_FILE, "layer_errors.png", "bias_vs_k.png", "sensitivity.png",
                                       "continuation.png"}
  for p in written[1:]:
    assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000
  text = (tmp_path / report.REPORT_FILE).read_text()
  for section in ("## Component effects", "## Per recipe", "## Gradient bias vs number", "## Codes and block scales",
                  "## Whole model", "## Continuations", "## Per layer", "SR on -> off", "NVFP4 -> MXFP4"):
    assert section in text
  results = json.loads(STORED.read_text())
  effects = summary.component_effects(results)
  sr = [e for e in effects if e["what"] == "SR on -> off" and e["metric"].startswith("Dgrad bias vs exact")]
  # Without SR the gradient rounding is biased: the mean of many draws stays further from the exact gradient.
  assert len(sr) == 1 and sr[0]["mean"] > 0 and sr[0]["n"] == len(results["layers"]["layers"])
  # The per-layer table's chain gaps, both named (one column headed "chain gap" held Dgrad's: 0 for every NVFP4 layer).
  layer, by_recipe = next(iter(results["layers"]["layers"].items()))
  row = next(line for line in text.splitlines() if line.startswith(f"| {layer} | nvfp4 |")).split(" | ")
  assert "| Wgrad err | chain gap Dgrad | chain gap Wgrad |" in text
  assert row[5:7] == [f"{by_recipe['nvfp4']['chain_dgrad']:.4f}", f"{by_recipe['nvfp4']['chain_wgrad']:.4f}"]
  bf16_row = next(line for line in text.splitlines() if line.startswith("| bf16 | 0.0000"))
  assert bf16_row.count("0.0000") >= 5  # BF16 against itself: exactly zero errors


@pytest.mark.slow
def test_smoke_preset_reproduces_the_stored_results(tmp_path):
  assert run.main(["--preset", "smoke", "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / report.RESULTS_FILE).read_text())
  mismatch = check_reproduces(results, stored("probes_smoke_results.json"))
  assert set(results["layers"]["layers"]) == {f"blocks.0.{s}" for s in model_lib.SUBLAYERS}
  # A second run reuses the base checkpoint; --report-only redraws from results.json.
  assert run.main(["--preset", "smoke", "--out", str(tmp_path), "--report-only"]) == 0
  assert (tmp_path / "continuation.png").is_file()
  if mismatch:
    pytest.skip(mismatch)


def test_list_prints_the_preset_and_runs_nothing(tmp_path, capsys):
  from experiments.probes import run as probes_run  # pylint: disable=g-import-not-at-top
  assert probes_run.main(["--preset", "cpu", "--out", str(tmp_path / "p"), "--list"]) == 0
  out = capsys.readouterr().out
  assert "base_steps" in out and "300" in out and "base run" in out
  assert not (tmp_path / "p").exists()


def test_a_probed_checkpoint_is_named_by_its_own_shapes_and_a_quantized_one_noted():
  from experiments.probes import training  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  config = TrainConfig.from_options(model=model_lib.get_model_config("tiny", n_layers=1, d_ff=192), recipe="nvfp4")
  assert training.model_name("tiny", {"n_layers": 1}, config, None) == "tiny {'n_layers': 1}"  # the preset's run
  notes = []
  name = training.model_name("tiny", {"n_layers": 1}, config, "runs/mine", log=notes.append)
  assert name.startswith("runs/mine {") and "'d_ff': 192" in name and "'n_layers': 1" in name
  assert len(notes) == 1 and "recipe 'nvfp4', not BF16" in notes[0]
  bf16 = config.replace(recipe="bf16")
  training.model_name("tiny", {}, bf16, "runs/mine", log=notes.append)
  assert len(notes) == 1


def test_restore_run_reads_the_recorded_corpus_and_refuses_changed_data(tmp_path, monkeypatch):
  # restore_run read a checkpoint's --data.corpus as typed (a relative path: from the probe's own folder) and never
  # checked the data against the identity the checkpoint recorded: the probes could measure other text unnoticed.
  from experiments.probes import training  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import checkpoint as ckpt  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  text = "To be, or not to be, that is the question. " * 60
  corpus, cache = tmp_path / "proj" / "corpus.txt", str(tmp_path / "cache")
  corpus.parent.mkdir()
  corpus.write_text(text)
  recorded = data.load_dataset(data.DataConfig(corpus=str(corpus), cache_dir=cache)).identity
  stored = TrainConfig(out=str(tmp_path / "run"), steps=8).replace(
      **{"data.corpus": "corpus.txt", "data.cache_dir": cache})  # typed relative to proj/, where the run trained
  manager = ckpt.open_manager(tmp_path / "run")
  ckpt.save(manager, 4, {"w": np.zeros(3, np.float32)}, {"config": stored.to_dict(), "data": recorded.to_dict()},
            force=True)
  ckpt.save(manager, 8, {"w": np.zeros(3, np.float32)}, {"config": stored.to_dict()}, force=True)  # an older one
  manager.wait_until_finished()
  manager.close()
  built = []

  def build_model(config, key):  # what restore_run builds once the data passed; stops it there
    del key
    built.append(config.data.corpus)
    raise InterruptedError

  monkeypatch.setattr(training.trainer, "build_model", build_model)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "corpus.txt").write_text("Other text. " * 300)  # what ./corpus.txt reads as from here
  with pytest.raises(InterruptedError):
    training.restore_run(tmp_path / "run", 4)
  assert built == [recorded.corpus]
  notes = []
  with pytest.raises(InterruptedError):
    training.restore_run(tmp_path / "run", 8, log=notes.append)  # no identity recorded: as typed, with a note
  assert built[1:] == ["corpus.txt"] and len(notes) == 1 and "does not record which data" in notes[0]
  corpus.write_text(text.replace("question", "answer!!"))
  with pytest.raises(ValueError, match=r"^The data differs from what checkpoint 4 was trained on: the corpus "
                     r".* holds other text.*Restore the corpus to use the run's own data\.$"):
    training.restore_run(tmp_path / "run", 4)
  corpus.unlink()
  with pytest.raises(FileNotFoundError, match=r"corpus.txt no longer exists\. If the corpus moved, put it back at "
                     r"that path \(its content is checked against the checkpoint's fingerprint\)\.$"):
    training.restore_run(tmp_path / "run", 4)
  assert len(built) == 2
