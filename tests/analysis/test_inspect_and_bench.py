"""The numerics demo (fp4jax.analysis.inspection), the quantize benchmark script and its timing helpers, and the fused paths
they rely on (fake_quant == dequantize(quantize), NaN-propagating block maxima, nibble packing)."""

import dataclasses
import mmap
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import fp4jax
from fp4jax import grids
from fp4jax.analysis import inspection as fp4_inspect

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import common  # noqa: E402
from benchmarks import quantize as quantize_bench  # noqa: E402
from op_by_op import op_by_op  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABELS = [label for label, _ in fp4_inspect.DEFAULT_FORMATS]


def _run(args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # one device is enough; the suite's 8 simulated devices only slow start-up
  return subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _by_key(rows):
  return {(r["format"], r["rht"]): r for r in rows}


# ---------------------------------------------------------------- fp4jax.analysis.inspection


def test_inspect_cli_prints_every_format():
  proc = _run(["-m", "fp4jax.analysis.inspection", "--size", "64", "--cols", "256", "--outliers", "2", "--seed", "3"])
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("sample: normal 64x256")
  for label in LABELS:
    rows = [line for line in lines if line.startswith(label + " ")]
    assert [row.split()[len(label.split())] for row in rows] == ["no", "yes"], (label, rows)
    for row in rows:  # every numeric cell parses
      cells = row[len(label):].split()
      float(cells[1]), float(cells[2]), float(cells[3].rstrip("%")), float(cells[4].rstrip("%")), float(cells[5])


def test_inspect_cli_rejects_bad_columns(capsys):
  with pytest.raises(SystemExit):
    fp4_inspect.main(["--size", "8", "--cols", "100"])
  assert "multiple of 128" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    fp4_inspect.main(["--size", "8", "--cols", "128", "--seed", "-1"])  # NumPy's traceback before
  assert "--seed must be >= 0" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    fp4_inspect.main(["--size", "8", "--cols", "128", "--outlier-scale", "nan"])  # a table of nan before
  assert "--outlier-scale must be a finite number" in capsys.readouterr().err
  with pytest.raises(ValueError, match="outlier_scale must be finite"):
    fp4_inspect.sample_tensor(rows=4, cols=16, outliers=1, outlier_scale=float("inf"))


def test_nvfp4_beats_mxfp4_floor_on_normal_data():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 512)), jnp.float32)
  rows = _by_key(fp4_inspect.compare_formats(x, fp4_inspect.DEFAULT_FORMATS[:2] + fp4_inspect.DEFAULT_FORMATS[3:4]))
  nv, mx = rows[("nvfp4", False)], rows[("mxfp4 (floor)", False)]
  assert nv["rel_error"] < 0.9 * mx["rel_error"]
  assert nv["snr_db"] > mx["snr_db"]
  # Known magnitudes for Gaussian data: NVFP4 ~9.5%, MXFP4 ~11.5%, FP8 E4M3 ~2-3% relative error.
  assert 0.08 < nv["rel_error"] < 0.11 and rows[("fp8 (block)", False)]["rel_error"] < 0.04


def test_rht_on_the_outlier_tensor():
  """A 16-point RHT spreads each outlier over its tile: MXFP4's error drops and far fewer NVFP4 codes are zero.

  (NVFP4's relative error itself does not drop on this tensor: its 16-element E4M3-scaled blocks already isolate
  the outlier channels, and spreading a spike over a tile puts every element of the tile near the coarse top of the
  E2M1 grid. The demo's table shows it.)
  """
  x = fp4_inspect.sample_tensor(seed=0, rows=256, cols=512, outliers=8, outlier_scale=50.0)
  rows = _by_key(fp4_inspect.compare_formats(x))
  assert rows[("mxfp4 (floor)", True)]["rel_error"] < 0.85 * rows[("mxfp4 (floor)", False)]["rel_error"]
  assert rows[("mxfp4 (ceil)", True)]["rel_error"] < rows[("mxfp4 (ceil)", False)]["rel_error"]
  assert rows[("nvfp4", True)]["zero_frac"] < 0.6 * rows[("nvfp4", False)]["zero_frac"]


def test_compare_formats_columns():
  x = fp4_inspect.sample_tensor(seed=1, rows=32, cols=256, outliers=4)
  rows = fp4_inspect.compare_formats(x, [("nv", "nvfp4"), "mxfp4_ceil", ("fp8t", fp4jax.FP8(scaling="tensor"))])
  assert [(r["format"], r["rht"]) for r in rows] == [("nv", False), ("nv", True), ("mxfp4_ceil", False),
                                                     ("mxfp4_ceil", True), ("fp8t", False), ("fp8t", True)]
  for r in rows:
    assert r["snr_db"] == pytest.approx(-20 * np.log10(r["rel_error"]))
    assert 0 <= r["zero_frac"] <= 1 and 0 <= r["saturated_frac"] <= 1
  bits = {r["format"]: r["bits_per_element"] for r in rows}
  n = x.size
  assert bits == {"nv": 4.5 + 32 / n, "mxfp4_ceil": 4.25 + 32 / n, "fp8t": 8 + 64 / n}
  assert rows[2]["saturated_frac"] == 0.0  # the ceil scale rule never clips


