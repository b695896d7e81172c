"""Test setup: 8 simulated CPU devices (for mesh tests) must be configured before jax is imported.

Tests mirror the packages (tests/fp4jax, tests/pretrain, tests/analysis, tests/pallas_kernels, tests/experiments);
`reference.py` (the NumPy float64 reference) sits here and is importable from all of them.

Nearly all of the suite's time is XLA compilation, and many tests (and the subprocesses they launch: README blocks,
`python -m fp4jax`, benchmark dry runs, notebooks) compile the same graphs. One persistent compilation cache per
session, in a fresh temporary folder made by the first process (inherited by xdist workers and subprocesses),
compiles each graph once; it is deleted when the session ends, so no run reads another run's executables. An entry
that cannot be read (another worker still writing it) is a cache miss: JAX warns and compiles. A folder set from
outside (`JAX_COMPILATION_CACHE_DIR=...`) is used as it is and kept, so a rerun skips the compiles of every graph
that did not change; name one folder per machine type, since JAX's cache key leaves out the CPU's instruction set.

`FP4JAX_COMPILE_LOG=DIR` records every compile with the test that made it; `python benchmarks/compile_log.py DIR`
sums them up.

Tests that train a model are marked slow, so that `pytest -m "not slow"` stays quick; `pytest_runtest_protocol`
below fails a test that trains without the mark.

Scheduling for `pytest -n 2` (pyproject's addopts: `--dist loadgroup --no-loadscope-reorder`): see
`pytest_collection_modifyitems` below.
"""

import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_TESTS))
sys.path.insert(1, _TESTS)

# Set by the first conftest import (a plain run, or the xdist controller before it starts its workers, which inherit
# it); a cache folder set from outside is left alone.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp4jax-tests-jax-cache-")
# Small graphs too: a loaded 2-core machine compiles even tiny steps in ~0.1 s, and their count adds up.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")

if os.environ.get("FP4JAX_COMPILE_LOG"):  # every compile of this test process, per test (benchmarks/compile_log.py)
  from benchmarks import compile_log  # pylint: disable=g-import-not-at-top,wrong-import-position
  compile_log.start(os.environ["FP4JAX_COMPILE_LOG"])


def pytest_sessionfinish(session):
  del session
  if _OWN_CACHE:  # only the process that made the folder removes it
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


_RUNNING = {"slow": True}  # whether the test now running (setup, call, teardown) is marked slow


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Keeps `pytest -m "not slow"` quick: a test that is not marked slow and starts training fails, naming the mark.

  "Starts training" is building a train step (`steps.Phases._cached_train_step`, what every `trainer.train` run does
  before its first step), also from a module fixture the test sets up; a run refused before that (bad config, resume
  errors) is fine in a fast test. Subprocess runs are not seen: tests that launch them are marked by hand.
  """
  del nextitem
  _guard_train_steps()
  _RUNNING["slow"] = item.get_closest_marker("slow") is not None
  yield
  _RUNNING["slow"] = True


def _guard_train_steps():
  steps = sys.modules.get("fp4jax.pretrain.steps")  # imported at collection by every module that trains
  if steps is None or getattr(steps.Phases._cached_train_step, "guarded", False):
    return
  build = steps.Phases._cached_train_step

  def cached_train_step(self, *args, **kwargs):
    if not _RUNNING["slow"]:
      raise AssertionError("This test trains a model (it builds a train step): mark it @pytest.mark.slow, so that "
                           "`pytest -m \"not slow\"` stays quick (tests/conftest.py).")
    return build(self, *args, **kwargs)

  cached_train_step.guarded = True
  steps.Phases._cached_train_step = cached_train_step


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
  """Under xdist's loadgroup scheduling, orders and groups the tests so two workers end together.

  Each unit of work goes to one worker, which takes the next unit in the queue when it is nearly done. Slow tests
  (minutes each) are units of their own and come first; tests marked `xdist_group` (sharing an expensive fixture)
  are one unit, queued with them. The fast tests follow as one unit per module (module fixtures and compile caches
  then serve the whole module), modules with more tests first, so that the last units are short and neither worker
  waits long for the other at the end. Plain runs (no xdist) keep pytest's order.
  """
  if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
    return
  module = lambda item: item.nodeid.split("::")[0]
  sizes = {}
  for item in items:
    sizes[module(item)] = sizes.get(module(item), 0) + 1
  early, late = [], []
  for item in items:
    if item.get_closest_marker("xdist_group") is not None or item.get_closest_marker("slow") is not None:
      early.append(item)
    else:
      item.add_marker(pytest.mark.xdist_group(module(item)))
      late.append(item)
  late.sort(key=lambda item: -sizes[module(item)])  # stable: a module's tests keep their order
  items[:] = early + late


@pytest.fixture(scope="session")
def compile_cache():
  """One CompileCache per worker for the smoke sweeps (tests/experiments, the README's main job): each graph of
  the tiny smoke model compiles once per process."""
  from fp4jax.pretrain import steps  # pylint: disable=g-import-not-at-top
  return steps.CompileCache()


@pytest.fixture(scope="session")
def formats_smoke_sweep(tmp_path_factory, compile_cache):
  """The formats smoke sweep (the README's main job), trained once: (its folder, run_sweep's records).

  The tests using it share the xdist_group readme_blocks.MAIN_JOB_GROUP, so one worker trains it; they copy the
  folder rather than change it. The README test runs the README's command on a copy: it finds every run finished
  with the same settings (a different setting would be an error) and only writes the report.
  """
  from experiments import formats  # pylint: disable=g-import-not-at-top
  from experiments import sweep  # pylint: disable=g-import-not-at-top
  folder = tmp_path_factory.mktemp("formats_smoke")
  records = sweep.run_sweep(formats.get_config("smoke"), folder, compile_cache=compile_cache, progress=False,
                            log=None)
  return folder, records
