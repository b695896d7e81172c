"""Tests for fp4jax.pretrain.trainer / config / metrics / cli: loss drops per recipe, policy switch, bit-exact resume, divergence,
bad input, command line. All runs share one settings block (and a CompileCache), so each graph compiles once."""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import data
from fp4jax.pretrain import metrics
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import tiny_config, run, tree_equal

STEPS = 16
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_config(env, out, **changes) -> TrainConfig:
  """One block of settings for every test run: a 1-block tiny model, 16 steps of batch 8 x 32 tokens."""
  run = dict(batch_size=8, steps=STEPS, lr=1e-2, warmup_fraction=0.1, decay_fraction=0.25, eval_batches=1,
             checkpoint_every=4)
  return tiny_config(env, out, **{**run, **changes})


# --- training --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "mxfp4", "fp8"])
def test_loss_drops_with_each_recipe(env, tmp_path, recipe):
  # Statistics and validation checked with bf16 only: each compiles its own forward of the quantized graph.
  extra = dict(stats_every=8, eval_every=8) if recipe == "bf16" else dict(eval_batches=0)
  logged = []  # without the progress bar, each validation before the last gets a log line
  summary = trainer.train(make_config(env, tmp_path / recipe, recipe=recipe, **extra), log=logged.append,
                          compile_cache=env["cache"])
  assert [line.split(":")[0] for line in logged if line.startswith("step ")] == (
      [f"step {s}/{STEPS}" for s in (0, 8)] if recipe == "bf16" else [])
  losses = summary["losses"]
  assert len(losses) == STEPS and all(np.isfinite(losses))
  assert np.mean(losses[-4:]) < losses[0] - 1.5, losses
  assert set(summary["layer_recipes"][0].values()) == {recipe}

  records = metrics.read_metrics(tmp_path / recipe)
  assert [r["step"] for r in records] == list(range(STEPS + (recipe == "bf16")))
  for r in records[:STEPS]:
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time", "phase"} <= set(r)
  if recipe == "bf16":
    assert summary["final_val_loss"] < losses[0] - 1.5
    assert records[-1]["val_loss"] == pytest.approx(summary["final_val_loss"])
  else:
    assert summary["final_val_loss"] is None and "val_loss" not in records[-1]
  assert records[0]["lr"] == pytest.approx(1e-2 * 1 / 2)  # warmup 2 steps, the first at half the peak
  assert records[STEPS - 1]["lr"] == pytest.approx(1e-2 / 4)  # linear decay over the last 4 steps, floor 0 at step 16
  if recipe == "bf16":
    with_stats = [r for r in records if "quant" in r]
    assert [r["step"] for r in with_stats] == [0, 8, 16]
    layer_stats = with_stats[-1]["quant"]
    assert set(layer_stats) == set(model_lib.Transformer(
        make_config(env, tmp_path).model, rngs=nnx.Rngs(0)).linear_layers())
    for s in layer_stats.values():
      assert set(s) == {"w_zero", "w_sat", "w_err", "x_zero", "x_sat", "x_err"}
      assert 0 < s["w_err"] < 0.3 and 0 < s["x_err"] < 0.3
      assert 0 < s["w_sat"] < 0.5 and 0 <= s["w_zero"] < 0.5


@pytest.mark.slow
def test_policy_switch_phase_and_bf16_layers(env, tmp_path):
  # fp8 compiles fastest of the quantized recipes; the policy does not depend on the format.
  config = make_config(env, tmp_path, recipe="fp8", bf16_pattern=r".*mlp\.down", switch_at=10)
  deleted = {}
  peek = trainer.Hook(lambda info: deleted.setdefault(info.step, info.state.step.is_deleted()), reads_state=False)
  summary = run(env, config, hooks=[peek])
  records = metrics.read_metrics(tmp_path)
  assert [r["phase"] for r in records if "loss" in r] == [0] * 10 + [1] * 6
  # The switch step compiles: the loop finishes step 9 before sending it (so its step_time holds no compile), while
  # step 9 itself was sent before step 8 was read (8 is not before a checkpoint: those come every 4).
  assert not deleted[9] and deleted[8]
  before, after = summary["layer_recipes"][0], summary["layer_recipes"][1]
  assert before.pop("blocks.0.mlp.down") == "bf16" and set(before.values()) == {"fp8"}
  assert set(after.values()) == {"bf16"}
  manager = ckpt.open_manager(tmp_path, create=False)
  _, meta = ckpt.restore_meta(manager)
  manager.close()
  assert meta["policy"] == config.policy.to_dict()
  assert meta["phase"] == 1


