"""benchmarks/compile_log.py: the per-compile recorder behind the suite's compile-time figures, and its summary."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import compile_log


def _probe():
  def compile_log_probe(x):
    return jnp.sin(x) * 3 + 1
  return compile_log_probe


def test_records_each_compile_with_its_test_and_the_cache_hits(tmp_path):
  if compile_log._listeners:  # pylint: disable=protected-access
    pytest.skip("the session already records (FP4JAX_COMPILE_LOG is set)")
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # so the probe's executable is cached
  try:
    path = compile_log.start(tmp_path)
    x = jnp.ones((7, 13), jnp.float32)
    # Two function objects with the same graph: the second misses JAX's in-memory cache and reads the persistent one.
    jax.block_until_ready(jax.jit(_probe())(x))
    jax.block_until_ready(jax.jit(_probe())(x))
  finally:
    compile_log.stop()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
  jax.block_until_ready(jax.jit(_probe())(x + 1))  # after stop(): not recorded
  assert path.parent == tmp_path
  records = [r for r in compile_log.read(tmp_path) if "compile_log_probe" in r["function"]]
  assert len(records) == 2
  assert records[1]["cache_hit"]
  # JAX stores the writer's compile time in whole seconds: this sub-second compile spared "0 s" (not a negative).
  assert records[0]["saved_seconds"] == 0 and records[1]["saved_seconds"] == 0
  assert all(r["seconds"] > 0 for r in records)
  # pytest's id of the running test; under `-n 2 --dist loadgroup` xdist appends "@<group>".
  assert all(r["test"].split("@")[0].endswith("::test_records_each_compile_with_its_test_and_the_cache_hits")
             for r in records)


def test_start_twice_is_an_error(tmp_path):
  if compile_log._listeners:  # pylint: disable=protected-access
    pytest.skip("the session already records (FP4JAX_COMPILE_LOG is set)")
  compile_log.start(tmp_path)
  try:
    with pytest.raises(RuntimeError, match="already"):
      compile_log.start(tmp_path)
  finally:
    compile_log.stop()


RECORDS = [
    {"seconds": 8.0, "function": "step", "cache_hit": False, "test": "tests/a.py::test_x"},
    {"seconds": 2.0, "function": "step", "cache_hit": False, "test": "tests/a.py::test_y"},
    {"seconds": 1.5, "function": "loss", "cache_hit": False, "test": "tests/b.py::test_z"},
    {"seconds": 0.25, "function": "step", "cache_hit": True, "saved_seconds": 7.5, "test": "tests/b.py::test_z"},
    {"seconds": 0.125, "function": "loss", "cache_hit": True, "test": "tests/b.py::test_w"},  # an older record
    {"seconds": 0.5, "function": "init", "cache_hit": False, "test": ""},
]


def test_summary_sums_misses_by_module_function_and_test():
  summary = compile_log.summarize(RECORDS, top=2)
  assert summary["compiles"] == 4 and summary["seconds"] == pytest.approx(12.0)
  assert summary["cache_hits"] == 2 and summary["hit_seconds"] == pytest.approx(0.375)
  assert summary["saved_seconds"] == pytest.approx(7.5)
  assert summary["by_module"] == [("tests/a.py", 10.0, 2), ("tests/b.py", 1.5, 1)]  # top 2 of 3
  assert summary["by_function"] == [("step", 10.0, 2), ("loss", 1.5, 1)]
  assert compile_log.summarize(RECORDS)["by_test"][-1] == ("(outside a test)", 0.5, 1)


def test_cli_prints_the_tables_and_refuses_an_empty_folder(tmp_path, capsys):
  (tmp_path / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
  compile_log.main([str(tmp_path), "--top", "3"])
  out = capsys.readouterr().out
  assert out.startswith("4 compiles, 12.0 s; 2 served by the persistent cache in 0.4 s, sparing 7.5 s of compiling")
  assert "| tests/a.py | 10.0 | 2 |" in out and "| step | 10.0 | 2 |" in out
  with pytest.raises(SystemExit):
    compile_log.main([str(tmp_path / "empty")])
  assert "no compile records" in capsys.readouterr().err
