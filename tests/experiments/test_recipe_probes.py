"""Tests for `python -m experiments.probes recipes`: the recipe list taken from experiments.recipes (bad strings named),
the report of a stored smoke results.json and what its numbers must show (fast), and the smoke preset end to end,
which must reproduce that stored results.json (slow)."""

import json
import math
import pathlib
import shutil

import numpy as np
import pytest

from experiments import recipes as recipes_experiment
from experiments import sweep
from experiments.probes import recipe_gemms
from experiments.probes import recipe_gemms_report as report
from experiments.probes import run as probes_run
from fp4jax.analysis import gemm_probes
from stored_results import check_reproduces
from stored_results import stored

# `python -m experiments.probes recipes --preset smoke` on CPU (checkpoint path and run time blanked).
STORED = pathlib.Path(__file__).parent / "data" / "recipe_probes_smoke_results.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_recipes_come_from_experiments_recipes(monkeypatch):
  logged = []
  got = recipe_gemms.comparison_recipes("cpu", log=logged.append)
  runs = [r.name for r in recipes_experiment.get_config("cpu").runs]
  assert list(got) == [n for n in runs if n != "tetrajet-v2-outcontrol"]  # a training option, not a GEMM recipe
  assert "tetrajet-v2-outcontrol" in logged[0] and "outcontrol_fraction" in logged[0] and "skipped" in logged[0]
  assert got["nvidia-unbiased-sr"]["spec"] == "nvfp4:unbiased_sr=true" and got["bf16"]["recipe"].name == "bf16"
  assert list(recipe_gemms.comparison_recipes("cpu", ["nvidia", "bf16"])) == ["bf16", "nvidia"]
  with pytest.raises(ValueError, match="Unknown run"):
    recipe_gemms.comparison_recipes("cpu", ["nvidia-5over6"])

  def fake_config(preset, runs):
    return sweep.Sweep(experiment="recipes", preset=preset, runs=tuple(runs), reference="bf16")

  logged = []
  runs = [sweep.Run("bf16", {"recipe": "bf16"}), sweep.Run("switch", {"switch_at": 0.5})]
  monkeypatch.setattr(recipes_experiment, "get_config", lambda p: fake_config(p, runs))
  assert list(recipe_gemms.comparison_recipes("cpu", log=logged.append)) == ["bf16"]
  assert "switch" in logged[0] and "skipped" in logged[0]
  bad = runs + [sweep.Run("quartet-x", {"recipe": "quartet2:rht_size=3"})]
  monkeypatch.setattr(recipes_experiment, "get_config", lambda p: fake_config(p, bad))
  with pytest.raises(ValueError, match=r"run 'quartet-x': recipe 'quartet2:rht_size=3' does not parse"):
    recipe_gemms.comparison_recipes("cpu", log=lambda s: None)


def test_list_and_bad_runs(tmp_path, capsys):
  assert probes_run.main(["recipes", "--preset", "cpu", "--out", str(tmp_path / "p"), "--list"]) == 0
  out = capsys.readouterr().out
  assert "nvidia-unbiased-sr" in out and "nvfp4:unbiased_sr=true" in out and "blocks.0.attn.q" in out
  assert not (tmp_path / "p").exists()
  assert probes_run.main(["recipes", "--out", str(tmp_path / "p"), "--runs", "nvidia,nope"]) == 2
  assert "Unknown run(s) ['nope']" in capsys.readouterr().err


def check_claims(results):
  """What a correct run must show (fixed keys; tolerances far outside the measured values' spread)."""
  s = report.recipe_summary(results)
  bf16 = s["bf16"]
  # BF16: only W's cast to bfloat16 differs from the exact product (~2^-9 relative); Wgrad is exact; no randomness.
  assert 0 < bf16["fprop_err"] < 5e-3 and 0 < bf16["dgrad_err"] < 5e-3 and bf16["wgrad_err"] < 1e-6
  assert bf16["dgrad_err_se"] == 0 and bf16["dgrad_exact_Kmax"] == bf16["dgrad_exact_K1"]
  assert bf16["dgrad_chain"] == 0 and math.isnan(bf16["dgrad_maxima"])
  for run, r in s.items():
    if run == "bf16":
      continue
    # FP4 with 16-element blocks: single-draw errors of a few percent to a few tens of percent, all GEMMs.
    assert all(0.02 < r[f"{g}_err"] < 0.4 for g in ("fprop", "dgrad", "wgrad")), run
    # Round-to-nearest forward: averaging draws cannot remove it (a floor vs the exact product).
    assert r["dgrad_exact_floor"] > 0.02, run
  nv, usr = s["nvidia"], s["nvidia-unbiased-sr"]
  assert nv["dgrad_chain"] == 0  # Dgrad reuses the 2D Fprop weight codes
  # NVIDIA's SR keeps a bias at block maxima (scales rounded to nearest clip them); scales rounded up remove it.
  for g in ("dgrad", "wgrad"):
    assert nv[f"{g}_maxima"] < -0.005 and nv[f"{g}_maxima"] < -5 * nv[f"{g}_maxima_se"], g
    assert abs(usr[f"{g}_maxima"]) < max(4 * usr[f"{g}_maxima_se"], 2e-3), g
  # ... and so a smaller Dgrad bias against the quantized forward's gradient once the noise is removed.
  assert usr["dgrad_qfwd_floor"] < nv["dgrad_qfwd_floor"]
  # NVIDIA re-quantizes x for Wgrad (RHT, round to nearest): a plateau vs the quantized forward's gradient.
  assert nv["wgrad_qfwd_slope"] > -0.3 and nv["wgrad_chain"] > 0.05


