"""benchmarks/sample.py: a row per recipe with its compile time, ms per token and ratio to the first recipe."""

import re

import pytest

from benchmarks import sample as sample_bench


def test_rows_per_recipe_and_the_ratio_to_the_first(capsys):
  assert sample_bench.main(["--tokens", "2", "--rounds", "1", "--recipes", "bf16", "mxfp4"]) == 0
  out = capsys.readouterr().out
  rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"^(bf16|mxfp4)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", out,
                                                          re.M)}
  assert set(rows) == {"bf16", "mxfp4"}, out
  assert rows["bf16"][2] == "1.00" and all(float(v) > 0 for r in rows.values() for v in r)


def test_each_round_draws_the_same_tokens_and_bad_counts_are_refused():
  rows = sample_bench.measure("tiny", ["bf16"], tokens=3, rounds=2)
  assert len(rows) == 1 and len(rows[0]["tokens"]) == 3 and rows[0]["ms_per_token"] > 0
  with pytest.raises(ValueError, match="need tokens >= 1 and rounds >= 1"):
    sample_bench.measure("tiny", ["bf16"], tokens=0, rounds=1)