def test_bf16_layers_are_not_quantized(env):
  config = make_config(env, "unused", recipe="nvfp4", bf16_pattern=r".*mlp\.up")
  model = trainer.build_model(config, jax.random.key(0))
  for name, layer in model.linear_layers().items():
    assert layer.recipe.is_quantized == (name != "blocks.0.mlp.up"), name
  x = jax.random.normal(jax.random.key(1), (32, 64), jnp.bfloat16)
  layer = model.linear_layers()["blocks.0.mlp.up"]
  plain = jnp.dot(x, layer.kernel[...].astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(layer(x, key=jax.random.key(2)), np.float32), np.asarray(plain, np.float32))


@pytest.mark.slow
def test_sigint_checkpoint_and_resume_are_bit_identical(env, tmp_path):
  """16 steps straight == 8 steps, Ctrl-C (checkpoint), resume 8 steps: same losses and params, SR included."""
  straight = run(env, make_config(env, tmp_path / "straight", recipe="nvfp4", eval_batches=0))

  def interrupt(step, record):
    if step == 7:
      os.kill(os.getpid(), signal.SIGINT)

  config = make_config(env, tmp_path / "split", recipe="nvfp4", eval_batches=0, checkpoint_every=5)
  with pytest.raises(KeyboardInterrupt):
    run(env, config, hooks=[interrupt])
  manager = ckpt.open_manager(tmp_path / "split", create=False)
  # A hook of (step, record) runs after the next step has gone to the device: the loop finishes that step (its
  # record is written) and saves the state it made.
  assert ckpt.available_steps(manager) == [5, 9]
  manager.close()
  resumed = run(env, config.replace(resume=True))
  assert resumed["start_step"] == 9
  assert resumed["losses"] == straight["losses"][9:]  # exact float equality
  assert tree_equal(resumed["params"], straight["params"])
  records = metrics.read_metrics(tmp_path / "split")
  assert [r["loss"] for r in records] == straight["losses"]


@pytest.mark.slow
def test_each_step_gets_fold_in_of_the_run_key_and_its_number(env, tmp_path, monkeypatch):
  """The step key, fold_in(run key, step), is derived inside the compiled step (from the state's step counter):
  steps 0-3 of a run and steps 4-5 of its resume get the keys the loop folded in eagerly before."""
  seen = []
  make = steps_lib.make_train_step

  def recording(*args, **kwargs):
    step = make(*args, **kwargs)

    def step_seeing_its_key(state, batch, key, *rest):
      jax.debug.callback(lambda k: seen.append(np.asarray(k).tolist()), jax.random.key_data(key))
      return step(state, batch, key, *rest)

    return step_seeing_its_key

  monkeypatch.setattr(steps_lib, "make_train_step", recording)
  config, cache = make_config(env, tmp_path, steps=4, checkpoint_every=2), steps_lib.CompileCache()
  trainer.train(config, log=None, compile_cache=cache)
  trainer.train(config.replace(resume=True, steps=6), log=None, compile_cache=cache)
  run_key = trainer.run_keys(config.seed)["step"]
  assert seen == [np.asarray(jax.random.key_data(jax.random.fold_in(run_key, s))).tolist() for s in range(6)]


@pytest.mark.slow
def test_progress_bar_is_redrawn_at_its_own_rate_not_every_step(env, tmp_path, monkeypatch):
  """The loss shown in the bar used to redraw it on every step: a line per step in a log file."""
  import io  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top
  out = io.StringIO()

  asked = []

  class Unhurried(tqdm.tqdm):  # redraws only when it opens and closes
    def __init__(self, *args, **kwargs):
      asked.append(kwargs.get("mininterval"))
      super().__init__(*args, **{**kwargs, "mininterval": 1e9, "file": out})

  monkeypatch.setattr(tqdm, "tqdm", Unhurried)
  monkeypatch.setattr(trainer, "bar_interval", lambda: 12.5)
  summary = run(env, make_config(env, tmp_path, steps=6, progress=True))
  assert asked == [12.5]  # the bar redraws at bar_interval()'s rate
  text = out.getvalue()
  assert text.count("loss=") == 1, text  # the closing redraw, with the last step's loss
  assert "6/6" in text and f"loss={summary['losses'][-1]:.4f}" in text, text