def test_block_scaled_fp8_clips_nothing():
  """FP8 block scales are amax / 448: amax / 448 * 448 falling one float32 ulp short of amax counted as clipped."""
  x = fp4_inspect.sample_tensor(seed=0, rows=64, cols=256, outliers=4)
  rows = _by_key(fp4_inspect.compare_formats(x, [("fp8b", fp4jax.FP8(scaling="block")), ("nv", "nvfp4")]))
  assert rows[("fp8b", False)]["saturated_frac"] == 0.0 and rows[("fp8b", True)]["saturated_frac"] == 0.0
  assert rows[("nv", False)]["saturated_frac"] > 0.01  # NVFP4's E4M3 scales rounded down do clip


def test_compare_formats_exact_input_has_zero_error():
  # E2M1 grid values times a power of two per 16-block, each block holding +-6 * 2^k, and amax = 2688 = 6 * 448:
  # S_enc = 1, so every block scale is exactly 2^k (or 448) and NVFP4 reproduces the tensor bit for bit.
  rng = np.random.default_rng(2)
  x = rng.choice(np.concatenate([grids.E2M1_VALUES, -grids.E2M1_VALUES]), (8, 64)).astype(np.float32)
  x[:, ::16] = -6.0
  x *= np.exp2(rng.integers(-3, 4, (8, 4))).repeat(16, axis=1).astype(np.float32)
  x[0, :16] = x[0, :16] / np.abs(x[0, 0]) * 6.0 * 448.0
  row = fp4_inspect.compare_formats(jnp.asarray(x), [("nvfp4", "nvfp4")])[0]
  assert row["rel_error"] == 0.0 and row["snr_db"] == float("inf") and row["saturated_frac"] == 0.0
  assert row["zero_frac"] == pytest.approx(np.mean(x == 0))


def test_compare_formats_zero_and_nan_inputs_agree_across_columns():
  """An all-zero tensor is reproduced exactly (was rel. error NaN beside SNR inf); NaN gives NaN in both."""
  zero = fp4_inspect.compare_formats(jnp.zeros((4, 32)), ["nvfp4"])
  assert [(r["rel_error"], r["snr_db"]) for r in zero] == [(0.0, float("inf"))] * 2
  nan = fp4_inspect.compare_formats(jnp.full((4, 32), jnp.nan), ["nvfp4"])
  assert all(np.isnan(r["rel_error"]) and np.isnan(r["snr_db"]) for r in nan)


def test_compare_formats_of_tiny_and_huge_tensors():
  """Squares of |x| ~ 1e19 overflowed float32: rel. error NaN at 2^64 and 2^100; at 2^-84 they underflowed to 0.0,
  an exact-looking row. NVFP4 and MXFP4 scale with the tensor (by powers of two here): the error must stay."""
  x = np.asarray(np.random.default_rng(0).standard_normal((4, 64)), np.float32)
  fmts = ["nvfp4", "mxfp4"]
  want = [r["rel_error"] for r in fp4_inspect.compare_formats(jnp.asarray(x), fmts)]
  for scale in (2.0**-84, 2.0**64, 2.0**100):
    got = [r["rel_error"] for r in fp4_inspect.compare_formats(jnp.asarray(x * np.float32(scale)), fmts)]
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"scale {scale:g}")


def test_compare_formats_refuses_what_it_cannot_measure():
  """Zero signs passed the +-1 check (made inside the trace, where they have no values) and gave rel_error 1.0;
  an empty list failed in np.stack."""
  with pytest.raises(ValueError, match=r"\+1 or -1"):
    fp4_inspect.compare_formats(jnp.ones((4, 32)), ["nvfp4"], signs=jnp.zeros(16))
  with pytest.raises(ValueError, match="at least one format"):
    fp4_inspect.compare_formats(jnp.ones((4, 32)), [])
  # The quantizer's own message suggested pad=True, which compare_formats does not take.
  with pytest.raises(ValueError, match=r"compare_formats: axis 1 has length 40, not a multiple of the nvfp4 block "
                                       r"size 16 .*pad_to_blocks"):
    fp4_inspect.compare_formats(jnp.ones((4, 40)), ["nvfp4"])


