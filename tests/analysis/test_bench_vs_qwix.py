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


@pytest.mark.parametrize("flag", ["--warmup", "--steps", "--runs"])
def test_no_warmup_steps_or_runs_is_refused(flag, capsys):
  """Steps compile on their first call: without a warmup step the compile would land in block 0's times."""
  with pytest.raises(SystemExit):
    vs_qwix.main(["--qwix", "", flag, "0"])
  assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_ratios_pair_each_block_with_the_unquantized_rows_same_block(monkeypatch, capsys):
  """run_part divides each row's median step time in a block by the unquantized row's median in the same block (a
  machine slowing down between blocks moves both); main prints the median and the min of those per-block ratios,
  and the loss of the last step. Fake steps on a fake clock."""
  import types  # pylint: disable=g-import-not-at-top
  clock = [0.0]
  warmup, steps = 1, 3
  cost = {"unquantized": (1.0, 2.0), "nvfp4": (1.2, 3.0)}  # seconds per step in block 0 and block 1: ratios 1.2, 1.5

  def fake_run(name, width, batch):
    def step(state, key):
      del key
      clock[0] += cost[name][max(state - warmup, 0) // steps]
      return state + 1, 10.0 - state
    return step, 0

  monkeypatch.setattr(vs_qwix, "_mlp_run", fake_run)
  monkeypatch.setattr(vs_qwix, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  ratios, _, losses = vs_qwix.run_part("mlp", ["unquantized", "nvfp4"], steps=steps, warmup=warmup, runs=2, width=8,
                                       batch=8)
  assert ratios["nvfp4"] == pytest.approx([1.2, 1.5]) and ratios["unquantized"] == [1.0, 1.0]
  assert losses["nvfp4"] == 4.0  # the 7th step's (state 6)
  vs_qwix.main(["--parts", "mlp", "--recipes", "nvfp4", "--qwix", "", "--steps", "3", "--warmup", "1", "--runs", "2"])
  rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
          if line.startswith("  ") and "row" not in line}
  assert rows["nvfp4"][:2] == ["1.35", "1.20"] and rows["nvfp4"][3] == "4.00000"