def test_bar_interval_is_long_only_where_the_process_stderr_is_a_log(monkeypatch, tmp_path):
  """A terminal or a notebook (its stderr is not the process's own) gets tqdm's 0.1 s; a file or pipe 30 s."""

  class Stream:
    def __init__(self, tty):
      self.tty = tty

    def isatty(self):
      return self.tty

  log, terminal = Stream(False), Stream(True)
  monkeypatch.setattr(sys, "__stderr__", log)
  assert trainer.bar_interval(log) == trainer.LOG_BAR_INTERVAL == 30.0
  assert trainer.bar_interval(Stream(False)) == trainer.TERMINAL_BAR_INTERVAL == 0.1  # a notebook's stream
  monkeypatch.setattr(sys, "__stderr__", terminal)
  assert trainer.bar_interval(terminal) == 0.1
  monkeypatch.setattr(sys, "__stderr__", None)
  assert trainer.bar_interval(None) == 0.1 and trainer.bar_interval(object()) == 0.1  # pytest's stderr; no isatty


@pytest.mark.slow
def test_different_seed_gives_different_run_and_hooks_run_every_n_steps(env, tmp_path):
  seen, kept = [], {}
  every5 = trainer.Hook(lambda info: seen.append((info.step, info.final, info.record.get("loss"))), every=5)
  keep = trainer.Hook(lambda info: kept.setdefault(info.final, jax.tree.leaves(info.state.params)), every=5)
  a = run(env, make_config(env, tmp_path / "a", recipe="nvfp4", eval_batches=0), hooks=[every5, keep])
  b = run(env, make_config(env, tmp_path / "b", recipe="nvfp4", eval_batches=0, seed=1))
  assert a["losses"] != b["losses"]
  # After steps 0, 5, 10, 15 (with that step's loss), then once at the end (step == steps, no training loss).
  assert seen == [(s, False, a["losses"][s]) for s in (0, 5, 10, 15)] + [(STEPS, True, None)]
  # The train step donates its state: the params a hook saw after step 0 became step 1's output buffers (a hook
  # must copy what it keeps, hooks.StepInfo); the final state stays readable.
  assert kept[False] and all(x.is_deleted() for x in kept[False])
  assert not any(x.is_deleted() for x in kept[True])


def _checkpoint_steps(out):
  manager = ckpt.open_manager(out, create=False)
  try:
    return ckpt.available_steps(manager)
  finally:
    manager.close()


@pytest.mark.slow
def test_what_hooks_add_to_the_record_is_logged_and_hook_errors_surface_after_a_checkpoint(env, tmp_path):
  def add(step, record):  # a user's own metric, as StepInfo invites
    record["tokens_seen"] = step * 8 * 32

  deleted, counters = [], []
  peek = trainer.Hook(lambda info: deleted.append(info.state.step.is_deleted()), reads_state=False)
  read = trainer.Hook(lambda info: counters.append(int(info.state.step)), every=4)
  straight = run(env, make_config(env, tmp_path / "a", recipe="bf16", eval_batches=0), hooks=[add, peek, read])
  # Written after the hooks: every step's record and the final one (step == STEPS) carry the hook's number.
  assert [r.get("tokens_seen") for r in metrics.read_metrics(tmp_path / "a")] == [s * 256 for s in range(STEPS + 1)]
  # The loop sends step s + 1 before it runs the hooks after step s, except where the host needs step s's state:
  # a hook reading it is due (`read`: s = 0, 4, ...), a checkpoint comes next (every 4: s = 3, 7, ...), the end.
  assert deleted == [s % 4 in (1, 2) for s in range(STEPS)] + [False]
  assert counters == [1, 5, 9, 13, STEPS]  # a hook that reads the state reads the one its step made

  def fail_at(step):
    def fail(info):
      if info.step == step:
        raise KeyError("my metric")
    return trainer.Hook(fail)

  config = make_config(env, tmp_path / "b", recipe="bf16", eval_batches=0)
  with pytest.raises(KeyError, match="my metric"):  # the hook's own error, unwrapped
    run(env, config, hooks=[fail_at(2)])
  assert [r["step"] for r in metrics.read_metrics(tmp_path / "b")] == [0, 1, 2]  # the failing step's record kept
  # The state the hook saw (after step 2) was saved before the error surfaced, and resumes to the straight run.
  assert _checkpoint_steps(tmp_path / "b") == [3]
  resumed = run(env, config.replace(resume=True))
  assert resumed["start_step"] == 3 and resumed["losses"] == straight["losses"][3:]
  assert tree_equal(resumed["params"], straight["params"])

  # A hook of (step, record) fails after the next step was sent: the state that step made is saved.
  with pytest.raises(KeyError, match="my metric"):
    run(env, make_config(env, tmp_path / "d", recipe="bf16", eval_batches=0),
        hooks=[lambda step, record: fail_at(5).fn(trainer.StepInfo(step, None, record))])
  # Step 6's row too (its state is in checkpoint 7): it was lost, and the resumed run's metrics skipped step 6.
  rows = metrics.read_metrics(tmp_path / "d")
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
  assert rows[6]["loss"] == straight["losses"][6] and "tokens_seen" not in rows[6]
  assert _checkpoint_steps(tmp_path / "d") == [4, 7]
  resumed = run(env, config.replace(out=str(tmp_path / "d"), resume=True))
  assert resumed["start_step"] == 7 and resumed["losses"] == straight["losses"][7:]
  assert [r["step"] for r in metrics.read_metrics(tmp_path / "d")] == list(range(STEPS))  # no final record: no val

  # A hook failing at the final call (step == STEPS) still leaves the final checkpoint.
  with pytest.raises(KeyError, match="my metric"):
    run(env, make_config(env, tmp_path / "c", recipe="bf16", eval_batches=0), hooks=[fail_at(STEPS)])
  assert _checkpoint_steps(tmp_path / "c")[-1] == STEPS