def test_sample_tensor():
  x = np.asarray(fp4_inspect.sample_tensor(seed=4, rows=1000, cols=128, outliers=3, outlier_scale=40.0))
  col_rms = np.sqrt(np.mean(x**2, axis=0))
  assert x.dtype == np.float32 and np.sum(col_rms > 20) == 3 and np.all(col_rms[col_rms < 20] < 1.2)
  np.testing.assert_array_equal(x, fp4_inspect.sample_tensor(seed=4, rows=1000, cols=128, outliers=3,
                                                             outlier_scale=40.0))
  with pytest.raises(ValueError, match="outliers"):
    fp4_inspect.sample_tensor(rows=4, cols=8, outliers=9)


# ---------------------------------------------------------------- benchmarks


def test_quantize_benchmark_prints_its_table():
  proc = _run(["benchmarks/quantize.py", "--size", "64", "--repeats", "1", "--warmup", "1", "--dtypes", "float32"])
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert "quantize+dequantize throughput, 64x64 (0.0041M elements)" in out  # not "(0M elements)"
  assert "faults/call" in out and "malloc:" in out
  names = ["baseline x+1", "x+1 into a new buffer", "nvfp4 rne q+dq", "nvfp4 sr q+dq", "nvfp4 sr q+dq, threefry",
           "nvfp4 rne +rht q+dq", "nvfp4 rne +rht axis0 q+dq", "nvfp4 sr +rht q+dq", "nvfp4 rne 2d q+dq", "mxfp4 q+dq", "nvfp4 quantize", "nvfp4 dequantize",
           "nvfp4 dequantize(quantize)"]
  for name in names:
    row = [line for line in out.splitlines() if re.match(rf"float32\s+{re.escape(name)}\s+\d", line)]
    assert len(row) == 1, name
    ratio, ratio_min, faults = float(row[0].split()[-3]), float(row[0].split()[-2]), int(row[0].split()[-1])
    assert ratio > 0 and ratio_min > 0 and faults >= 0
    if name == "baseline x+1":
      assert ratio == ratio_min == 1.0


def test_quantize_benchmark_rejects_bad_size(capsys):
  with pytest.raises(SystemExit):
    quantize_bench.main(["--size", "48"])
  assert "multiple of 32" in capsys.readouterr().err


def test_ratio_table():
  timings = [common.Timing("base", "f32", 100, 0.5, 0.4, 0.6), common.Timing("slow", "f32", 100, 2.0, 1.0, 3.0),
             common.Timing("base", "bf16", 100, 0.25, 0.25, 0.25), common.Timing("fast", "bf16", 100, 0.125, 0.1, 1)]
  lines = common.ratio_table(timings, "base").splitlines()
  assert lines[0].split() == ["dtype", "computation", "median", "ms", "min-max", "ms", "Gelem/s", "vs", "baseline",
                              "(min)"]
  assert [line.split()[-2] for line in lines[2:]] == ["1.000", "0.250", "1.000", "2.000"]  # medians
  assert [line.split()[-1] for line in lines[2:]] == ["1.000", "0.400", "1.000", "2.500"]  # fastest runs
  assert lines[3].split()[2:4] == ["2000.00", "1000.00-3000.00"]
  assert len({len(line) for line in lines[:2]}) == 1  # the rule spans the header
  with pytest.raises(ValueError, match="no baseline"):
    common.ratio_table(timings[1:2], "base")
  with_faults = timings[:1] + [dataclasses.replace(timings[1], page_faults=16385.0)]
  lines = common.ratio_table(with_faults, "base").splitlines()
  assert lines[0].split()[-1] == "faults/call"
  assert [line.split()[-1] for line in lines[2:]] == ["-", "16385"]


