"""Tests for experiments.common: JSON-ready values and Markdown tables."""

import json

import jax.numpy as jnp
import numpy as np

from experiments import common


def test_jsonable_gives_strict_json():
  value = {1: (np.float32(0.5), np.int64(3), np.asarray([1.0, np.nan]), jnp.asarray(2.0)),
           "x": [float("inf"), -float("inf"), None, True, "s"], "obj": common}
  got = common.jsonable(value)
  assert got == {"1": [0.5, 3, [1.0, "nan"], 2.0], "x": ["inf", "-inf", None, True, "s"], "obj": str(common)}
  assert isinstance(got["1"][1], int) and json.loads(json.dumps(got, allow_nan=False)) == got


def test_fmt_and_table():
  assert common.fmt(1.23456) == "1.2346" and common.fmt(0.5, 0.25, 2, signed=True) == "+0.50 ± 0.25"
  assert common.fmt(None) == "-" and common.fmt(float("nan"), 1.0) == "-" and common.fmt(1.0, float("nan"), 1) == "1.0"
  assert common.table(["a", "b"], [[1, "x"], [2.5, None]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | None |"