def test_a_test_not_marked_slow_cannot_train(env, tmp_path):
  """tests/conftest.py stops a fast test at its first train step, so `pytest -m "not slow"` stays quick."""
  with pytest.raises(AssertionError, match="mark it @pytest.mark.slow"):
    run(env, make_config(env, tmp_path / "run", recipe="bf16"))


def test_hook_is_due_on_multiples_of_every_and_at_the_end():
  calls = []
  hook = trainer.Hook(lambda info: calls.append(info.step), every=3)
  for step in range(7):
    hook(trainer.StepInfo(step, None, {}))
  hook(trainer.StepInfo(7, None, {}, final=True))
  trainer.Hook(lambda info: calls.append(-1), every=0)(trainer.StepInfo(0, None, {}))  # every=0: never
  assert calls == [0, 3, 6, 7]


def test_hooks_that_cannot_run_are_refused_before_the_run(env, tmp_path):
  with pytest.raises(ValueError, match="every must be an int >= 0"):
    trainer.Hook(lambda info: None, every=-1)  # would silently never run
  with pytest.raises(TypeError, match="reads_state must be True or False"):
    trainer.Hook(lambda info: None, reads_state="no")  # a truthy string would read as True
  assert not trainer.as_hook(lambda step, record: None).reads_state and trainer.Hook(print).reads_state
  config = make_config(env, tmp_path / "run", recipe="bf16")
  # A Hook's fn(info) passed bare is called as fn(step, record): refused before the run folder or a step exists.
  with pytest.raises(TypeError, match="cannot be called as fn\\(step, record\\).*Hook\\(fn"):
    run(env, config, hooks=[lambda info: None])
  with pytest.raises(TypeError, match=r"pass \[hook\]"):
    run(env, config, hooks=trainer.Hook(lambda info: None))  # one Hook, not a list of them
  assert not (tmp_path / "run").exists()
  assert trainer.as_hook(print).every == 1  # builtins without a signature pass as given


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(env, tmp_path, monkeypatch):
  real_get_batch = data.get_batch

  def poisoned(dataset, split, step, **kw):
    batch = real_get_batch(dataset, split, step, **kw)
    if step == 6:  # an out-of-range token id embeds as NaN
      batch["inputs"] = batch["inputs"].copy()
      batch["inputs"][0, 0] = 10**6
    return batch

  monkeypatch.setattr(data, "get_batch", poisoned)
  config = make_config(env, tmp_path, recipe="bf16", checkpoint_every=2)
  with pytest.raises(trainer.TrainingDiverged, match="diverged at step 6") as info:
    run(env, config)
  assert info.value.step == 6 and info.value.last_checkpoint == 6
  manager = ckpt.open_manager(tmp_path, create=False)
  assert ckpt.available_steps(manager) == [2, 4, 6]
  template = steps_lib.TrainState(**ckpt.restore(manager, _state_template(config), 6)[1])
  manager.close()
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(template.params))
  last = metrics.read_metrics(tmp_path)[-1]
  assert last["step"] == 6 and last["diverged"] is True and last["loss"] == "nan"


def _state_template(config):
  model = trainer.build_model(config, jax.random.key(0))
  params = nnx.state(model, nnx.Param)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  return steps_lib.TrainState(params, optimizer.init(params), jnp.asarray(0, jnp.int32))._asdict()


def test_wsd_schedule_shapes():
  config = TrainConfig.from_options(steps=100, lr=1.0, warmup_fraction=0.1, decay_fraction=0.2, min_lr_ratio=0.1)
  lr = optimizer_lib.lr_schedule(config.optimizer, config.steps)
  assert float(lr(0)) == pytest.approx(0.1) and float(lr(9)) == pytest.approx(1.0)
  assert float(lr(50)) == 1.0 and float(lr(80)) == 1.0
  assert float(lr(90)) == pytest.approx(0.1 + 0.9 * 0.5)
  sqrt = optimizer_lib.lr_schedule(config.replace(decay_shape="1-sqrt").optimizer, config.steps)
  assert float(sqrt(90)) == pytest.approx(0.1 + 0.9 * (1 - np.sqrt(0.5)))
  assert float(lr(100)) == pytest.approx(0.1)