def test_malloc_note_names_the_huge_page_tunable(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  assert "4 KiB" in common.malloc_note()
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
  assert "2 MiB" in common.malloc_note()
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
  assert "4 KiB" in common.malloc_note() and "mmap_max" not in common.malloc_note()
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0")
  assert "4 KiB" in common.malloc_note() and "no fresh mappings" in common.malloc_note()


def test_train_step_table_prints_faults_per_step(capsys):
  from benchmarks import train_step  # pylint: disable=g-import-not-at-top
  row = {"model": "small", "recipe": "nvfp4", "compile_s": 12.0, "step_ms": 101.9, "step_ratio": 1.13,
         "eval_ms": 24.3, "eval_ratio": 1.38, "tokens_per_s": 10054.0, "temp_mib": 77.01, "temp_ratio": 1.01,
         "argument_mib": 12.02, "ratio_median": 1.16, "ratio_min": 1.14, "faults_per_step": 19715.0, "loss": 5.91234,
         "loss_step": 13}
  train_step._print([row])  # pylint: disable=protected-access
  head, line = capsys.readouterr().out.splitlines()
  assert "temp MiB" in head and "args MiB" in head and " MB" not in head  # bytes / 2**20 are MiB
  assert head.split()[-1] == "faults" and line.split()[-1] == "19715" and line.split()[:2] == ["small", "nvfp4"]
  assert head.split()[-2] == "loss@step" and line.split()[-2] == "5.9123@13"  # speed with what the run trains to


def test_compile_time_benchmark_runs_loop_and_scan(capsys):
  """benchmarks/compile_time.py end to end on 2 bf16 blocks: both modes compile, step and start from one loss."""
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  assert compile_time.main(["--depths", "2", "--recipes", "bf16", "--steps", "1", "--warmup", "0",
                            "--compiles", "2"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert "2 fresh compiles per mode, alternating, persistent cache off" in out[0]
  assert out[1].split()[:5] == ["layers", "recipe", "compile", "s", "loop"] and "temp MiB loop" in out[1]
  row = out[3].split()
  assert row[:2] == ["2", "bf16"] and "same" in row and all(float(v) > 0 for v in row[2:12])
  assert float(row[3]) <= float(row[2]) and float(row[5]) <= float(row[4])  # min <= median
  assert float(row[6]) == pytest.approx(float(row[4]) / float(row[2]), rel=0.05)  # the ratio of the medians


def _compile_events():
  """[(event, seconds)] of every backend compile and persistent-cache hit while registered; unregister() stops."""
  events = []

  def on_event(event, **kwargs):
    del kwargs
    events.append((event, 0.0))

  def on_duration(event, seconds, **kwargs):
    del kwargs
    events.append((event, seconds))

  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)

  def unregister():
    jax.monitoring.unregister_event_listener(on_event)
    jax.monitoring.unregister_event_duration_listener(on_duration)
  return events, unregister


def test_compile_time_compiles_afresh_alternating_with_the_persistent_cache_off():
  """compile_time's timed compiles: the modes alternate round by round, each compile is a real XLA compile (the
  same function object again, so only clearing JAX's caches makes it one) and none is read from the persistent
  cache, which tests/conftest.py turns on and which serves this probe outside the guard."""
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  from benchmarks import compile_log  # pylint: disable=g-import-not-at-top
  assert jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # so the probe's program is cached
  x = jnp.ones((5, 11), jnp.float32)
  probes = {name: jax.jit(lambda x, k=k: jnp.cos(x) * k + 1) for k, name in enumerate(("a", "b"), start=3)}
  log = []

  def compile_fn(name):
    def run():
      log.append(name)
      return 1.0 + len(log)  # seconds as the benchmark would time them
    return lambda: (probes[name].lower(x).compile(), run())[1]

  events, unregister = _compile_events()
  try:
    for name in probes:  # outside the guard the persistent cache serves a compile seen before
      jax.clear_caches()
      probes[name].lower(x).compile()
      jax.clear_caches()
      probes[name].lower(x).compile()
    assert sum(e == compile_time.CACHE_HIT_EVENT for e, _ in events) >= 2, events
    del events[:]
    seconds, orders = compile_time.alternating_compiles({n: compile_fn(n) for n in probes}, rounds=3)
    compiles = [e for e, _ in events if e == compile_log.COMPILE_EVENT]
    hits = [e for e, _ in events if e == compile_time.CACHE_HIT_EVENT]
  finally:
    unregister()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
  assert log == ["a", "b", "b", "a", "a", "b"] and orders == [["a", "b"], ["b", "a"], ["a", "b"]]
  assert seconds == {"a": [2.0, 5.0, 6.0], "b": [3.0, 4.0, 7.0]}
  assert len(compiles) == 6 and not hits, events
  assert jax.config.jax_enable_compilation_cache  # restored for what runs next


def test_persistent_cache_off_refuses_a_compile_read_from_the_cache():
  from benchmarks import compile_time  # pylint: disable=g-import-not-at-top
  with pytest.raises(RuntimeError, match="read from it; the compile times would be cache reads"):
    with compile_time.persistent_cache_off():
      assert not jax.config.jax_enable_compilation_cache
      jax.monitoring.record_event(compile_time.CACHE_HIT_EVENT)  # as JAX reports a compile served from the cache
  assert jax.config.jax_enable_compilation_cache
  with pytest.raises(ValueError, match="at least 1 compile"):
    compile_time.alternating_compiles({"a": lambda: 1.0}, rounds=0)


def test_minor_faults_counts_one_fault_per_page_first_written():
  """A fresh anonymous mapping is mapped in by the kernel one 4 KiB page per first write; minor_faults sees each."""
  pages = 2048
  m = mmap.mmap(-1, pages * mmap.PAGESIZE)
  try:
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # with transparent huge pages "always", one fault could map 512 pages
      m.madvise(mmap.MADV_NOHUGEPAGE)
    before = common.minor_faults()
    for i in range(pages):
      m[i * mmap.PAGESIZE] = 1
    faults = common.minor_faults() - before
  finally:
    m.close()
  assert pages <= faults <= 1.1 * pages + 100, faults  # the slack: JAX's idle threads may fault a few pages too


def test_time_jitted_counts_the_faults_of_the_timed_calls_only(monkeypatch):
  """Faults per timed call: those of the call itself, not of copying its donated inputs, nor of the warm-up calls.

  The counter is simulated (the allocator decides whether XLA's fresh output is faulted in; a CI run saw one call
  of two reuse memory), so the bookkeeping is tested exactly: each call adds 100, each input copy 7.
  """
  counter = [0]
  monkeypatch.setattr(common, "minor_faults", lambda: counter[0])
  copy = common._fresh_copy  # pylint: disable=protected-access

  def counted_copy(a):
    counter[0] += 7
    return copy(a)

  monkeypatch.setattr(common, "_fresh_copy", counted_copy)

  def call_faults():
    counter[0] += 100
    return np.float32(0)

  def fn(x):  # the output depends on the callback, so it has run when the output is ready
    return x + io_callback(call_faults, jax.ShapeDtypeStruct((), jnp.float32))

  timing = common.time_jitted(fn, (jnp.ones((4, 4)),), name="counted", warmup=2, repeats=3)
  assert timing.page_faults == 100.0, timing
  assert counter[0] == 5 * (100 + 7)  # every call and every copy happened


class _Result:
  """A stand-in for a call's result that logs when it is freed."""

  def __init__(self, events):
    self.events = events

  def __del__(self):
    self.events.append("free")


def _no_jit(f, donate_argnums=(), events=None):
  """Stands in for jax.jit in time_jitted: `.lower(*args).compile()` gives back `f` (noted in `events`)."""
  del donate_argnums

  def compile_():
    if events is not None:
      events.append("compile")
    return f
  return types.SimpleNamespace(lower=lambda *args: types.SimpleNamespace(compile=compile_))


def test_time_jitted_compiles_before_the_clock_even_without_warmup(monkeypatch):
  events = []
  monkeypatch.setattr(common.time, "perf_counter", lambda: events.append("clock") or float(len(events)))
  monkeypatch.setattr(common.jax, "jit", lambda f, donate_argnums=(): _no_jit(f, events=events))
  common.time_jitted(lambda x: x, (jnp.ones(4),), name="r", donate_argnums=(), warmup=0, repeats=2)
  assert events == ["compile", "clock", "clock", "clock", "clock"]


@pytest.mark.parametrize("helper", ["time_jitted", "interleaved_medians"])
def test_timers_stop_before_the_result_is_freed(monkeypatch, helper):
  """Freeing a large result (XLA:CPU unmaps 64 MiB in ~4.5 ms) is not the computation's time: every timed call
  reads the clock twice before its result is freed."""
  events = []
  clock = iter(range(10**6))

  def perf_counter():
    events.append("clock")
    return float(next(clock))

  monkeypatch.setattr(common.time, "perf_counter", perf_counter)
  monkeypatch.setattr(common.jax, "block_until_ready", lambda x: x)
  fn = lambda *args: _Result(events)
  if helper == "time_jitted":
    monkeypatch.setattr(common.jax, "jit", _no_jit)
    common.time_jitted(fn, (jnp.ones(4),), name="r", donate_argnums=(), warmup=1, repeats=3)
  else:
    common.interleaved_medians({"a": (fn, ()), "b": (fn, ())}, steps=3, warmup=1)
  seen = "".join("c" if e == "clock" else "f" for e in events)
  # Warmup calls (time_jitted: untimed; interleaved_medians: one clock read) first, then each timed call: clock,
  # clock, free.
  warmup, timed = (r"f", 3) if helper == "time_jitted" else (r"cf", 6)
  assert re.fullmatch(rf"({warmup})*(ccf){{{timed}}}", seen), seen


def test_time_jitted_and_hlo_passes():
  x = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)
  t = common.time_jitted(lambda x: x * 2, (x,), name="double", warmup=1, repeats=3)
  assert t.elements == 4096 and t.min_s <= t.median_s <= t.max_s and t.elements_per_s > 0
  assert np.asarray(x)[1, 1] == 65  # donation consumed copies, never the caller's array
  with pytest.raises(ValueError, match="repeats"):
    common.time_jitted(lambda x: x, (x,), name="x", repeats=0)
  lines = common.hlo_passes(lambda x: fp4jax.fake_quant(x, "nvfp4"), (x,), x.size)
  full = [line for line in lines if line.startswith("*")]
  assert full and all("fusion" in line or "copy" in line for line in lines)
  assert not any(line.split()[1].startswith("copy") for line in full)  # no full-size copy of the data


def test_time_jitted_counts_the_first_arguments_elements_by_default():
  """`elements` defaults to the first argument's size, not another argument's (a key, a second operand)."""
  t = common.time_jitted(lambda x, y: x + y.sum(), (jnp.ones((4, 8)), jnp.ones(3)), name="two", donate_argnums=(),
                         warmup=0, repeats=1)
  assert t.elements == 32


def test_time_jitted_reports_the_median_min_and_max_of_the_timed_calls(monkeypatch):
  """Timing.median_s is the median of the timed calls (not their mean: one slow call on a shared machine must not
  move it), next to their min and max. Simulated clock: the three timed calls take 1, 2 and 6 s."""
  clock = iter([0.0, 1.0, 10.0, 12.0, 20.0, 26.0])
  monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
  monkeypatch.setattr(common.jax, "jit", _no_jit)
  t = common.time_jitted(lambda x: x, (jnp.ones(4),), name="r", donate_argnums=(), warmup=1, repeats=3)
  assert (t.median_s, t.min_s, t.max_s) == (2.0, 1.0, 6.0)
  assert t.elements_per_s == 4 / 2.0


# ---------------------------------------------------------------- the fused paths the benchmark measures


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("fmt,kw", [
    ("nvfp4", {}), ("nvfp4", dict(axis=0, pad=True)), ("nvfp4", dict(block_2d=True, rounding="stochastic")),
    ("mxfp4", dict(axis=0, rounding="stochastic", random_bits=8)), ("mxfp4_ceil", dict(block_2d=True)),
    ("fp8", dict(pad=True)), ("fp8_tensor", {})])
def test_fake_quant_is_bit_identical_to_dequantize_quantize(fmt, kw):
  rng = np.random.default_rng(5)
  x = (rng.standard_t(2, (40, 130) if kw.get("pad") else (64, 128)) * 10.0**rng.uniform(-3, 3)).astype(np.float32)
  x.reshape(-1)[::17] = 0.0
  x.reshape(-1)[5::23] = -0.0
  if "rounding" in kw:
    kw = dict(kw, key=jax.random.key(9))
  composed = jax.jit(lambda x: fp4jax.dequantize(fp4jax.quantize(x, fmt, **kw), x.dtype))
  fused = jax.jit(lambda x: fp4jax.fake_quant(x, fmt, **kw))
  for dtype in (jnp.float32, jnp.bfloat16):
    xd = jnp.asarray(x, dtype)
    want, got = composed(xd), fused(xd)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "fp8_tensor"])
