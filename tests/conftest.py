"""Test setup: 8 simulated CPU devices (for mesh tests) must be configured before jax is imported.

Tests mirror the packages (tests/fp4jax, tests/pretrain, tests/analysis, tests/pallas_kernels, tests/experiments);
`reference.py` (the NumPy float64 reference) sits here and is importable from all of them.

Nearly all of the suite's time is XLA compilation, and many tests (and the subprocesses they launch: README blocks,
`python -m fp4jax`, benchmark dry runs, notebooks) compile the same graphs. One persistent compilation cache per
session, in a fresh temporary folder made by the first process (inherited by xdist workers and subprocesses),
compiles each graph once; it is deleted when the session ends, so no run reads another run's executables. An entry
that cannot be read (another worker still writing it) is a cache miss: JAX warns and compiles.
"""

import os
import shutil
import sys
import tempfile

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


def pytest_sessionfinish(session):
  del session
  if _OWN_CACHE:  # only the process that made the folder removes it
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
