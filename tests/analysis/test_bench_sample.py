"""benchmarks/sample.py: a row per recipe with its compile time, ms per token and ratio to the first recipe."""

import re

import pytest

from benchmarks import sample as sample_bench


def test_rows_per_recipe_and_the_ratio_to_the_first(capsys):
  assert sample_bench.main(["--tokens", "2", "--rounds", "1", "--recipes", "bf16", "mxfp4"]) == 0
  out = capsys.readouterr().out
  rows = {m.group(1): m.groups()[1:] for m in re.finditer(
      r"^(bf16|mxfp4)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)x\s+([\d.]+)x$", out, re.M)}
  assert set(rows) == {"bf16", "mxfp4"}, out
  assert rows["bf16"][2:] == ("1.00", "1.00", "1.00") and all(float(v) > 0 for r in rows.values() for v in r)


def test_round_ratios_pair_each_round_with_the_first_recipes_same_round():
  rows = [{"round_ms": [2.0, 4.0, 3.0]}, {"round_ms": [3.0, 4.0, 6.0]}]
  assert sample_bench.round_ratios(rows) == [[1.0, 1.0, 1.0], [1.5, 1.0, 2.0]]


def test_each_round_draws_the_same_tokens_and_bad_counts_are_refused():
  rows = sample_bench.measure("tiny", ["bf16"], tokens=3, rounds=2)
  assert len(rows) == 1 and len(rows[0]["tokens"]) == 3 and rows[0]["ms_per_token"] > 0
  with pytest.raises(ValueError, match="need tokens >= 1 and rounds >= 1"):
    sample_bench.measure("tiny", ["bf16"], tokens=0, rounds=1)


def test_ms_per_token_is_the_fastest_rounds_time_over_its_tokens(monkeypatch):
  """measure: the first (1-token) call is the compile time; each round's seconds are divided by its tokens, and the
  row keeps the fastest round. Fake generate on a fake clock."""
  import types  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  clock = [0.0]
  costs = iter([5.0, 0.4, 0.2, 0.3])  # the compile call, then rounds of 2 tokens: 0.2, 0.1, 0.15 s per token

  def generate(graphdef, params, prompt, config, **kw):
    clock[0] += next(costs)
    return np.arange(config.new_tokens)

  monkeypatch.setattr(sample_bench, "models", lambda model, recipes: {r: (None, None) for r in recipes})
  monkeypatch.setattr(sample_bench.sample_lib, "generate", generate)
  monkeypatch.setattr(sample_bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  [row] = sample_bench.measure("tiny", ["bf16"], tokens=2, rounds=3)
  assert row["compile_s"] == 5.0 and row["ms_per_token"] == pytest.approx(100.0) and row["tokens"] == [0, 1]
  assert row["round_ms"] == pytest.approx([200.0, 100.0, 150.0])