def test_logged_lr_computed_on_the_host_keeps_eager_bits():
  """The trainer logs the LR from NumPy (wsd_lr(xp=np)): a device computation per step cost ~0.45 ms, a few percent
  of a tiny step. Every count (warmup, stable, linear and 1-sqrt decay, past the end) gives eager JAX's float32."""
  for steps, options in [(37, dict(warmup_fraction=0.1, decay_fraction=0.2, min_lr_ratio=0.1)),
                         (25, dict(lr=7.3e-4, warmup_fraction=0.3, decay_fraction=0.7, decay_shape="1-sqrt")),
                         (9, dict(lr=3e-3, warmup_fraction=0.0, decay_fraction=0.0))]:
    args = optimizer_lib.schedule_args(optimizer_lib.OptimizerConfig(**options), steps)
    host = np.array([optimizer_lib.wsd_lr(args, count, xp=np) for count in range(steps + 2)])
    eager = np.array([optimizer_lib.wsd_lr(args, count) for count in range(steps + 2)])
    assert host.dtype == np.float32 and (len(set(host.tolist())) > 2 or not options["decay_fraction"]), host
    np.testing.assert_array_equal(host.view(np.uint32), eager.view(np.uint32), err_msg=str(steps))


def test_phases_look_up_each_step_function_once(env, tmp_path, monkeypatch):
  """The CompileCache key hashes the whole graphdef (~1.6 ms for `small`, more than a tenth of a tiny CPU step, on
  every step); Phases now asks the cache once per precision phase and keeps the function."""
  config = make_config(env, tmp_path, recipe="fp8", bf16_pattern=r".*mlp\.down", switch_at=10)
  model = trainer.build_model(config, jax.random.key(0))
  phases = steps_lib.Phases(config, model, steps_lib.CompileCache())
  lookups = []  # each lookup answers a new object (the step is not built: no test outside `slow` builds one)
  monkeypatch.setattr(phases, "_cached_train_step", lambda step, oc_phase: lookups.append(step) or object())
  fns = [phases.train_step(step) for step in range(STEPS)]
  assert lookups == [0, 10]  # phase 0, then phase 1 after the switch
  assert all(f is fns[0] for f in fns[:10]) and all(f is fns[10] for f in fns[10:]) and fns[0] is not fns[10]


