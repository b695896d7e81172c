"""Tests for experiments.report on sweep folders written by hand (no training): which run folders a table counts,
what it says of the jobs it lacks, and what its plots average and over how many steps they smooth."""

import json
import shutil

import numpy as np
import pytest

from experiments import report


def _write_run(folder, run, seed, loss, *, steps=4, log_every=1, status="finished"):
  """OUT/<run>/seed<seed> as the sweep leaves it: train loss logged every `log_every` steps, then the final val."""
  d = folder / run / f"seed{seed}"
  d.mkdir(parents=True)
  logged = sorted(set(range(0, steps, log_every)) | {steps - 1})
  records = [{"step": s, "loss": loss + 1.0 / (s + 1)} for s in logged] + [{"step": steps, "val_loss": loss}]
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (d / "summary.json").write_text(json.dumps(
      {"experiment": "x", "preset": "smoke", "run": run, "label": run, "seed": seed, "overrides": {},
       "status": status, "steps": steps, "tokens": 16 * steps, "final_val_loss": loss if status == "finished" else None,
       "tokens_per_s": 100.0}))
  return d


def _write_diverged(folder, run, seed, losses):
  """OUT/<run>/seed<seed> of a 4-step run whose loss went NaN at step len(losses), after `losses`."""
  d = folder / run / f"seed{seed}"
  d.mkdir(parents=True)
  logged = list(enumerate(losses)) + [(len(losses), float("nan"))]
  (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in logged))
  (d / "summary.json").write_text(json.dumps(
      {"experiment": "x", "preset": "smoke", "run": run, "label": run, "seed": seed, "overrides": {},
       "status": "diverged", "steps": 4, "tokens": 64, "final_val_loss": None, "diverged_step": len(losses)}))


def _sweep(folder, losses, seeds=2, **kwargs):
  """A sweep folder of runs {run: [loss of seed 0, seed 1, ...]} with reference "a"."""
  folder.mkdir(exist_ok=True)
  (folder / "sweep.json").write_text(json.dumps(
      {"experiment": "x", "seeds": seeds, "reference": "a", "runs": [{"name": r} for r in losses]}))
  for run, values in losses.items():
    for seed, loss in enumerate(values):
      _write_run(folder, run, seed, loss, **kwargs)
  return folder


def _table_row(text, run):
  return next(line for line in text.splitlines() if line.startswith(f"| {run} |"))


def test_a_summary_in_another_seeds_folder_is_refused_and_a_set_aside_copy_ignored(tmp_path):
  """b/seed1 copied from b/seed0 counted b's seed-0 result once as "1 seed" with seed 1's loss (2.5, against a's
  seed 0: +25 %), and b/seed0_old (a folder set aside before a rerun) replaced b/seed0's result (9.0) silently."""
  _sweep(tmp_path, {"a": [2.0, 2.2], "b": [2.1]}, seeds=2)
  _write_run(tmp_path / "aside", "b", 0, 9.0).rename(tmp_path / "b" / "seed0_old")
  _, rows, _ = report.collect(tmp_path)
  assert [(r["run"], r["seed"], r["final_val_loss"]) for r in rows if r["run"] == "b"] == [("b", 0, 2.1)]
  copy = tmp_path / "b" / "seed1"
  shutil.copytree(tmp_path / "b" / "seed0", copy)
  summary = json.loads((copy / "summary.json").read_text())
  (copy / "summary.json").write_text(json.dumps(dict(summary, final_val_loss=2.5)))
  with pytest.raises(ValueError, match=r"b/seed1/summary.json is the summary of b/seed0, not of its folder b/seed1"):
    report.collect(tmp_path)
  assert report.main([str(tmp_path)]) == 2


def test_jobs_without_a_finished_run_are_named_in_the_table(tmp_path):
  """A report of an interrupted sweep (c never ran, b's seed 1 unfinished) showed a table without c and b's one seed as
  a plain "1" under "up to 2 seed(s) per run", saying nothing of either."""
  _sweep(tmp_path, {"a": [2.0, 2.2], "b": [2.1], "c": []}, seeds=2)
  (tmp_path / "b" / "seed1").mkdir()  # started, no summary.json yet
  report.write_report(tmp_path)
  text = (tmp_path / report.RESULTS_MD).read_text()
  assert "**Missing** (not finished, not in the table): b/seed1, c/seed0, c/seed1." in text
  assert _table_row(text, "b").startswith("| b | b | none | 1 | 2.1000 | +5.00 |")
  _sweep(tmp_path / "complete", {"a": [2.0, 2.2], "b": [2.1, 2.3]}, seeds=2)
  report.write_report(tmp_path / "complete")
  assert "Missing" not in (tmp_path / "complete" / report.RESULTS_MD).read_text()


