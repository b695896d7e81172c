"""Tests for resuming through fp4jax.pretrain.resume / trainer / cli: a corrupt latest checkpoint falls back to the
previous one and loses nothing (the resumed run equals the uninterrupted one bit for bit, the corrupt folder is kept
renamed); --resume-step N works with later (corrupt) checkpoints; a new --steps is reported as the new schedule it
is, and --keep-schedule keeps the stored warmup/decay lengths exactly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax import gemm
from fp4jax import recipes
from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import metrics
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import resume as resume_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from fp4jax.pretrain.data import DataIdentity
from train_helpers import tiny_config, train_step_compiles, tree_equal


def make_config(env, out, **changes) -> TrainConfig:
  run = dict(batch_size=4, steps=12, recipe="bf16", lr=1e-2, warmup_fraction=0.25, decay_fraction=0.25,
             checkpoint_every=4)
  return tiny_config(env, out, **{**run, **changes})


def snapshot(folder):
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def zero_array_data(step_dir):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for p in files:
    p.write_bytes(b"\0" * p.stat().st_size)


@pytest.mark.slow
def test_corrupt_checkpoints_fall_back_and_lose_nothing(env, tmp_path):
  straight = trainer.train(make_config(env, tmp_path / "a"), log=None, compile_cache=env["cache"])
  out = tmp_path / "b"
  trainer.train(make_config(env, out), log=None, compile_cache=env["cache"])
  ck_dir = ckpt.checkpoint_dir(out)
  zero_array_data(ck_dir / "12")
  corrupt = snapshot(ck_dir / "12")
  with open(out / metrics.METRICS_FILE, "a", encoding="utf-8") as f:  # and a record the dying process cut short
    f.write('{"step": 12, "loss": ')

  # --resume: 12 is unreadable, so the run restarts from 8, and reproduces steps 8..11 bit for bit.
  log = []
  config = cli.config_from_args(["--resume", "--out", str(out)])
  seen = []  # the checkpoint's GEMM mode reaches the note (a bf16 recipe has none to give: see the fast tests)
  note = lambda stored, recipe: seen.append((stored, recipe)) or "Note: GEMM mode sentinel"
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(resume_lib, "gemm_mode_note", note)
    resumed = trainer.train(config, log=log.append, compile_cache=env["cache"])
  assert seen == [(gemm.resolve_gemm_mode(config.policy.recipe), config.policy.recipe)]
  assert "Note: GEMM mode sentinel" in log
  assert resumed["start_step"] == 8
  assert resumed["losses"] == straight["losses"][8:]  # exact float equality
  assert tree_equal(resumed["params"], straight["params"])
  moved = list((out / resume_lib.MOVED_DIR).iterdir())
  assert [p.name.split(".")[:2] for p in moved] == [["12", "corrupt"]]
  assert snapshot(moved[0]) == corrupt  # kept, renamed, byte for byte
  assert any("Moved checkpoint 12 aside" in line for line in log)
  assert any("was cut short" in line for line in log)
  assert [r["loss"] for r in metrics.read_metrics(out)] == straight["losses"]

  # --resume-step 4 with a later corrupt checkpoint (the new 12, damaged again) and a readable one (8).
  (ck_dir / "12" / "meta" / "metadata").write_text("{not json")
  config = cli.config_from_args(["--resume", "--resume-step", "4", "--out", str(out)])
  branch = [r for r in metrics.read_metrics(out) if r["step"] >= 4]
  resumed = trainer.train(config, log=None, compile_cache=env["cache"])
  assert resumed["start_step"] == 4 and resumed["losses"] == straight["losses"][4:]
  assert tree_equal(resumed["params"], straight["params"])
  names = sorted(p.name.split(".")[:2] for p in (out / resume_lib.MOVED_DIR).iterdir())
  assert names == [["12", "after-resume-4"], ["12", "corrupt"], ["8", "after-resume-4"],
                   ["metrics", "after-resume-4"]]
  # The abandoned branch's metric records are kept beside its checkpoints, not dropped.
  kept = next((out / resume_lib.MOVED_DIR).glob("metrics.after-resume-4.*.jsonl"))
  assert [json.loads(line) for line in kept.read_text().splitlines()] == branch
  manager = ckpt.open_manager(out, create=False)
  assert ckpt.available_steps(manager) == [4, 8, 12]
  manager.close()


@pytest.mark.slow
def test_multi_process_resume_refuses_corrupt_fallback_and_moves_from_process_0_only(env, tmp_path, monkeypatch):
  out = tmp_path / "run"
  trainer.train(make_config(env, out), log=None, compile_cache=env["cache"])
  ck_dir = ckpt.checkpoint_dir(out)
  zero_array_data(ck_dir / "12")
  waits = []
  monkeypatch.setattr(resume_lib.distributed, "any_process", lambda flag: waits.append(flag) or bool(flag))
  config = make_config(env, out, resume=True)
  state = _fresh_state(config)
  # Unreadable newest checkpoint, several processes: a clear error, nothing moved.
  with pytest.raises(ckpt.CorruptCheckpointError, match="multi-process run"):
    resume_lib.restore_readable(out, state, log=None, process_index=0, process_count=2)
  assert not (out / resume_lib.MOVED_DIR).exists()
  # An explicit --resume-step: process 1 restores and waits, moving nothing; process 0 moves the later ones.
  start, _, _ = resume_lib.restore_readable(out, state, 4, log=None, process_index=1, process_count=2)
  assert start == 4 and waits == [False] and not (out / resume_lib.MOVED_DIR).exists()
  start, _, _ = resume_lib.restore_readable(out, state, 4, log=lambda _: None, process_index=0, process_count=2)
  assert start == 4 and waits == [False, False]
  assert sorted(p.name.split(".")[0] for p in (out / resume_lib.MOVED_DIR).iterdir()) == ["12", "8"]


def _fresh_state(config):
  model = trainer.build_model(config, trainer.run_keys(config.seed)["init"])
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  params = nnx.state(model, nnx.Param)
  return steps_lib.TrainState(params=params, opt_state=optimizer.init(params),
                              step=jnp.asarray(0, jnp.int32))._asdict()


def _save_fake_run(out, stored: TrainConfig, steps=(4, 8)):
  """Checkpoints of a stand-in state (one array each) with `stored` as their config: enough for trainer._resume."""
  manager = ckpt.open_manager(out)
  for step in steps:
    state = steps_lib.TrainState(params={"w": jnp.full(3, step, jnp.float32)}, opt_state={"m": jnp.zeros(3)},
                                 step=jnp.asarray(step, jnp.int32))
    ckpt.save(manager, step, state._asdict(), {"config": stored.to_dict()}, force=True)
  manager.wait_until_finished()
  manager.close()
  return steps_lib.TrainState(params={"w": jnp.zeros(3)}, opt_state={"m": jnp.zeros(3)},
                              step=jnp.asarray(0, jnp.int32))


@pytest.mark.parametrize("case", ["switch", "beyond_steps"])
def test_a_refused_resume_moves_nothing_aside(tmp_path, case):
  """The BF16-switch and --steps checks ran after restore_readable had moved checkpoints aside: a refused
  --resume-step 4 still moved checkpoint 8 to checkpoints_moved/, and a refused resume past an unreadable 8 moved 8."""
  stored = TrainConfig.from_options(out=str(tmp_path), steps=8, switch_at=0.25, checkpoint_every=4)  # switch: 2
  state = _save_fake_run(tmp_path, stored)
  data = DataIdentity(corpus="c", fingerprint="f", tokenizer="byte", vocab_size=256, num_files=1, num_bytes=1,
                      cache_key="k")
  if case == "switch":  # the switch would move to step 5, so step 4 would run nvfp4 again
    refused, want = stored.replace(resume=True, resume_step=4, steps=20), "would run nvfp4 again"
    accepted = stored.replace(resume=True, resume_step=4)
  else:
    (ckpt.checkpoint_dir(tmp_path) / "8" / "meta" / "metadata").write_text("{not json")  # 8 unreadable: back to 4
    refused, want = stored.replace(resume=True, steps=3), "Checkpoint step 4 is beyond --steps 3"
    accepted = stored.replace(resume=True)
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match=want):
    trainer._resume(refused, state, tmp_path, lambda _: None, data)  # pylint: disable=protected-access
  assert snapshot(tmp_path) == before and not (tmp_path / resume_lib.MOVED_DIR).exists()
  log = []
  start, _ = trainer._resume(accepted, state, tmp_path, log.append, data)  # pylint: disable=protected-access
  assert start == 4 and any("Moved checkpoint 8 aside" in line for line in log), log  # what a refusal spared


@pytest.mark.parametrize("steps", [8, 12])
def test_extending_a_finished_run_keeps_its_final_records_beside(tmp_path, steps):
  """--resume --steps 12 of a finished 8-step run dropped its final val_loss (step 8, not on the longer run's
  validation schedule) and kept it nowhere. A resume of the same length keeps nothing beside: it validates at step 8
  again, as the run did."""
  stored = TrainConfig.from_options(out=str(tmp_path), steps=8, checkpoint_every=4)
  state = _save_fake_run(tmp_path, stored)
  data = DataIdentity(corpus="c", fingerprint="f", tokenizer="byte", vocab_size=256, num_files=1, num_bytes=1,
                      cache_key="k")
  records = [{"step": 7, "loss": 3.6}, {"step": 8, "val_loss": 3.5}]
  (tmp_path / metrics.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
  log = []
  start, _ = trainer._resume(stored.replace(resume=True, steps=steps), state, tmp_path, log.append, data)  # pylint: disable=protected-access
  assert start == 8
  kept = list((tmp_path / resume_lib.MOVED_DIR).glob("metrics.after-resume-8.*.jsonl"))
  left = [json.loads(line) for line in (tmp_path / metrics.METRICS_FILE).read_text().splitlines()]
  assert left == records[:1]
  if steps == 8:
    assert not kept
  else:
    assert [json.loads(line) for line in kept[0].read_text().splitlines()] == records[1:]
    assert any(f"dropped 1 later metric record, kept in {kept[0]}" in line for line in log), log


def test_extending_past_an_unreadable_final_checkpoint_keeps_the_final_records_too(tmp_path):
  """Checkpoint 8 unreadable: the resume falls back to 4, and the dropped records (the final val_loss among them)
  are kept beside all the same."""
  stored = TrainConfig.from_options(out=str(tmp_path), steps=8, checkpoint_every=4)
  state = _save_fake_run(tmp_path, stored)
  (ckpt.checkpoint_dir(tmp_path) / "8" / "meta" / "metadata").write_text("{not json")
  data = DataIdentity(corpus="c", fingerprint="f", tokenizer="byte", vocab_size=256, num_files=1, num_bytes=1,
                      cache_key="k")
  records = [{"step": 3, "loss": 3.7}, {"step": 7, "loss": 3.6}, {"step": 8, "val_loss": 3.5}]
  (tmp_path / metrics.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
  start, _ = trainer._resume(stored.replace(resume=True, steps=12), state, tmp_path, lambda _: None, data)  # pylint: disable=protected-access
  [kept] = (tmp_path / resume_lib.MOVED_DIR).glob("metrics.after-resume-4.*.jsonl")
  assert start == 4 and [json.loads(line) for line in kept.read_text().splitlines()] == records[1:]


def test_an_explicit_resume_step_moves_only_the_later_checkpoints_aside(tmp_path):
  """--resume-step 8 of checkpoints 4, 8, 12: 12 is moved aside, 8 (the one restored) and 4 stay where they are."""
  stored = TrainConfig.from_options(out=str(tmp_path), steps=16, checkpoint_every=4)
  state = _save_fake_run(tmp_path, stored, steps=(4, 8, 12))
  log = []
  start, restored, _ = resume_lib.restore_readable(tmp_path, state._asdict(), 8, log=log.append)
  assert start == 8 and np.asarray(restored["params"]["w"]).tolist() == [8.0] * 3
  assert [p.name.split(".")[:2] for p in (tmp_path / resume_lib.MOVED_DIR).iterdir()] == [["12", "after-resume-8"]]
  manager = ckpt.open_manager(tmp_path, create=False)
  assert ckpt.available_steps(manager) == [4, 8]
  manager.close()


def test_keep_schedule_keeps_warmup_decay_and_switch_in_steps():
  stored = TrainConfig.from_options(steps=100, warmup_fraction=0.1, decay_fraction=0.2, min_lr_ratio=0.1,
                                    switch_at=0.9)
  longer = resume_lib.keep_schedule(stored, stored.replace(steps=250))
  assert round(longer.optimizer.warmup_fraction * 250) == 10 and round(longer.optimizer.decay_fraction * 250) == 20
  assert longer.policy.switch_step(250) == 240
  lr_old = np.asarray(optimizer_lib.lr_schedule(stored.optimizer, stored.steps)(np.arange(100)))
  lr_new = np.asarray(optimizer_lib.lr_schedule(longer.optimizer, longer.steps)(np.arange(250)))
  np.testing.assert_array_equal(lr_new[:80], lr_old[:80])  # warmup and stable phase: identical
  np.testing.assert_array_equal(lr_new[80:230], lr_old[79])  # the stable phase absorbs the 150 new steps
  np.testing.assert_array_equal(lr_new[230:], lr_old[80:])  # the same decay, moved to the new end
  assert resume_lib.keep_schedule(stored, stored) == stored
  with pytest.raises(ValueError, match="do not fit"):
    resume_lib.keep_schedule(stored, stored.replace(steps=25))
  # A checkpoint at step 6 has run steps 0..5: a switch at 6 has not happened, so it keeps its distance from the
  # end; from a checkpoint at 7 it has, and stays where it was.
  ten = TrainConfig.from_options(steps=10, switch_at=6)
  assert resume_lib.keep_schedule(ten, ten.replace(steps=20), start=6).policy.switch_at == 16
  assert resume_lib.keep_schedule(ten, ten.replace(steps=20), start=7).policy.switch_at == 6


@pytest.mark.slow
def test_runs_that_differ_only_in_schedule_share_one_compiled_step(env, tmp_path, monkeypatch):
  """The schedule's numbers were constants of the compiled train step: `--resume --steps 4` of a 2-step run, and
  every run of another length or peak LR, compiled the step again (4-13 s each on 2 cores)."""
  cache = steps_lib.CompileCache()
  first = make_config(env, tmp_path / "a", steps=2, checkpoint_every=2)
  other = make_config(env, tmp_path / "b", steps=3, lr=3e-3, warmup_fraction=0.0, decay_fraction=0.7,
                      min_lr_ratio=0.1, decay_shape="1-sqrt")
  with train_step_compiles(monkeypatch) as compiles:
    short = trainer.train(first, log=None, compile_cache=cache)
    assert compiles == [False]  # compiled here
    longer = trainer.train(first.replace(resume=True, steps=4), log=None, compile_cache=cache)
    assert compiles == [False]  # the same compiled step (CompileCache)
    lower = trainer.train(other, log=None, compile_cache=steps_lib.CompileCache())
    assert compiles == [False, True]  # as a new process sees it: served by JAX's persistent cache
  assert len(longer["losses"]) == 2 and lower["losses"][0] == short["losses"][0]  # same params at step 0
  assert lower["losses"][1] != short["losses"][1]  # ... but another learning rate: the step reads its schedule


def test_a_run_that_switched_to_bf16_is_not_switched_back():
  """Lengthening a run past its switch moved a fractional switch later: steps 6..12 of a 20-step resume of a 10-step
  run switched at step 3 ran NVFP4 again, and the switch happened twice."""
  stored = TrainConfig.from_options(steps=10, switch_at=0.3)
  with pytest.raises(ValueError, match=r"switched to BF16 at step 3; .* moves the switch to step 6, so steps 4\.\.5"):
    resume_lib.check_switch_kept(stored, stored.replace(steps=20), 4)
  resume_lib.check_switch_kept(stored, stored.replace(steps=20), 3)  # not switched yet at the checkpoint
  resume_lib.check_switch_kept(stored, stored.replace(steps=20, switch_at=3), 6)
  # A longer run whose switch moves to exactly the checkpoint's step runs BF16 from there on: nothing runs nvfp4 again.
  resume_lib.check_switch_kept(stored, stored.replace(steps=20, switch_at=4), 4)
  # --keep-schedule keeps a switch already made where it was, and one still ahead as far from the end.
  assert resume_lib.keep_schedule(stored, stored.replace(steps=20), 6).policy.switch_step(20) == 3
  assert resume_lib.keep_schedule(stored, stored.replace(steps=20), 2).policy.switch_step(20) == 13
  # Dropping the switch on resume is allowed, and said.
  note = resume_lib.schedule_note(stored, stored.replace(steps=20, switch_at=None), 6)
  assert ("switched to BF16 at step 3; with the switch removed (--switch-at None), steps from 6 on run nvfp4 again"
          in note)
  # Another switch step that also lies before the checkpoint changes nothing from there on, and the note says so
  # (it said the result equals neither the stored run continued nor a fresh run).
  note = resume_lib.schedule_note(stored, stored.replace(switch_at=2), 6)
  assert note.endswith("both lie at or before step 6, so from there on the run is the stored run continued.")
  assert "neither" in resume_lib.schedule_note(stored, stored.replace(switch_at=8), 6)
  # --switch forward after a switch of all GEMMs brings the backward back to NVFP4: said.
  assert resume_lib.switch_mode_note(stored, stored.replace(switch="forward"), 6) == (
      "Note: the stored run switched all GEMMs to BF16 at step 3; with --switch forward, Dgrad and Wgrad run nvfp4 "
      "again from step 6.")
  assert resume_lib.switch_mode_note(stored, stored.replace(switch="forward"), 3) is None  # not switched yet
  assert resume_lib.switch_mode_note(stored.replace(switch="forward"), stored, 6) is None  # switches more


def test_checkpoint_meta_records_the_gemm_mode_auto_resolved_to(env, tmp_path):
  config = make_config(env, tmp_path, recipe="nvfp4")
  meta = trainer._checkpoint_meta(config, 0, 0)
  assert meta["gemm_mode"] == gemm.auto_gemm_mode(jax.default_backend(), gemm.cpu_flags())
  assert trainer._checkpoint_meta(make_config(env, tmp_path, recipe="nvfp4:gemm_mode=bf16"), 0, 0)["gemm_mode"] == "bf16"


def test_gemm_mode_note_when_auto_resolves_to_another_mode_here():
  here = gemm.resolve_gemm_mode(recipes.nvfp4())
  other = {"bf16": "f32", "f32": "bf16"}[here]
  note = resume_lib.gemm_mode_note(other, recipes.nvfp4())
  assert note.startswith("Note:") and f"gemm_mode '{other}'" in note and f"'{here}' on this machine" in note
  assert resume_lib.gemm_mode_note(here, recipes.nvfp4()) is None
  assert resume_lib.gemm_mode_note(None, recipes.nvfp4()) is None  # a checkpoint from before the mode was stored
  assert resume_lib.gemm_mode_note(other, recipes.nvfp4(gemm_mode=here)) is None  # named: the config says it
  assert resume_lib.gemm_mode_note(other, recipes.bf16()) is None  # nothing quantized: no quantized GEMM


def test_schedule_note_says_what_a_new_steps_does():
  stored = TrainConfig.from_options(steps=100, lr=1.0, warmup_fraction=0.1, decay_fraction=0.2)
  assert resume_lib.schedule_note(stored, stored.replace(resume=True, eval_every=7), 60) is None
  finished = resume_lib.schedule_note(stored, stored.replace(steps=200), 100)
  assert "LR at step 100: 0 in the stored schedule, 1 now" in finished
  assert "this is a new schedule" in finished and "finished its decay; the learning rate rises again" in finished
  # From a stable-phase checkpoint with the schedule kept, the steps taken agree with a fresh longer run.
  kept = resume_lib.schedule_note(stored, resume_lib.keep_schedule(stored, stored.replace(steps=200)), 50)
  assert "equals a fresh 200-step run" in kept and "rises again" not in kept
  # Without --keep-schedule, warmup 20 steps instead of 10: the first 50 steps differ.
  assert "new schedule" in resume_lib.schedule_note(stored, stored.replace(steps=200), 50)
  lower = resume_lib.schedule_note(stored, stored.replace(lr=0.5), 50)
  assert "with other schedule settings: the learning-rate schedule is recomputed. LR at step 50: 1 " in lower
  switched = resume_lib.schedule_note(stored.replace(switch_at=0.9), stored.replace(steps=200, switch_at=0.9), 100)
  assert "the learning-rate schedule and the BF16 switch are recomputed for 200 steps" in switched


def test_schedule_note_does_not_call_a_run_with_other_changes_a_fresh_run():
  """`--resume --steps 8 --seed 7` of a finished 6-step run said "this run equals a fresh 8-step run", then that the
  changed seed makes it differ from an uninterrupted one."""
  stored = TrainConfig.from_options(steps=100, lr=1.0, warmup_fraction=0.1, decay_fraction=0.2)
  longer = resume_lib.keep_schedule(stored, stored.replace(steps=200))
  kept = resume_lib.schedule_note(stored, longer, 50, others_changed=True)
  assert "agree on steps 0..49 (the other changed settings, said below, make the run differ" in kept
  assert "equals a fresh" not in kept
  switch = resume_lib.schedule_note(stored.replace(switch_at=10), stored.replace(switch_at=20), 30, others_changed=True)
  assert "the stored run continued as far as the switch goes" in switch


def test_schedule_settings_are_not_other_changes():
  """The schedule note compares with a fresh run of the new settings: a new min_lr_ratio, decay shape or lr is part
  of that run (the note then says so), a new weight decay or seed is not, nor are validation settings."""
  stored = TrainConfig.from_options(steps=100, lr=1.0, warmup_fraction=0.1, decay_fraction=0.2)
  unscheduled = lambda **changes: trainer._unscheduled_changes(stored.to_dict(), stored.replace(**changes))
  assert unscheduled(steps=200, min_lr_ratio=0.1, decay_shape="1-sqrt", lr=0.5, warmup_fraction=0.2) == []
  assert unscheduled(steps=200, eval_every=7) == []
  assert unscheduled(steps=200, weight_decay=0.0, seed=3) == ["seed", "weight_decay"]


def test_changed_validation_settings_are_not_said_to_change_the_run():
  """Another --eval-every / --eval-batches / --stats-every was said to make the run differ from an uninterrupted
  one; validation and statistics have their own PRNG streams, so only their records change."""
  stored = TrainConfig.from_options(steps=100, eval_every=10, eval_batches=1)
  notes = trainer._changes_notes(stored.to_dict(), stored.replace(eval_every=5, eval_batches=2, stats_every=5),
                                 schedule_said=False)
  assert len(notes) == 1 and "changed validation settings ['eval_batches', 'eval_every', 'stats_every']" in notes[0]
  assert "training runs as it would have" in notes[0]
  notes = trainer._changes_notes(stored.to_dict(), stored.replace(eval_every=5, weight_decay=0.0),
                                 schedule_said=False)
  assert notes[0] == ("Note: resuming with changed settings ['weight_decay']; the run will differ from an "
                      "uninterrupted one.")
  assert "['eval_every']" in notes[1]
  assert trainer._changes_notes(stored.to_dict(), stored.replace(progress=False), schedule_said=False) == []


def test_schedule_note_only_for_settings_the_schedule_reads():
  """A new --weight-decay (or beta, eps, clip) once read as "the learning-rate schedule is recomputed ... this run
  equals a fresh 100-step run", which it does not; the changed-settings note covers it instead."""
  stored = TrainConfig.from_options(steps=100, lr=1.0, warmup_fraction=0.1, decay_fraction=0.2)
  for change in (dict(weight_decay=0.0), dict(b1=0.8), dict(b2=0.99), dict(eps=1e-6), dict(grad_clip=0.5)):
    assert resume_lib.schedule_note(stored, stored.replace(**change), 50) is None, change
  for change in (dict(min_lr_ratio=0.1), dict(decay_shape="1-sqrt")):
    assert "schedule is recomputed" in resume_lib.schedule_note(stored, stored.replace(**change), 50), change


