"""benchmarks/vs_qwix.py runs end to end on a small MLP (fp4jax rows always; Qwix rows when qwix is installed)."""

import importlib.util

import pytest

from benchmarks import vs_qwix


@pytest.mark.slow
def test_mlp_rows_print_ratios_and_losses(capsys):
  qwix_rows = "qwix:nvfp4" if importlib.util.find_spec("qwix") else ""
  vs_qwix.main(["--parts", "mlp", "--width", "64", "--batch", "128", "--recipes", "nvfp4", "fp8", "--qwix", qwix_rows,
                "--steps", "1", "--warmup", "1", "--runs", "2"])
  out = capsys.readouterr().out
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ") and "row" not in line}
  expected = ["unquantized", "nvfp4", "fp8"] + ([qwix_rows] if qwix_rows else [])
  assert sorted(rows) == sorted(expected)
  assert rows["unquantized"][:2] == ["1.00", "1.00"]
  for name in expected:
    median, minimum, ms, loss = (float(v) for v in rows[name])
    assert 0 < minimum <= median and ms > 0 and 0 < loss < 10


@pytest.mark.slow
def test_transformer_part_trains_a_step():
  """The `small` part's setup (the tiny preset here): builds the pretraining model and its step, and the loss drops."""
  step, state = vs_qwix._small_run("nvfp4", 2, model_name="tiny")  # pylint: disable=protected-access
  import jax  # pylint: disable=g-import-not-at-top
  losses = []
  for i in range(3):
    state, loss = step(state, jax.random.key(i))
    losses.append(float(loss))
  assert all(0 < v < 20 for v in losses) and int(state.step) == 3


def test_unknown_qwix_row_is_rejected():
  with pytest.raises(SystemExit):
    vs_qwix.main(["--qwix", "qwix:int3"])