def test_plots_smooth_over_steps_when_the_loss_is_logged_every_few_steps(tmp_path):
  """With log_every=10 the moving average ran over logged entries, not steps: `--smooth 40` averaged 40 entries (400
  steps) and the default window, 2 entries (20 steps), was labelled "over 2 steps"."""
  _sweep(tmp_path, {"a": [2.0]}, seeds=1, steps=400, log_every=10)
  meta, rows, curves = report.collect(tmp_path)
  logged = list(range(0, 400, 10)) + [399]
  loss = {s: 2.0 + 1.0 / (s + 1) for s in logged}
  for window in (40, None):
    ax = report.loss_curves_figure(meta, rows, curves, window).axes[0]
    steps = window or 20  # the default: 1/20 of the 400 steps
    assert f"moving average over {steps} steps" in ax.get_ylabel()
    expected = [np.mean([loss[t] for t in logged if s - steps < t <= s]) for s in logged]
    train = ax.get_lines()[0]
    np.testing.assert_allclose(train.get_xdata(), np.array(logged) * 16 / 1e6)
    np.testing.assert_allclose(train.get_ydata(), expected, rtol=1e-12)


def test_plots_average_the_seeds_the_table_averages(tmp_path):
  """b's seed 1 diverged at step 2: the table averaged b's finished seed 0, the plots both seeds on the steps they
  share, so b's train curve and gap ended at step 2 in NaN."""
  _sweep(tmp_path, {"a": [2.0, 2.2], "b": [2.1]}, seeds=2)
  _write_diverged(tmp_path, "b", 1, (3.0, 2.9))
  meta, rows, curves = report.collect(tmp_path)
  assert "| b | b | none | 1 (+1 diverged at step 2) | 2.1000 | +5.00 |" in report.markdown_table(meta, rows)
  b_train = report.loss_curves_figure(meta, rows, curves).axes[0].get_lines()[2]
  np.testing.assert_allclose(b_train.get_ydata(), [2.1 + 1.0 / (s + 1) for s in range(4)])
  b_gap = report.loss_gap_figure(meta, rows, curves, "a").axes[0].get_lines()[1]  # after the zero line
  np.testing.assert_allclose(b_gap.get_ydata(), [100 * ((2.1 - 2.0) / (2.0 + 1.0 / (s + 1))) for s in range(4)])


def test_plots_average_the_seeds_by_their_mean_not_their_median(tmp_path):
  """With three seeds the plotted train and validation curves are the mean over seeds (as the table's val loss),
  not their median: seeds at 2.0, 2.1 and 2.8 plot 2.3 (the median, 2.1, hid a bad seed)."""
  _sweep(tmp_path, {"a": [2.0, 2.1, 2.8]}, seeds=3)
  meta, rows, curves = report.collect(tmp_path)
  lines = report.loss_curves_figure(meta, rows, curves, 1).axes[0].get_lines()
  np.testing.assert_allclose(lines[0].get_ydata(), [2.3 + 1.0 / (s + 1) for s in range(4)])
  np.testing.assert_allclose(lines[1].get_ydata(), [2.3])


def test_gap_plot_leaves_out_the_validation_at_step_zero():
  """The gap plot's validation dots start after step 0 (the initial evaluation, before any update, is no gap of
  training); the later ones are the paired per-seed gaps 100 * (run - ref) / ref."""
  rows = [{"run": r, "label": r, "seed": 0, "status": "finished", "final_val_loss": v, "steps": 4, "tokens": 64}
          for r, v in (("a", 2.0), ("b", 2.2))]
  curves = {(r, 0): {"step": np.arange(4), "loss": np.full(4, v), "val_step": np.array([0, 4]),
                     "val_loss": np.array([v0, v])}
            for r, v0, v in (("a", 5.0, 2.0), ("b", 5.5, 2.2))}
  dots = report.loss_gap_figure({"experiment": "x"}, rows, curves, "a", 1).axes[0].get_lines()[2]
  np.testing.assert_allclose(dots.get_xdata(), [4 * 16 / 1e6])
  np.testing.assert_allclose(dots.get_ydata(), [10.0])


def test_a_report_without_the_reference_removes_the_earlier_gap_plot(tmp_path):
  """The reference's run folder gone: results.md said "no gaps", yet the earlier loss_gap.png stayed, plotting gaps
  to a run the table no longer has."""
  _sweep(tmp_path, {"a": [2.0], "b": [2.1]}, seeds=1)
  report.write_report(tmp_path)
  assert (tmp_path / report.GAP_PNG).is_file()
  shutil.rmtree(tmp_path / "a")
  written = report.write_report(tmp_path)
  assert not (tmp_path / report.GAP_PNG).exists() and tmp_path / report.GAP_PNG not in written


