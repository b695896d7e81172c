"""OsciReset as a training option: config and CLI, off changes nothing, a tetrajet_v2 run with it trains, resumes
bit for bit (its statistics are checkpointed), and runs sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import metrics
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import osci
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import tiny_config, run, tree_equal

STEPS = 12
# Cycles at steps 0, 4, 8: snapshot, 2 tracked steps, reset at 3, 7, 11.
OSCI = dict(osci_reset_start=0, osci_reset_every=4, osci_reset_window=2)


def make_config(env, out, **changes) -> TrainConfig:
  run = dict(batch_size=8, steps=STEPS, lr=1e-2, warmup_fraction=0.1, decay_fraction=0.25, checkpoint_every=3,
             recipe="tetrajet_v2")
  return tiny_config(env, out, **{**run, **changes})


def stored_keys(out, step):
  manager = ckpt.open_manager(out, create=False)
  try:
    return set(manager.item_metadata(step)["state"].keys())
  finally:
    manager.close()


# --- config and command line ---------------------------------------------------------------------------------------

def test_off_by_default_and_flags_build_the_group():
  assert not TrainConfig().osci_reset.enabled
  config = TrainConfig.from_options(recipe="tetrajet_v2", osci_reset_start=8000, osci_reset_threshold=6)
  assert config.osci_reset == osci.OsciResetConfig(start=8000, every=200, window=50, threshold=6)
  assert TrainConfig.from_dict(config.to_dict()) == config
  assert TrainConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "osci_reset"}).osci_reset == \
      osci.OsciResetConfig()  # configs stored before the option existed
  built = cli.config_from_args(["--out", "x", "--recipe", "tetrajet_v2", "--osci-reset-start", "100",
                                 "--osci-reset-every", "20", "--osci-reset-window", "5"])
  assert built.osci_reset == osci.OsciResetConfig(start=100, every=20, window=5)


def test_host_schedule_matches_the_compiled_one_from_a_start_on_a_cycle_boundary():
  """osci.kind (the host's: which steps fetch the reset count) and the traced branch of the update agree, also when
  `start` is a multiple of `every` (that cycle runs: its snapshot is step `start`)."""
  config = osci.OsciResetConfig(start=4, every=4, window=2)
  host = [osci.kind(s, config) for s in range(12)]
  assert host == ["none"] * 4 + ["snapshot", "track", "track", "reset"] * 2
  traced = [osci.KINDS[int(osci._branch(jnp.asarray(s), config))] for s in range(12)]  # pylint: disable=protected-access
  assert traced == host


def test_first_reset_step_and_what_the_run_log_says():
  """A schedule whose first reset falls beyond the run is allowed (a lengthened resume reaches it), but said so."""
  assert osci.OsciResetConfig(start=8000).first_reset_step == 8000 + 51
  assert osci.OsciResetConfig(start=8001).first_reset_step == 8200 + 51
  assert osci.OsciResetConfig(start=0, every=4, window=2).first_reset_step == 3
  assert [osci.kind(s, osci.OsciResetConfig(start=5, every=4, window=2)) for s in range(12)].index("reset") == \
      osci.OsciResetConfig(start=5, every=4, window=2).first_reset_step
  assert osci.OsciResetConfig().first_reset_step is None
  describe = trainer._training_options_lines  # pylint: disable=protected-access
  lines = lambda **kw: describe(TrainConfig.from_options(recipe="tetrajet_v2", **kw))
  assert lines() == []
  (line,) = lines(osci_reset_start=8000)  # the README's flag on the default 200 steps
  assert "first reset would come after step 8051, beyond this 200-step run: it resets nothing" in line
  assert "first reset after step 51." in lines(osci_reset_start=0)[0]
  (line,) = lines(outcontrol_fraction=0.05, outcontrol_start=10, outcontrol_window=5)
  assert line.startswith("OutControl: the top 5 % ") and "steps 10..14" in line


@pytest.mark.parametrize("changes, match", [
    (dict(recipe="tetrajet_v2", osci_reset_start=0, osci_reset_every=10, osci_reset_window=9), "window \\+ 2"),
    (dict(recipe="tetrajet_v2", osci_reset_start=-1), "start must be"),
    (dict(recipe="tetrajet_v2", osci_reset_start=0, osci_reset_threshold=0), "threshold"),
    (dict(recipe="bf16", osci_reset_start=0), "needs a quantized"),
    (dict(recipe="nvfp4:rht_on=fprop+wgrad", osci_reset_start=0), "Hadamard"),
])
def test_bad_osci_config_is_rejected(changes, match):
  with pytest.raises(ValueError, match=match):
    TrainConfig.from_options(**changes)


# --- training --------------------------------------------------------------------------------------------------------

STRAIGHT_GROUP = "osci_straight"  # the tests on `straight`: one xdist unit


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory):
  """The reference run with OsciReset on (checkpoints every 3 steps)."""
  out = tmp_path_factory.mktemp("runs") / "osci"
  return out, run(env, make_config(env, out, **OSCI))


@pytest.mark.slow
@pytest.mark.xdist_group(STRAIGHT_GROUP)
def test_tetrajet_v2_with_osci_reset_trains_and_resets(straight):
  out, summary = straight
  losses = summary["losses"]
  assert len(losses) == STEPS and all(np.isfinite(losses)), losses
  assert np.mean(losses[-3:]) < losses[0] - 1.5, losses
  records = metrics.read_metrics(out)
  resets = {r["step"]: r["osci_reset"] for r in records if "osci_reset" in r}
  assert sorted(resets) == [3, 7, 11]
  assert all(n > 0 for n in resets.values()), resets
  assert "osci" in stored_keys(out, STEPS)


@pytest.mark.slow
@pytest.mark.xdist_group(STRAIGHT_GROUP)
def test_resume_with_osci_reset_is_bit_identical(env, straight):
  """Resuming from step 6 (mid-window: snapshot at 4, step 5 tracked) reproduces the uninterrupted run."""
  out, summary = straight
  resumed = run(env, make_config(env, out, **OSCI, resume=True, resume_step=6))
  assert resumed["start_step"] == 6
  assert resumed["losses"] == summary["losses"][6:]  # exact float equality
  assert tree_equal(resumed["params"], summary["params"])


@pytest.mark.slow
@pytest.mark.xdist_group(STRAIGHT_GROUP)
def test_resume_with_osci_reset_switched_off_is_a_clear_error(env, straight):
  """The statistics are part of the checkpoint: resuming without the option names them, and moves nothing aside."""
  out, _ = straight
  with pytest.raises(ckpt.CheckpointError, match="unexpected osci"):
    run(env, make_config(env, out, resume=True))
  manager = ckpt.open_manager(out, create=False)
  assert STEPS in ckpt.available_steps(manager)
  manager.close()


@pytest.mark.slow
def test_off_or_not_yet_started_changes_nothing(env, tmp_path):
  """Off (the default) and on-but-starting-after-the-run give bit-identical losses and params; off stores no
  statistics in checkpoints."""
  off = run(env, make_config(env, tmp_path / "off", steps=8))
  later = run(env, make_config(env, tmp_path / "later", steps=8, osci_reset_start=8))
  assert off["losses"] == later["losses"]
  assert tree_equal(off["params"], later["params"])
  assert "osci" not in stored_keys(tmp_path / "off", 8) and "osci" in stored_keys(tmp_path / "later", 8)


@pytest.mark.slow
def test_osci_reset_on_a_mesh(env, tmp_path):
  if jax.device_count() < 8:
    pytest.skip("needs 8 simulated devices (tests/conftest.py)")
  model = model_lib.get_model_config("tiny", d_model=128, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=256, n_layers=1)
  summary = run(env, make_config(env, tmp_path / "mesh", model=model, steps=4, mesh="data=2,fsdp=2,tensor=2",
                                 osci_reset_start=0, osci_reset_every=3, osci_reset_window=1))
  assert all(np.isfinite(summary["losses"]))
  records = metrics.read_metrics(tmp_path / "mesh")
  assert [r["step"] for r in records if "osci_reset" in r] == [2]


@pytest.mark.slow
def test_osci_reset_with_outcontrol_trains_and_resets(env, tmp_path):
  """Both TetraJet-v2 options together, as the authors' TJv2-mix_fp8-osci_reset runs: OutControl selects its
  channels after step 0, OsciReset tracks steps 1-2 against the forward's FP4 rest operand and resets after step 3
  (fp4jax.pretrain.steps passes it the channels; tests/fp4jax/test_osci_reset_numerics.py checks the numerics)."""
  summary = run(env, make_config(env, tmp_path / "both", steps=4, **OSCI, outcontrol_fraction=0.05,
                                 outcontrol_start=0, outcontrol_window=1))
  assert all(np.isfinite(summary["losses"]))
  records = metrics.read_metrics(tmp_path / "both")
  resets = {r["step"]: r["osci_reset"] for r in records if "osci_reset" in r}
  assert sorted(resets) == [3] and resets[3] > 0, resets