def test_schedule_as_step_inputs_keeps_the_compiled_in_bits():
  """The trainer's step takes the schedule's numbers as arrays (ScheduleArgs); with them as Python constants XLA
  turned each division by a step count into a product with its float32 reciprocal. Both give the same updates, bit
  for bit, in warmup, stable phase and decay (a runtime division differs: 6/7 at step 36 of the 37-step run)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.full(4, 0.5, jnp.float32)}
  grads = jax.tree.map(lambda p: jnp.cos(7 * p) / 3, params)
  for steps, options in [(37, dict(warmup_fraction=0.1, decay_fraction=0.2, min_lr_ratio=0.1)),
                         (25, dict(lr=7.3e-4, warmup_fraction=0.3, decay_fraction=0.7, decay_shape="1-sqrt"))]:
    config = optimizer_lib.OptimizerConfig(**options)
    fixed = optimizer_lib.make_optimizer(config, steps)
    opt_state = fixed.init(params)
    constant = jax.jit(lambda state: fixed.update(grads, state, params)[0])
    runtime = jax.jit(lambda state, args: optimizer_lib.make_optimizer(config, args).update(grads, state, params)[0])
    args = optimizer_lib.schedule_args(config, steps)
    for count in range(steps + 1):
      state = jax.tree.map(lambda x: jnp.asarray(count, x.dtype) if x.dtype == jnp.int32 else x, opt_state)
      assert tree_equal(constant(state), runtime(state, args)), (steps, count)


def test_tensor_stats_counts_codes():
  x = jnp.asarray([[6.0, 0.0, 0.1, 3.0] + [0.0] * 12], jnp.float32)  # one block: max -> 6, 0.1 -> 0
  stats = jax.jit(metrics.tensor_stats, static_argnums=1)  # eager quantize would compile op by op
  s = stats(x, "nvfp4")
  assert float(s["zero"]) == 14 / 16 and float(s["sat"]) == 1 / 16
  assert float(s["err"]) == pytest.approx(0.1 / np.linalg.norm([6, 0.1, 3]), rel=1e-6)
  padded = stats(jnp.full((1, 20), 2.0), "nvfp4")  # padding must not count as zeros
  assert float(padded["zero"]) == 0 and float(padded["sat"]) == 1
  with pytest.raises(ValueError, match="FP4"):
    metrics.tensor_stats(x, "fp8")


def test_tensor_stats_count_negative_codes_by_magnitude():
  """zero and sat read the E2M1 magnitude without its sign bit: -6 saturates, a negative value that rounds to -0
  is a zero code, and 4.0 (the code below 6) does not count as saturated."""
  x = jnp.asarray([[-6.0, -0.1, 4.0, -3.0] + [0.0] * 12], jnp.float32)  # one block: amax 6, so scale 1
  s = jax.jit(metrics.tensor_stats, static_argnums=1)(x, "nvfp4")
  assert float(s["zero"]) == 13 / 16 and float(s["sat"]) == 1 / 16



@pytest.mark.parametrize("scale", [1e-25, 1e19, 1e30])
def test_tensor_stats_error_of_tiny_and_huge_tensors(scale):
  # The squares in the norms underflowed to 0 or overflowed to inf: err came out 0.0 (1e-25, 1e19) or NaN (1e30).
  # NVFP4's scales follow the tensor's magnitude, so the relative error must be the unit-scale one.
  x = np.asarray(np.random.default_rng(0).standard_normal((4, 64)), np.float32)
  stats = jax.jit(metrics.tensor_stats, static_argnums=1)
  want = float(stats(jnp.asarray(x), "nvfp4")["err"])
  assert 0.05 < want < 0.2
  np.testing.assert_allclose(float(stats(jnp.asarray(x * np.float32(scale)), "nvfp4")["err"]), want, rtol=1e-5)

# --- bad input -------------------------------------------------------------------------------------------------


def test_missing_and_empty_corpus(env, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    run(env, make_config(env, tmp_path / "a", data=data.DataConfig(corpus=str(tmp_path / "nope"))))
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(ValueError, match="empty"):
    run(env, make_config(env, tmp_path / "b", data=data.DataConfig(corpus=str(empty))))


@pytest.mark.parametrize("changes, match", [
    ({"model.d_model": 100}, "multiple of 16"),
    ({"model.n_heads": 3}, "multiple of n_kv_heads"),
    ({"seq_len": 1000}, "max_seq_len"),
    ({"warmup_fraction": 0.9}, "warmup_fraction \\+ decay_fraction"),
    ({"recipe": "nvfp5"}, "Unknown recipe"),
    ({"recipe": "nvfp4:rht_sise=4"}, "Unknown option"),
    ({"bf16_last": 5}, "exceeds"),
    ({"switch_at": 500}, "never reaches"),
    ({"stats_format": "fp8"}, "stats_format"),
    ({"stats_every": 2, "eval_batches": 0}, "needs eval_batches"),
    ({"seed": 2**32 + 5}, "seed must be < 2\\*\\*32"),  # else the init and SR keys of seed 5
])
def test_bad_config_is_rejected(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.config_from_overrides(changes)


# --- command line ----------------------------------------------------------------------------------------------


def test_cli_help_lists_every_field(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["train", "--help"])
  assert info.value.code == 0
  text = capsys.readouterr().out
  for name in config_lib.option_keys():
    assert f"--{name.replace('_', '-')}" in text if "." not in name else f"--{name}" in text, name
  for title in ("run:", "precision policy", "optimizer", "evaluation", "logging", "checkpointing", "model", "data"):
    assert title in text, title
  for flag in ("--model.d_model", "--data.corpus", "--bf16-first", "--bf16-last", "--bf16-blocks", "--bf16-pattern",
               "--switch-at", "--switch ", "--resume"):
    assert flag in text, flag


def test_cli_overrides_build_the_config():
  config = cli.config_from_args([
      "--model", "small", "--model.d_model", "256", "--recipe", "nvfp4:rht_size=4,stochastic_rounding=false",
      "--bf16-last", "1", "--bf16-blocks", "0,2", "--switch-at", "0.5", "--switch", "forward", "--steps", "10",
      "--batch_size", "4", "--progress", "false", "--resume-step", "none", "--data.val_fraction", "0.1",
      "--out", "runs/y"])
  assert config.out == "runs/y"
  assert config.model == model_lib.get_model_config("small", d_model=256)
  recipe = config.policy.recipe
  assert recipe.rht_size == 4 and recipe.dgrad.lhs.rounding == "nearest"
  p = config.policy
  assert (p.last, p.blocks, p.switch_at, p.switch) == (1, (0, 2), 0.5, "forward")
  assert config.policy.switch_step(config.steps) == 5
  assert (config.steps, config.batch_size, config.logging.progress, config.data.val_fraction) == (10, 4, False, 0.1)
  assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_cli_errors_exit_cleanly(tmp_path, capsys):
  assert cli.main(["train", "--model.d_model", "100", "--out", str(tmp_path / "x")]) == cli.EXIT_USAGE
  assert "multiple of 16" in capsys.readouterr().err
  assert cli.main(["train", "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "y")]) == cli.EXIT_USAGE
  assert "does not exist" in capsys.readouterr().err
  assert cli.main(["eval", "--out", str(tmp_path / "none")]) == cli.EXIT_USAGE
  assert "No checkpoints" in capsys.readouterr().err
  assert cli.main(["frobnicate"]) == cli.EXIT_USAGE
  assert capsys.readouterr().err.strip().endswith("unknown command 'frobnicate'; expected one of ['eval', 'sample', 'train'].")
  assert cli.main(["trian"]) == cli.EXIT_USAGE
  assert "unknown command 'trian' (did you mean 'train'?); expected one of" in capsys.readouterr().err
  # A misspelt option or recipe is named with what it resembles, before the long lists of valid ones.
  for flag, hint in (("--modle", "--modle tiny (did you mean '--model'?)"),
                     ("--model.n_layerz", "--model.n_layerz tiny (did you mean '--model.n_layers'?)")):
    with pytest.raises(SystemExit) as exit_info:  # argparse's exit, as `fp4jax train` exits
      cli.main(["train", flag, "tiny", "--out", str(tmp_path / "z")])
    assert exit_info.value.code == cli.EXIT_USAGE
    assert capsys.readouterr().err.strip().endswith("unrecognized arguments: " + hint)
  assert cli.main(["train", "--recipe", "nvfp4:rht_sise=4", "--out", str(tmp_path / "z")]) == cli.EXIT_USAGE
  assert "Unknown option(s) ['rht_sise'] for recipe 'nvfp4' (did you mean 'rht_size'?); valid: [" in (
      capsys.readouterr().err)


def test_cli_without_a_command_prints_the_usage_and_fails(capsys):
  """`fp4jax` alone prints the usage and exits 2 (a script that forgot the command must not pass); --help exits 0."""
  assert cli.main([]) == cli.EXIT_USAGE
  assert "fp4jax train" in capsys.readouterr().out
  assert cli.main(["--help"]) == 0


def test_cli_maps_divergence_to_exit_code(monkeypatch, capsys):
  def diverge(config):
    raise trainer.TrainingDiverged(3, float("nan"), 1.0, 2)

  monkeypatch.setattr(trainer, "train", diverge)
  assert cli.main(["train", "--steps", "4", "--out", "unused"]) == cli.EXIT_DIVERGED
  err = capsys.readouterr().err
  assert "diverged at step 3" in err and "last good checkpoint is step 2" in err


@pytest.mark.slow
def test_cli_eval_prints_latest_val_loss(env, tmp_path, capsys):
  summary = run(env, make_config(env, tmp_path, recipe="bf16"))
  assert cli.main(["eval", "--out", str(tmp_path), "--json"]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["step"] == STEPS
  assert result["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-6)
  # --resume starts from the stored config; given options change it.
  resumed = cli.config_from_args(["--resume", "--out", str(tmp_path), "--steps", "20"])
  assert resumed == make_config(env, tmp_path, recipe="bf16", steps=20, resume=True)


def test_python_m_entry_point_help():
  proc = subprocess.run([sys.executable, "-m", "fp4jax", "train", "--help"], cwd=REPO, capture_output=True, text=True,
                        timeout=120, env={**os.environ, "PYTHONPATH": REPO})
  assert proc.returncode == 0, proc.stderr
  assert "--recipe" in proc.stdout and "--bf16-last" in proc.stdout


def test_each_step_key_is_the_run_key_folded_with_the_step():
  """The trainer's per-step key (pinned apart from the slow training test that checks it)."""
  keyed = steps_lib.with_step_key(lambda state, batch, key: key)
  state = steps_lib.TrainState(params=None, opt_state=None, step=jnp.int32(5))
  got = keyed(state, None, jax.random.key(0))
  np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(jax.random.fold_in(jax.random.key(0), 5)))