def test_read_results_gives_the_gaps_to_the_reference_the_tables_name(tmp_path):
  """After `report --reference b`, results.jsonl held the gaps to b; read_results returned them, and
  markdown_table printed them under "gap to a" (the sweep's reference)."""
  _sweep(tmp_path, {"a": [2.0], "b": [2.5], "c": [3.0]}, seeds=1)
  report.write_report(tmp_path, reference="b")
  meta, rows, _ = report.read_results(tmp_path)
  assert meta["reference"] == "a" and {r["run"]: r["gap_pct"] for r in rows}["c"] == pytest.approx(50.0)
  assert _table_row(report.markdown_table(meta, rows), "c").startswith("| c | c | none | 1 | 3.0000 | +50.00 |")


def test_a_run_whose_seeds_all_diverged_says_so_in_the_legend_and_sets_no_zoom(tmp_path):
  """Its legend entry was the plain label, and its step-0 loss (a short curve keeps it) widened every run's zoom."""
  _sweep(tmp_path, {"a": [2.0]}, seeds=1)
  _write_diverged(tmp_path, "b", 0, (9.0, 8.0))
  meta, rows, curves = report.collect(tmp_path)
  ax = report.loss_curves_figure(meta, rows, curves, 1).axes[0]
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b (diverged at step 2)"]
  assert ax.get_ylim()[1] < 4.0  # a's curve (2.25 to 3.0) sets it, not b's 9.0
  gap_ax = report.loss_gap_figure(meta, rows, curves, "a").axes[0]
  assert [t.get_text() for t in gap_ax.get_legend().get_texts()] == ["b (diverged at step 2)"]


def test_a_log_that_disagrees_with_its_summary_is_said(tmp_path):
  """metrics.jsonl cut short after the run: the table kept the summary's numbers with no word of it."""
  _sweep(tmp_path, {"a": [2.0], "b": [2.1]}, seeds=1)
  log = tmp_path / "b" / "seed0" / "metrics.jsonl"
  log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))
  report.write_report(tmp_path)
  text = (tmp_path / report.RESULTS_MD).read_text()
  assert ("**Log and summary disagree** (the table reads summary.json, the plots metrics.jsonl): b/seed0: its "
          "metrics.jsonl has no validation at step 4 (train records end at step 1)") in text
  _sweep(tmp_path / "fine", {"a": [2.0], "b": [2.1]}, seeds=1)
  report.write_report(tmp_path / "fine")
  assert "disagree" not in (tmp_path / "fine" / report.RESULTS_MD).read_text()


def test_switch_runs_draw_a_dotted_line_at_their_switch_step(tmp_path):
  """precision_switch plots drew nothing at the switch: "no switch" and "switch at 50 %" share one curve up to it,
  and nothing said where they part. The step is the summary's switch_step, or from the config of older summaries."""
  from experiments import precision_switch, sweep  # pylint: disable=g-import-not-at-top
  _sweep(tmp_path, {"a": [2.0], "b": [2.1], "c": [2.2]}, seeds=1, steps=8)
  for run, extra in (("b", {"switch_step": 6}), ("c", {"config": {"policy": {"switch_at": 0.25}}})):
    path = tmp_path / run / "seed0" / "summary.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **extra)))
  meta, rows, curves = report.collect(tmp_path)
  assert {r["run"]: r["switch_step"] for r in rows} == {"a": None, "b": 6, "c": 2}
  for fig in (report.loss_curves_figure(meta, rows, curves, 1), report.loss_gap_figure(meta, rows, curves, "a", 1)):
    ax = fig.axes[0]
    vertical = [(line.get_xdata()[0], line.get_color()) for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert vertical == [(6 * 16 / 1e6, "C1"), (2 * 16 / 1e6, "C2")]
    assert "dotted lines: a run's switch to BF16" in ax.get_xlabel()
  plain = _sweep(tmp_path / "plain", {"a": [2.0]}, seeds=1)
  assert "dotted" not in report.loss_curves_figure(*report.collect(plain), 1).axes[0].get_xlabel()
  # What the sweep writes: the step the policy switches at, None without a switch.
  switch = precision_switch.get_config("smoke")
  for run in switch.runs:
    config = switch.config(run, 0, tmp_path / "runs")
    summarize = sweep._summarize  # pylint: disable=protected-access
    summary = summarize(switch, run, 0, config, tmp_path / "nowhere", "finished", 1.0)
    assert summary["switch_step"] == config.policy.switch_step(config.steps)
    assert (summary["switch_step"] is None) == (run.overrides.get("switch_at") is None)