def test_nan_propagates_through_large_tensors(fmt):
  """XLA:CPU's own max reductions drop NaN above ~64K elements; the quantizer's must not."""
  x = np.random.default_rng(6).standard_normal((512, 512)).astype(np.float32)
  x[300, 77] = np.nan
  eager = [op_by_op(lambda x: fp4jax.quantize(x, fmt))] if fmt == "nvfp4" else []
  for f in eager + [jax.jit(lambda x: fp4jax.quantize(x, fmt))]:
    q = f(jnp.asarray(x))
    assert np.isnan(float(q.amax))
    assert np.all(np.isnan(np.asarray(fp4jax.dequantize(q))))
  assert np.all(np.isnan(np.asarray(jax.jit(lambda x: fp4jax.fake_quant(x, fmt))(jnp.asarray(x)))))


@pytest.mark.parametrize("shape,axis", [((6, 8), 1), ((6, 8), 0), ((4, 6, 10), 2), ((4, 6, 10), 1), ((2, 16), -1)])
def test_nibble_packing_layout(shape, axis):
  codes = np.random.default_rng(7).integers(0, 16, shape, dtype=np.uint8)
  moved = np.moveaxis(codes, axis, -1)
  want = np.moveaxis(moved[..., 0::2] | (moved[..., 1::2] << 4), -1, axis)  # element 2i low nibble, 2i+1 high
  jitted = (jax.jit(grids.pack_nibbles, static_argnums=1), jax.jit(grids.unpack_nibbles, static_argnums=1))
  for pack, unpack in [(grids.pack_nibbles, grids.unpack_nibbles), jitted]:
    packed = pack(jnp.asarray(codes), axis)
    assert packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed), want)
    np.testing.assert_array_equal(np.asarray(unpack(packed, axis)), codes)