# --- the loop's bookkeeping, with a step that only counts (no model step is built: a fast test) -------------------

def _counting_steps(monkeypatch, diverge_at=None):
  """Phases hand out a step that only advances the step counter (loss 2.5, finite until step `diverge_at`): no
  train step is built, so the loop's cadences, records and checkpoints run in a fast test."""
  def cached_train_step(self, step, oc_phase):
    del self, step, oc_phase
    def counting_step(state, batch, key, schedule):
      del batch, key, schedule
      finite = True if diverge_at is None else state.step < diverge_at
      return state._replace(step=state.step + 1), {"loss": jnp.float32(2.5), "grad_norm": jnp.float32(1.0),
                                                    "finite": jnp.asarray(finite)}
    return counting_step
  monkeypatch.setattr(steps_lib.Phases, "_cached_train_step", cached_train_step)


def _logged_steps(out):
  return [r["step"] for r in metrics.read_metrics(out)]


def test_loop_logs_the_last_step_counts_this_calls_tokens_and_resumes_the_bar(env, tmp_path, monkeypatch, capsys):
  """Pins the loop's bookkeeping: metrics rows every log_every steps plus the last step (no final row when nothing
  was measured at the end), the final checkpoint, a resumed call's tokens (its own steps only) and its progress bar
  (starting at the resumed step)."""
  _counting_steps(monkeypatch)
  out = tmp_path / "run"
  config = tiny_config(env, out, steps=6, log_every=4, checkpoint_every=100, batch_size=2)
  first = run(env, config)
  assert _logged_steps(out) == [0, 4, 5]
  assert first["checkpoint_step"] == 6 and first["tokens"] == 6 * 2 * 32
  capsys.readouterr()
  resumed = run(env, config.replace(resume=True, steps=8, progress=True))
  assert _logged_steps(out) == [0, 4, 5, 7]
  assert resumed["start_step"] == 6 and resumed["tokens"] == 2 * 2 * 32 and resumed["checkpoint_step"] == 8
  assert "8/8" in capsys.readouterr().err


