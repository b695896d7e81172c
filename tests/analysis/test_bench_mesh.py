"""benchmarks/mesh.py: the meshes take turns block by block, each block's ratio pairs it with the first mesh's same
block, and every row keeps the loss of its last step. Fake steps on a fake clock."""

import types

import numpy as np
import pytest

from benchmarks import mesh


def test_meshes_take_turns_and_ratios_pair_blocks(monkeypatch, capsys):
  clock, order = [0.0], []
  cost = {(8, 1, 1): (1.0, 2.0), (1, 1, 8): (1.5, 2.0)}  # seconds per step in block 0 and block 1

  def setup(shape, recipe, batch, seq):
    del recipe, batch, seq
    def step(state, data, key):
      del data, key
      order.append(shape)
      clock[0] += cost[shape][min(state // 2, 1)]
      return state + 1, {"loss": np.float32(5.0 - state)}
    return step, 0, None

  monkeypatch.setattr(mesh, "setup_mesh", setup)
  monkeypatch.setattr(mesh, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  monkeypatch.setattr(mesh.jax, "device_count", lambda: 8)
  results = mesh.main(["--steps", "2", "--runs", "2", "--meshes", "8,1,1;1,1,8"])
  assert order == [(8, 1, 1)] * 2 + [(1, 1, 8)] * 4 + [(8, 1, 1)] * 2  # block 1 starts with the other mesh
  assert results[(1, 1, 8)]["ratios"] == pytest.approx([1.5, 1.0]) and results[(8, 1, 1)]["ratios"] == [1.0, 1.0]
  assert results[(1, 1, 8)]["loss"] == 2.0  # the 4th timed step's (state 3)
  row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("(1, 1, 8)")).split()
  assert row[-3:] == ["1.25", "1.00", "2.0000"]


@pytest.mark.parametrize("flag", ["--steps", "--runs"])
def test_no_steps_or_runs_is_refused(flag, capsys):
  with pytest.raises(SystemExit):
    mesh.main([flag, "0"])
  assert f"{flag} must be >= 1" in capsys.readouterr().err
