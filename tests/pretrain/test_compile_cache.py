"""The entry points' persistent compilation cache (fp4jax.pretrain.compile_cache)."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from fp4jax.pretrain import compile_cache

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_config():
  """Restores jax_compilation_cache_dir after a test changed it (this process's cache is already open)."""
  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)


def test_default_folder_is_per_cpu_type(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  folder = compile_cache.default_dir()
  assert folder.parent == tmp_path / "fp4jax" and folder.name == f"xla-{compile_cache.cpu_id()}"
  assert compile_cache.cpu_id() == compile_cache.cpu_id() and len(compile_cache.cpu_id()) == 12


def test_jaxs_own_setting_wins_then_off_then_a_folder(monkeypatch, tmp_path, cache_config):
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
  assert compile_cache.enable() == tmp_path / "jax" and not (tmp_path / "mine").exists()
  jax.config.update("jax_compilation_cache_dir", None)
  for off in ("off", "OFF", "0", "none"):
    monkeypatch.setenv(compile_cache.ENV, off)
    assert compile_cache.enable() is None and jax.config.jax_compilation_cache_dir is None
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
  assert compile_cache.enable() == tmp_path / "mine" and (tmp_path / "mine").is_dir()
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def test_an_unusable_folder_runs_without_the_cache(monkeypatch, tmp_path, cache_config):
  jax.config.update("jax_compilation_cache_dir", None)
  (tmp_path / "file").write_text("in the way")
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "file" / "cache"))
  notes = []
  assert compile_cache.enable(notes.append) is None and jax.config.jax_compilation_cache_dir is None
  assert "no compilation cache" in notes[0] and f"{compile_cache.ENV}=off" in notes[0]


def test_a_folder_of_no_user_is_a_clear_error(monkeypatch, cache_config):
  # Once a bare RuntimeError traceback from pathlib (and, on one process of a multi-process run, all of them
  # aborted after FP4JAX_SHUTDOWN_TIMEOUT): "~user" of a user this machine does not have names no folder.
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setenv(compile_cache.ENV, "~fp4jax-no-such-user/xla")
  with pytest.raises(ValueError, match=r"^FP4JAX_COMPILE_CACHE=~fp4jax-no-such-user/xla: no home folder for "
                     r"fp4jax-no-such-user on this machine; give an existing folder \(or FP4JAX_COMPILE_CACHE=off\)"):
    compile_cache.enable()
  assert jax.config.jax_compilation_cache_dir is None


def test_a_multi_process_cpu_run_goes_without_the_cache(monkeypatch, tmp_path, cache_config):
  # JAX writes entries from process 0 only and the others' keys differ: with a cache, process 0 waited at the first
  # collective while the others compiled, and gloo's fixed 30 s setup deadline aborted the run.
  before = jax.config.jax_enable_compilation_cache
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  notes = []
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    assert compile_cache.enable(log=notes.append) is None and not jax.config.jax_enable_compilation_cache
    assert notes == ["Note: no compilation cache in a multi-process CPU run (fp4jax.pretrain.compile_cache says "
                     "why)."]
    monkeypatch.setenv(compile_cache.ENV, "~fp4jax-no-such-user/xla")  # still an error on every process
    jax.config.update("jax_compilation_cache_dir", None)
    with pytest.raises(ValueError, match="no home folder"):
      compile_cache.enable()
  finally:
    jax.config.update("jax_enable_compilation_cache", before)


def test_prune_deletes_the_oldest_files_first(tmp_path):
  for i in range(5):
    path = tmp_path / f"k{i}-cache"
    path.write_bytes(b"x" * 100)
    os.utime(path, (1000 + i, 1000 + i))
  assert compile_cache.prune(tmp_path, max_bytes=250) == 3
  assert sorted(p.name for p in tmp_path.iterdir()) == ["k3-cache", "k4-cache"]
  assert compile_cache.prune(tmp_path, max_bytes=250) == 0


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
  """End to end, as the CLI uses it: the first process writes the program, the second finds it (a cache hit)."""
  code = ("import jax, jax.numpy as jnp\n"
          "from fp4jax.pretrain import compile_cache\n"
          "hits = []\n"
          "jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if 'cache_hits' in e else None)\n"
          "print(compile_cache.enable())\n"
          "jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(8.0)).block_until_ready()\n"
          "print(len(hits))\n")
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=str(REPO))
  env.pop(compile_cache.ENV, None)
  runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split() for _ in range(2)]
  folder = tmp_path / "fp4jax" / f"xla-{compile_cache.cpu_id()}"
  assert runs[0] == [str(folder), "0"] and runs[1][0] == str(folder) and int(runs[1][1]) > 0, runs
  assert any(p.name.endswith("-cache") for p in folder.iterdir())


def test_the_entry_points_turn_it_on_before_they_compile(monkeypatch, tmp_path):
  from experiments import formats  # pylint: disable=g-import-not-at-top
  from experiments.probes import run as probes_run  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import cli  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(compile_cache, "enable", lambda log=None: calls.append(log))
  with pytest.raises(SystemExit):  # help compiles nothing: no cache folder either
    cli.main(["train", "--help"])
  assert not calls
  assert cli.main(["eval", "--out", str(tmp_path / "none")]) == cli.EXIT_USAGE
  assert len(calls) == 1
  formats.main(["--preset", "smoke", "--out", str(tmp_path / "sweep"), "--list"])
  assert len(calls) == 2
  probes_run.main(["--preset", "smoke", "--out", str(tmp_path / "probes"), "--list"])
  assert len(calls) == 3