def test_schedule_note_for_a_constant_learning_rate():
  """Without warmup and decay the schedule is one constant: it once came back as a scalar for any number of steps,
  and the note's per-step comparison raised IndexError (e.g. `--steps 2`, then `--resume --steps 4`)."""
  flat = dict(lr=1e-3, warmup_fraction=0.0, decay_fraction=0.0)
  stored = TrainConfig.from_options(steps=2, **flat)
  lrs = optimizer_lib.lr_schedule(stored.optimizer, 2)(np.arange(5))
  assert lrs.shape == (5,) and np.all(np.asarray(lrs) == np.float32(1e-3))
  longer = resume_lib.schedule_note(stored, stored.replace(steps=4), 2)
  assert "recomputed for 4 steps" in longer and "Both schedules agree on steps 0..1" in longer
  assert "new schedule" in resume_lib.schedule_note(stored, stored.replace(steps=4, lr=2e-3), 2)


@pytest.mark.slow
def test_cli_keep_schedule(env, tmp_path):
  trainer.train(make_config(env, tmp_path, steps=4, switch_at=0.5), log=None, compile_cache=env["cache"])
  config = cli.config_from_args(["--resume", "--out", str(tmp_path), "--steps", "8", "--keep-schedule"])
  assert config.steps == 8 and config.optimizer.warmup_fraction == 1 / 8 and config.optimizer.decay_fraction == 1 / 8
  assert config.policy.switch_at == 2  # switched at step 2 before the step-4 checkpoint: it stays there
  longer = cli.config_from_args(["--resume", "--out", str(tmp_path), "--steps", "10"])  # the switch moves to 5
  with pytest.raises(ValueError, match="so step 4 would run bf16 again"):
    trainer.train(longer, log=None, compile_cache=env["cache"])
  with pytest.raises(ValueError, match="do not also pass \\['--warmup-fraction'\\]"):
    cli.config_from_args(["--resume", "--out", str(tmp_path), "--steps", "8", "--keep-schedule",
                          "--warmup-fraction", "0.5"])
  assert cli.config_from_args(["--resume", "--out", str(tmp_path), "--steps", "8"]).optimizer.warmup_fraction == 0.25


