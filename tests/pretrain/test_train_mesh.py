"""Training on (data, fsdp, tensor) meshes of 8 simulated devices: same losses as one device, checkpoints saved on
one mesh resume on another, clear errors for meshes that do not fit."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

from fp4jax.pretrain import data
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import train_step_compiles

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices (tests/conftest.py)")

STEPS = 4
# Every width / 8 shards is a multiple of 16: blocks stay inside shards on all meshes below.
MODEL = model_lib.get_model_config("tiny", d_model=128, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=256, n_layers=1)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return {"data": data.DataConfig(cache_dir=str(tmp_path_factory.mktemp("data_cache"))),
          "cache": steps_lib.CompileCache(), "root": tmp_path_factory.mktemp("runs")}


def _config(env, name, **changes):
  base = dict(out=str(env["root"] / name), model=MODEL, data=env["data"], recipe="nvfp4", seq_len=32, batch_size=8,
              steps=STEPS, lr=1e-2, eval_every=0, eval_batches=0, checkpoint_every=2, progress=False)
  base.update(changes)
  return TrainConfig.from_options(**base)


def _run(env, config):
  return trainer.train(config, log=None, compile_cache=env["cache"])


def _run_compiling(config, monkeypatch):
  """`_run` whose train step XLA compiles here, so that the partitioner's messages reach stderr.

  A step served by the session's persistent compilation cache prints nothing, and a check of stderr would pass
  without looking: the step gets a name no other run compiles (train_helpers.train_step_compiles), a compile cache
  of its own, and the test fails unless XLA compiled it.
  """
  with train_step_compiles(monkeypatch) as compiles:
    summary = trainer.train(config, log=None, compile_cache=steps_lib.CompileCache())
  assert compiles == [False], compiles
  return summary


SINGLE_GROUP = "mesh_single"  # the tests on `single`: one xdist unit, so one worker trains it (not each)


@pytest.fixture(scope="module")
def single(env):
  return _run(env, _config(env, "single"))


@pytest.mark.slow
@pytest.mark.xdist_group(SINGLE_GROUP)
@pytest.mark.parametrize("mesh", ["data=8", "fsdp=8", "tensor=8", "data=2,fsdp=2,tensor=2"])
def test_losses_match_single_device(env, single, mesh, capfd, monkeypatch):
  # The quantizer is bit-identical on any mesh (tests/test_sharding.py), but float32 summation order differs
  # between meshes. Step 0 (same params) agrees to float tolerance; afterwards a rare ulp difference at an FP4
  # rounding boundary flips a code, changes a scale, and the stochastic-rounding draws decorrelate like a new
  # seed: measured gaps 6e-5, 1e-3, 5e-3 at steps 1-3 with lr 1e-2.
  summary = _run_compiling(_config(env, "mesh_" + mesh.replace(",", "_").replace("=", ""), mesh=mesh), monkeypatch)
  np.testing.assert_allclose(summary["losses"][0], single["losses"][0], rtol=1e-5)
  np.testing.assert_allclose(summary["losses"], single["losses"], rtol=2e-2)
  leaf = jax.tree.leaves(summary["params"])[0]
  assert len(leaf.sharding.device_set) == 8
  # XLA's partitioner found a layout for every activation (no replicated tensors; see sharding.GATHER_AT_USE).
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.slow
def test_scan_layers_on_a_mesh_matches_the_loop_on_one_device(env, capfd, monkeypatch):
  """The scanned blocks' stacked weights keep their shardings: the step partitions as the loop's does."""
  two = dataclasses.replace(MODEL, n_layers=2)
  loop = _run(env, _config(env, "loop2", model=two))
  scan = _run_compiling(_config(env, "scan2_mesh", model=dataclasses.replace(two, scan_layers=True),
                                mesh="data=2,fsdp=2,tensor=2"), monkeypatch)
  np.testing.assert_allclose(scan["losses"][0], loop["losses"][0], rtol=1e-5)
  np.testing.assert_allclose(scan["losses"], loop["losses"], rtol=2e-2)  # as test_losses_match_single_device
  assert all(len(leaf.sharding.device_set) == 8 for leaf in jax.tree.leaves(scan["params"]))
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.slow
def test_grad_accum_on_a_mesh_matches_one_device(env, capfd, monkeypatch):
  """Micro-batch i is rows i, i + 2, ... on any mesh (steps.micro_batches): each batch shard holds its part of every
  micro-batch, the step partitions without replicating it, and trains as the same accumulation on one device."""
  one = _run(env, _config(env, "accum_single", batch_size=16, grad_accum=2))
  mesh = _run_compiling(_config(env, "accum_mesh", batch_size=16, grad_accum=2, mesh="data=2,fsdp=2,tensor=2"),
                        monkeypatch)
  np.testing.assert_allclose(mesh["losses"][0], one["losses"][0], rtol=1e-5)
  np.testing.assert_allclose(mesh["losses"], one["losses"], rtol=2e-2)  # as test_losses_match_single_device
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.slow
def test_checkpoint_saved_on_one_mesh_resumes_on_another(env):
  first = _run(env, _config(env, "dp", mesh="data=8"))
  resumed_dir = env["root"] / "resumed"
  (resumed_dir / "checkpoints").mkdir(parents=True)
  shutil.copytree(env["root"] / "dp" / "checkpoints" / "2", resumed_dir / "checkpoints" / "2")
  second = _run(env, _config(env, "resumed", mesh="data=2,fsdp=2,tensor=2", resume=True))
  assert second["start_step"] == 2
  np.testing.assert_allclose(second["losses"][0], first["losses"][2], rtol=1e-5)
  np.testing.assert_allclose(second["losses"], first["losses"][2:], rtol=2e-2)


def test_bad_mesh_is_a_clear_error(env):
  config = _config(env, "bad_data4", mesh="data=4")
  with pytest.raises(ValueError, match="has 4 devices but 8"):
    _run(env, config)
  assert not os.path.exists(config.out)  # refused before the run folder is made
  with pytest.raises(ValueError, match="axis in"):  # a spec that is no mesh at all: refused as the config is made
    _config(env, "bad_expert", mesh="data=2,expert=4")


def test_block_straddling_a_shard_is_a_clear_error(env):
  tiny = model_lib.get_model_config("tiny", n_layers=1)  # kv width 32 over 8 tensor shards: 4 per shard
  with pytest.raises(ValueError, match=r"attn\.[kv]\.kernel.*per shard, not a multiple of 16"):
    _run(env, _config(env, "straddle", model=tiny, mesh="tensor=8"))