def test_e2m1_decode_is_the_table():
  codes = jnp.arange(16, dtype=jnp.uint8)
  want = np.concatenate([grids.E2M1_VALUES, -grids.E2M1_VALUES])
  got = np.asarray(jax.jit(grids.e2m1_decode)(codes))
  np.testing.assert_array_equal(_bits(got), _bits(want.astype(np.float32)))  # code 8 is -0.0


def test_trainer_loop_table_and_refusals():
  """benchmarks/trainer_loop.py: a row's ratio and host work from the two modes' runs; bad settings refused."""
  from benchmarks import trainer_loop  # pylint: disable=g-import-not-at-top
  best = {"overlapped": {"period": 0.012, "step": 0.012, "loss": 2.5},
          "synchronous": {"period": 0.015, "step": 0.0135, "loss": 2.5}}
  assert trainer_loop.row("bf16", best) == ["bf16", "12.00", "15.00", "0.800", "13.50", "1.50", "2.500000", "same"]
  best["synchronous"]["loss"] = 2.6  # the loop must not change what the device computes: shown, not hidden
  assert trainer_loop.row("bf16", best)[-1] == "DIFFERS: 2.600000"
  with pytest.raises(ValueError, match="mode must be one of"):
    trainer_loop.run_once("tiny", "bf16", "async", steps=20, skip=2, batch_size=8, cache=None)
  with pytest.raises(ValueError, match="at least 4 timed steps"):
    trainer_loop.run_once("tiny", "bf16", "overlapped", steps=5, skip=2, batch_size=8, cache=None)
  with pytest.raises(ValueError, match="rounds must be >= 1"):
    trainer_loop.loop_periods("tiny", "bf16", steps=20, skip=2, rounds=0, batch_size=8)