def test_loop_saves_the_trained_state_when_a_hook_raises_after_the_last_step(env, tmp_path, monkeypatch):
  """A hook raising after the last step (not the final call) saves that step's output as checkpoint `steps`."""
  _counting_steps(monkeypatch)

  def fail_at_last(step, record):
    del record
    if step == 3:
      raise KeyError("my metric")

  with pytest.raises(KeyError, match="my metric"):
    run(env, tiny_config(env, tmp_path / "run", steps=4, checkpoint_every=100, batch_size=2), hooks=[fail_at_last])
  assert _checkpoint_steps(tmp_path / "run") == [4]


def test_divergence_after_a_resume_names_the_checkpoint_resumed_from(env, tmp_path, monkeypatch):
  """A resumed run that diverges before saving again names the checkpoint it resumed from as the last good one."""
  _counting_steps(monkeypatch)
  config = tiny_config(env, tmp_path / "run", steps=4, checkpoint_every=100, batch_size=2)
  run(env, config)
  _counting_steps(monkeypatch, diverge_at=5)
  with pytest.raises(trainer.TrainingDiverged) as e:
    run(env, config.replace(resume=True, steps=8))
  assert e.value.step == 5 and e.value.last_checkpoint == 4


@pytest.mark.parametrize("signum, stopped", [(signal.SIGTERM, trainer.Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_sigterm_saves_a_checkpoint_after_the_step_as_ctrl_c_does(env, tmp_path, monkeypatch, signum, stopped):
  """A batch scheduler stops (or preempts) a job with SIGTERM: it killed the run, losing the steps since the last
  checkpoint and leaving an orbax tmp folder. It now stops the loop after the step, with a checkpoint, as Ctrl-C
  does, and raises Terminated (a KeyboardInterrupt); the handlers are restored afterwards."""
  _counting_steps(monkeypatch)
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

  def stop_at_2(step, record):
    del record
    if step == 2:
      os.kill(os.getpid(), signum)

  out = tmp_path / "run"
  with pytest.raises(stopped) as e:
    run(env, tiny_config(env, out, steps=20, checkpoint_every=100, batch_size=2), hooks=[stop_at_2])
  assert isinstance(e.value, trainer.Terminated) == (signum == signal.SIGTERM)
  saved = _checkpoint_steps(out)
  assert len(saved) == 1 and 3 <= saved[0] <= 4, saved  # after the step in flight when the hook ran
  assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_stop_signal_aborts_at_once():
  with trainer._stop_flag() as flag:  # pylint: disable=protected-access
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.is_set() and flag.signum == signal.SIGTERM
    with pytest.raises(trainer.Terminated):
      os.kill(os.getpid(), signal.SIGTERM)


def test_cli_exits_143_on_sigterm_and_130_on_ctrl_c(monkeypatch, capsys):
  for error, code in ((trainer.Terminated, 143), (KeyboardInterrupt, 130)):
    def stop(config, error=error):
      raise error
    monkeypatch.setattr(trainer, "train", stop)
    assert cli.main(["train", "--steps", "4", "--out", "unused"]) == code
  assert "terminated (SIGTERM)" in capsys.readouterr().err