@pytest.mark.slow
def test_resume_with_fewer_kept_checkpoints_says_older_ones_go(env, tmp_path):
  """A Python resume with the default keep=3 silently deleted the older checkpoints a keep=10 run had kept.
  Another eval_batches (or batch_size, seq_len) moves the validation windows: said too."""
  trainer.train(make_config(env, tmp_path, steps=8, checkpoint_every=2, keep_checkpoints=10, eval_batches=1),
                log=None, compile_cache=env["cache"])
  log = []
  trainer.train(make_config(env, tmp_path, steps=10, checkpoint_every=2, resume=True, eval_batches=2),
                log=log.append, compile_cache=env["cache"])
  assert any("keeps 3 checkpoints (--keep-checkpoints), the stored run kept 10" in line for line in log)
  assert any("from step 8 on val_loss is measured on other windows" in line for line in log)
  manager = ckpt.open_manager(tmp_path, create=False)
  assert ckpt.available_steps(manager) == [6, 8, 10]  # what the note announced
  manager.close()


@pytest.mark.slow
def test_a_resume_with_other_changes_is_not_called_a_fresh_run(env, tmp_path):
  """The schedule note said "this run equals a fresh 12-step run" of a resume that also changed weight decay (the
  next note said the run differs)."""
  stored = make_config(env, tmp_path, steps=8)
  trainer.train(stored, log=None, compile_cache=env["cache"])
  log = []
  again = make_config(env, tmp_path, steps=12, resume=True, resume_step=4, weight_decay=0.0)
  trainer.train(resume_lib.keep_schedule(stored, again), log=log.append, compile_cache=env["cache"])
  text = "\n".join(log)
  assert "Both schedules agree on steps 0..3 (the other changed settings, said below, make the run differ" in text
  assert "equals a fresh" not in text and "changed settings ['weight_decay']" in text