def test_trainer_loop_heading_counts_the_periods_run_once_counts(monkeypatch, capsys, tmp_path):
  """The heading prints run_once's count: the hook fires once per step and once more after the last (steps + 1
  times), so `steps - skip - 1` periods are counted, not the `steps - skip - 2` the heading's formula said. The runs
  train on --corpus."""
  from benchmarks import trainer_loop  # pylint: disable=g-import-not-at-top
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("abc" * 1000)
  corpora = []

  def fake_train(config, hooks, log, compile_cache):  # the trainer's record calls, without a model
    del log, compile_cache
    corpora.append(config.data.corpus)
    for step in range(config.steps):
      hooks[0](step, {"step_time": 0.01, "loss": 2.5})
    hooks[0](config.steps, {"val_loss": 2.4})  # the final record after the last step
    return {"final_loss": 2.5}

  monkeypatch.setattr(trainer_loop.trainer, "train", fake_train)
  assert trainer_loop.main(["--recipes", "bf16", "--steps", "12", "--skip", "2", "--rounds", "1",
                            "--corpus", str(corpus)]) == 0
  assert "12 steps (9 periods counted)" in capsys.readouterr().out.splitlines()[0]
  assert corpora == [str(corpus)] * 2


@pytest.mark.parametrize("script,argv,flag", [
    ("linear_layer", ["--tokens", "64", "--k", "64", "--n", "64", "--iters", "0"], "--iters"),
    ("linear_layer", ["--warmup", "-1"], "--warmup"),
    ("linear_layer", ["--runs", "0"], "--runs"),
    ("train_step", ["--models", "tiny", "--steps", "0", "--warmup", "0"], "--steps"),
    ("train_step", ["--runs", "0"], "--runs"),
    ("train_step", ["--warmup", "-1"], "--warmup"),
    ("train_step", ["--grad-accum", "1", "0"], "--grad-accum"),
    ("quantize", ["--size", "64", "--warmup", "-1"], "--warmup"),
    ("trainer_loop", ["--steps", "5", "--skip", "2"], "--steps"),
    ("trainer_loop", ["--rounds", "0"], "--rounds"),
    ("trainer_loop", ["--skip", "-1"], "--skip"),
])
def test_benchmarks_refuse_bad_counts(script, argv, flag, capsys):
  """A bad count is a usage error naming the flag (was a StatisticsError / KeyError traceback after the run)."""
  module = __import__(f"benchmarks.{script}", fromlist=["main"])
  with pytest.raises(SystemExit) as exit_info:
    module.main(argv)
  assert exit_info.value.code == 2
  assert f"error: {flag} must" in capsys.readouterr().err


def test_linear_layer_heading_prints_the_resolved_gemm_mode(capsys):
  """gemm_mode="auto" resolves per machine (bf16 on AVX-512 CPUs, f32 on others): the heading says which ran."""
  from benchmarks import linear_layer  # pylint: disable=g-import-not-at-top
  from fp4jax import gemm as gemm_lib  # pylint: disable=g-import-not-at-top
  from fp4jax import recipes as recipes_lib  # pylint: disable=g-import-not-at-top
  auto = recipes_lib.get_recipe("nvfp4")
  assert linear_layer.gemm_mode(auto) == f"{gemm_lib.resolve_gemm_mode(auto)} (auto)"
  assert linear_layer.gemm_mode(recipes_lib.get_recipe("nvfp4:gemm_mode=f32")) == "f32"
  linear_layer.main(["--tokens", "32", "--k", "32", "--n", "32", "--iters", "1", "--warmup", "0",
                     "--recipes", "nvfp4:gemm_mode=f32"])
  assert capsys.readouterr().out.splitlines()[1] == "GEMM mode: nvfp4:gemm_mode=f32 f32"


