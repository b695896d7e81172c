"""Comparison of a rerun's results with stored results, shared by the experiments tests."""

import math

import pytest


def assert_close(got, want, path="results"):
  """Same keys and lengths everywhere; finite floats equal up to float32 summation order (another CPU or JAX
  version), everything else exactly."""
  if isinstance(want, dict):
    assert set(got) == set(want), path
    for k in want:
      assert_close(got[k], want[k], f"{path}.{k}")
  elif isinstance(want, list):
    assert len(got) == len(want), path
    for i, (g, w) in enumerate(zip(got, want)):
      assert_close(g, w, f"{path}[{i}]")
  elif isinstance(want, float) and math.isfinite(want):
    assert got == pytest.approx(want, rel=1e-3, abs=1e-6), path
  else:
    assert got == want, path