def test_report_of_the_stored_smoke_results(tmp_path):
  shutil.copy(STORED, tmp_path / report.RESULTS_FILE)
  written = report.write_report(tmp_path)
  assert [p.name for p in written] == [report.REPORT_FILE, report.CSV_FILE, report.PLOT_FILE]
  assert written[2].read_bytes()[:8] == PNG_MAGIC and written[2].stat().st_size > 20000
  results = json.loads(STORED.read_text())
  text = written[0].read_text()
  for run, r in results["runs"].items():
    assert f"| {run} | `{r['spec']}` |" in text
  assert "## Backward against the quantized forward's gradient" in text
  rows = written[1].read_text().splitlines()
  n_layers = len(results["layers"])
  assert len(rows) == 1 + 3 * n_layers * len(results["runs"]) and rows[0].startswith("run,recipe,layer,gemm,err")
  check_claims(results)


def _hand_layer_result(kmax_se):
  """One layer x recipe of a recipe-probes results.json (num_draws=4: K = 1, 2), made by hand."""
  curve = {"K": [1, 2], "mean": [0.2, 0.15], "se": [0.01, kmax_se], "groups": [[0.2] * 4, [0.15] * 2]}
  return {"err": {g: [0.1, 0.1, 0.1, 0.1] for g in gemm_probes.GEMMS},
          "bias": {g: {ref: curve for gg, ref in gemm_probes.SERIES if gg == g} for g in gemm_probes.GEMMS},
          "chain": {"dgrad": [0.0] * 4, "wgrad": [0.0] * 4}, "maxima": {"dgrad": [-0.01] * 4, "wgrad": [-0.01] * 4}}


def test_bias_at_k_max_and_its_pooled_standard_error():
  """A layer's "K = max" columns take the curve's last level (mean and SE), not its first; a recipe's SE over layers
  is pooled as sqrt(mean SE^2) / sqrt(layers): Kmax SEs 0.03 and 0.04 pool to 0.025 (not the RMS 0.0354)."""
  row = report.layer_row(_hand_layer_result(0.03))
  assert (row["dgrad_exact_K1"], row["dgrad_exact_Kmax"], row["dgrad_exact_Kmax_se"]) == (0.2, 0.15, 0.03)
  results = {"runs": {"r": {}},
             "layers": {"l0": {"r": _hand_layer_result(0.03)}, "l1": {"r": _hand_layer_result(0.04)}}}
  s = report.recipe_summary(results)["r"]
  assert s["dgrad_exact_Kmax_se"] == pytest.approx(0.025)
  assert s["dgrad_exact_Kmax"] == pytest.approx(0.15) and s["fprop_err"] == pytest.approx(0.1)


@pytest.mark.slow
def test_smoke_preset_reproduces_the_stored_results(tmp_path):
  want = json.loads(STORED.read_text())
  runs = ",".join(want["runs"])  # the stored runs, whatever experiments.recipes has added since
  assert probes_run.main(["recipes", "--preset", "smoke", "--out", str(tmp_path), "--runs", runs]) == 0
  results = json.loads((tmp_path / report.RESULTS_FILE).read_text())
  check_claims(results)
  mismatch = check_reproduces(results, stored("recipe_probes_smoke_results.json"))
  assert np.isfinite(results["bf16_loss"])
  assert recipe_gemms.main(["--report-only", "--out", str(tmp_path)]) == 0
  if mismatch:
    pytest.skip(mismatch)