@pytest.mark.slow
def test_trainer_loop_benchmark_runs_both_modes(capsys):
  from benchmarks import trainer_loop  # pylint: disable=g-import-not-at-top
  assert trainer_loop.main(["--recipes", "bf16", "--steps", "8", "--skip", "2", "--rounds", "1"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("trainer loop, tiny, batch 8, 8 steps (5 periods counted)") and out[1].split()[0] == "recipe"
  row = out[3].split()
  assert row[0] == "bf16" and row[-1] == "same" and all(float(v) > 0 for v in row[1:5])


@pytest.mark.slow
def test_train_step_benchmark_rows_per_grad_accum(capsys):
  """`--grad-accum 1 4`: a row per recipe and micro-batch count, against the first; 4 micro-batches hold fewer
  activations at a time, so XLA's temp memory is smaller."""
  from benchmarks import train_step  # pylint: disable=g-import-not-at-top
  rows = train_step.benchmark(["tiny"], ["bf16"], steps=1, warmup=0, batch_size=8, seq_len=32, grad_accums=(1, 4))
  assert [r["recipe"] for r in rows] == ["bf16", "bf16/accum4"]
  assert rows[0]["step_ratio"] == 1.0 and rows[1]["temp_mib"] < rows[0]["temp_mib"]
  assert all(np.isfinite(r["loss"]) for r in rows)
  train_step._print(rows)  # pylint: disable=protected-access
  assert "bf16/accum4" in capsys.readouterr().out


@pytest.mark.slow
def test_step_memory_benchmark_compiles_without_running(capsys):
  """benchmarks/step_memory.py: abstract arrays only; a step of 2 micro-batches needs less scratch than the whole
  batch's, and the table has a row per (recipe, grad_accum) with ratios to the first."""
  from benchmarks import step_memory  # pylint: disable=g-import-not-at-top
  assert step_memory.main(["--model", "tiny", "--layers", "1", "--recipes", "bf16", "--grad-accum", "1", "2",
                           "--batch-size", "4", "--seq-len", "32"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "tiny (n_layers=1), batch 4 x 32 tokens" in lines[0]
  one, two = (line.split() for line in lines[3:5])
  assert one[:2] == ["bf16", "1"] and two[:2] == ["bf16", "2"] and one[4] == "1.00"
  assert float(two[3]) < float(one[3])  # temp MiB
  row = step_memory.step_memory("tiny", "bf16", batch_size=4, seq_len=32, model_overrides={"n_layers": 1})
  assert row["peak"] == row["argument"] + row["output"] - row["alias"] + row["temp"] and row["alias"] > 0


def test_linear_layer_recipes_take_turns_block_by_block(monkeypatch):
  """Each recipe's block median comes from its own calls of that block; the order rotates from block to block."""
  from benchmarks import linear_layer  # pylint: disable=g-import-not-at-top
  clock, order = [0.0], []
  cost = {"bf16": (1.0, 2.0), "nvfp4": (1.5, 3.0)}  # seconds per call in block 0 and block 1

  def fake(name):
    calls = [0]

    def step(x, w, g, key):
      del x, w, g, key
      calls[0] += 1
      if calls[0] > 1:  # the first call is the warmup
        order.append(name)
        clock[0] += cost[name][(calls[0] - 2) // 2]
      return 0.0
    return step

  monkeypatch.setattr(linear_layer.time, "perf_counter", lambda: clock[0])
  block_s = linear_layer.time_blocks({"bf16": fake("bf16"), "nvfp4": fake("nvfp4")}, None, None, None, iters=2,
                                     warmup=1, runs=2)
  assert order == ["bf16"] * 2 + ["nvfp4"] * 4 + ["bf16"] * 2
  assert block_s == {"bf16": [1.0, 2.0], "nvfp4": [1.5, 3.0]}


def test_block_orders_rotate_and_ratios_pair_blocks():
  """Every run in every block, the first rotating by one per block (and by the offset); ratios pair block b with the
  baseline's block b (a drift between blocks cancels)."""
  from benchmarks import interleave  # pylint: disable=g-import-not-at-top
  assert interleave.block_orders(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                         ["a", "b", "c"]]
  assert interleave.block_orders(["a", "b"], 2, offset=1) == [["b", "a"], ["a", "b"]]
  ratios = interleave.paired_ratios({"base": [1.0, 2.0], "x": [1.5, 3.0]}, "base")
  assert ratios == {"base": [1.0, 1.0], "x": [1.5, 1.5]}
