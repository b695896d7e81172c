"""OutControl as a training option: config and CLI, the calibration schedule and selection inside the compiled
step, off changes nothing, the split GEMMs change training after calibration, exact resume mid-calibration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import outcontrol as outcontrol_numerics
from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import outcontrol
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import tiny_config, run, tree_equal

STEPS = 7
# Steps 0-3 record (the checkpoint at 3 is mid-calibration), channels selected after step 3, MXFP8 from step 4.
OC = dict(outcontrol_fraction=0.05, outcontrol_start=0, outcontrol_window=4)


def make_config(env, out, **changes) -> TrainConfig:
  run = dict(batch_size=4, steps=STEPS, lr=1e-2, warmup_fraction=0.1, decay_fraction=0.25, checkpoint_every=3,
             recipe="nvfp4")
  return tiny_config(env, out, **{**run, **changes})


def run_recording(env, config):
  """(summary, {step: OutControlState after that step, as NumPy})."""
  states = {}
  hook = trainer.Hook(lambda info: states.__setitem__(info.step, jax.tree.map(np.asarray, info.state.outcontrol)))
  return run(env, config, [hook]), states


# --- config and command line ---------------------------------------------------------------------------------------

def test_off_by_default_and_flags_build_the_group():
  assert not TrainConfig().outcontrol.enabled
  config = TrainConfig.from_options(recipe="nvfp4", outcontrol_fraction=0.05, outcontrol_start=100)
  assert config.outcontrol == outcontrol.OutControlConfig(fraction=0.05, start=100, window=20)
  assert TrainConfig.from_dict(config.to_dict()) == config
  assert TrainConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "outcontrol"}).outcontrol == \
      outcontrol.OutControlConfig()  # configs stored before the option existed
  built = cli.config_from_args(["--out", "x", "--recipe", "tetrajet_v2", "--outcontrol-fraction", "0.1",
                                "--outcontrol-start", "5", "--outcontrol-window", "7"])
  assert built.outcontrol == outcontrol.OutControlConfig(fraction=0.1, start=5, window=7)
  assert [outcontrol.phase(s, built.outcontrol) for s in (0, 4, 5, 11, 12)] == ["off", "off", "record", "record", "on"]
  assert outcontrol.phase(10**6, TrainConfig().outcontrol) == "off"


@pytest.mark.parametrize("changes, match", [
    (dict(outcontrol_fraction=1.0), "fraction"),
    (dict(outcontrol_fraction=0.05, outcontrol_window=0), "window must be"),
    (dict(outcontrol_fraction=0.05, outcontrol_start=-1), "start must be"),
    (dict(recipe="bf16", outcontrol_fraction=0.05), "needs a quantized"),
    (dict(outcontrol_fraction=0.05, outcontrol_start=190), "beyond this 200-step run"),
])
def test_bad_outcontrol_config_is_rejected(changes, match):
  with pytest.raises(ValueError, match=match):
    TrainConfig.from_options(**{"recipe": "nvfp4", **changes})


def test_tracked_layers_skip_bf16_layers_and_count_channels():
  config = TrainConfig.from_options(recipe="nvfp4", outcontrol_fraction=0.05, bf16_last=1)
  layers = outcontrol.tracked_layers(config)
  assert not any(name.startswith("blocks.1.") for name in layers)  # the tiny model's last block stays in BF16
  assert layers["blocks.0.attn.q"] == (64, 4) and layers["blocks.0.mlp.down"] == (192, 10)  # ceil(0.05 K)


def test_a_fraction_selects_at_least_one_channel_and_all_is_refused_naming_the_layer_width():
  # A fraction under 1e-9 / K gave k = 0 while OutControl counted as on: training failed inside the compiled step.
  assert outcontrol_numerics.outlier_count(64, 1e-12) == 1 and outcontrol_numerics.outlier_count(64, 0) == 0
  assert outcontrol_numerics.outlier_count(640, 0.05) == 32
  # The config checked the fraction on a made-up 1000-channel layer; now on the model's own layers.
  with pytest.raises(ValueError, match="fraction 0.9995 selects all 64 channels of a layer"):
    TrainConfig.from_options(recipe="nvfp4", outcontrol_fraction=0.9995)


def test_the_sums_start_at_zero_on_the_first_recorded_step():
  # As the authors' calibrate.py: a run resumed with a later --outcontrol-start summed its old window in too.
  config = outcontrol.OutControlConfig(fraction=0.5, start=6, window=2)
  state = outcontrol.OutControlState(norms={"a": {"norms": jnp.asarray([100.0, 100.0, 1.0, 1.0])}},
                                     idx={"a": {"idx": jnp.asarray([0, 1], jnp.int32)}})
  sq = {"a": jnp.asarray([1.0, 4.0, 9.0, 16.0])}
  first = outcontrol.update(state, sq, jnp.int32(6), config)
  np.testing.assert_array_equal(outcontrol.flat(first.norms)["a"], [1.0, 2.0, 3.0, 4.0])
  last = outcontrol.update(first, sq, jnp.int32(7), config)
  np.testing.assert_array_equal(outcontrol.flat(last.norms)["a"], [2.0, 4.0, 6.0, 8.0])
  np.testing.assert_array_equal(outcontrol.flat(last.idx)["a"], [3, 2])


def test_next_outliers_are_selected_from_the_last_recorded_step_on():
  """What OsciReset quantizes against after each step (fp4jax.pretrain.steps): the channels the next forward runs
  in MXFP8."""
  config = outcontrol.OutControlConfig(fraction=0.5, start=2, window=3)  # records 2, 3, 4; MXFP8 from step 5
  state = outcontrol.OutControlState(norms={"a": {"norms": jnp.zeros(4)}},
                                     idx={"a": {"idx": jnp.asarray([3, 1], jnp.int32)}})
  assert outcontrol.next_outliers(state, jnp.int32(1), "off", config) == (None, False)
  for step, want in ((2, False), (3, False), (4, True)):
    idx, selected = outcontrol.next_outliers(state, jnp.int32(step), "record", config)
    assert bool(selected) == want and list(idx) == ["a"]
  idx, selected = outcontrol.next_outliers(state, jnp.int32(9), "on", config)
  assert selected is True
  np.testing.assert_array_equal(idx["a"], [3, 1])


# --- training (slow; the runs on the `straight` fixture are one xdist unit) --------------------------------------------------------------------------------------------------------

STRAIGHT_GROUP = "outcontrol_straight"


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory):
  """The reference run with OutControl on (checkpoints every 3 steps) and the OutControl state after each step."""
  out = tmp_path_factory.mktemp("runs") / "oc"
  return (out,) + run_recording(env, make_config(env, out, **OC))


@pytest.mark.slow
@pytest.mark.xdist_group(STRAIGHT_GROUP)
def test_calibration_selects_the_top_channels_of_the_recorded_norms(straight):
  out, summary, states = straight
  assert len(summary["losses"]) == STEPS and all(np.isfinite(summary["losses"]))
  flat = {s: (outcontrol.flat(st.norms), outcontrol.flat(st.idx)) for s, st in states.items()}
  layers = sorted(flat[0][0])
  assert len(layers) == 7  # every linear layer of the one block
  for name in layers:
    norms = {s: flat[s][0][name] for s in flat}
    idx = {s: flat[s][1][name] for s in flat}
    assert not idx[2].any()  # nothing selected before the last recorded step
    assert (norms[0] > 0).all() and all((norms[s] > norms[s - 1]).all() for s in (1, 2, 3))  # each step adds in
    for s in range(3, STEPS):
      np.testing.assert_array_equal(norms[s], norms[3])  # frozen after the window
      np.testing.assert_array_equal(idx[s], idx[3])
    k = outcontrol_numerics.outlier_count(norms[3].shape[0], 0.05)
    np.testing.assert_array_equal(idx[3], np.argsort(-norms[3].astype(np.float64), kind="stable")[:k])
  manager = ckpt.open_manager(out, create=False)
  try:
    assert "outcontrol" in set(manager.item_metadata(STEPS)["state"].keys())
  finally:
    manager.close()


@pytest.mark.slow
@pytest.mark.xdist_group(STRAIGHT_GROUP)
def test_off_is_the_plain_recipe_and_outcontrol_changes_training_after_calibration(env, straight, tmp_path):
  """Off: no state, nothing stored. Until calibration ends the runs agree (recording changes no arithmetic); once
  the outlier channels run in MXFP8 the losses differ."""
  _, summary, _ = straight
  off, states = run_recording(env, make_config(env, tmp_path / "off"))
  assert all(st is None for st in states.values())
  np.testing.assert_allclose(summary["losses"][:4], off["losses"][:4], rtol=1e-6)
  diff = np.abs(np.subtract(summary["losses"][4:], off["losses"][4:]))
  assert (diff > 1e-5).all(), (summary["losses"], off["losses"])
  manager = ckpt.open_manager(tmp_path / "off", create=False)
  try:
    assert "outcontrol" not in set(manager.item_metadata(STEPS)["state"].keys())
  finally:
    manager.close()


@pytest.mark.slow
@pytest.mark.xdist_group(STRAIGHT_GROUP)
def test_resume_mid_calibration_is_bit_identical(env, straight):
  """Resuming from step 3 (steps 0-2 recorded, selection still to come) reproduces the uninterrupted run."""
  out, summary, states = straight
  resumed, resumed_states = run_recording(env, make_config(env, out, **OC, resume=True, resume_step=3))
  assert resumed["start_step"] == 3
  assert resumed["losses"] == summary["losses"][3:]  # exact float equality
  assert tree_equal(resumed["params"], summary["params"])
  assert tree_equal(resumed_states[STEPS - 1], states[STEPS - 1])


@pytest.mark.slow
def test_outcontrol_on_a_mesh_selects_as_one_device(env, tmp_path):
  if jax.device_count() < 8:
    pytest.skip("needs 8 simulated devices (tests/conftest.py)")
  model = model_lib.get_model_config("tiny", d_model=128, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=256, n_layers=1)
  changes = dict(model=model, steps=4, batch_size=8, outcontrol_fraction=0.05,
                 outcontrol_start=0, outcontrol_window=2)
  one, one_states = run_recording(env, make_config(env, tmp_path / "one", **changes))
  mesh, mesh_states = run_recording(env, make_config(env, tmp_path / "mesh", mesh="data=2,fsdp=2,tensor=2",
                                                     **changes))
  # Meshes sum in other orders (as in test_train_mesh.py): equal first losses, then FP4 rounding flips compound.
  np.testing.assert_allclose(mesh["losses"][0], one["losses"][0], rtol=1e-5)
  np.testing.assert_allclose(mesh["losses"], one["losses"], rtol=2e-2)
  for a, b in zip(jax.tree.leaves(mesh_states[3].norms), jax.tree.leaves(one_states[3].norms)):
    np.testing.assert_allclose(a, b, rtol=1e-2)  # norms of bfloat16 inputs: an ulp is 4e-3
  for a, b in zip(jax.tree.leaves(mesh_states[3].idx), jax.tree.leaves(one_states[3].idx)):
    np.testing.assert_array_equal(a, b)  # the norms are over the global batch: the same channels
