"""Tests for fp4jax.pretrain.checkpoint and fp4jax.pretrain.resume: bit-exact round trip, clear errors for missing or
mismatched checkpoints, corrupt or superseded checkpoints moved aside byte for byte (never deleted or changed)."""

import contextlib
import dataclasses
import errno
import json
import pathlib
import resource
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import data
from fp4jax.pretrain import metrics
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import resume as resume_lib
from fp4jax.pretrain import runfolder
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import run, tiny_config


@pytest.fixture(scope="module")
def data_config(tmp_path_factory):
  return data.DataConfig(cache_dir=str(tmp_path_factory.mktemp("data_cache")))


def make_config(data_config, out, **changes) -> TrainConfig:
  base = dict(out=str(out), model=model_lib.get_model_config("tiny", n_layers=1), data=data_config, seq_len=32,
              steps=16, recipe="bf16", progress=False)
  base.update(changes)
  return TrainConfig.from_options(**base)


def make_state(config, seed=0) -> dict:
  """A train state with non-trivial optimizer moments (random values in every float leaf)."""
  model = trainer.build_model(config, jax.random.key(seed))
  params = nnx.state(model, nnx.Param)
  opt_state = jax.jit(optimizer_lib.make_optimizer(config.optimizer, config.steps).init)(params)
  state = steps_lib.TrainState(params, opt_state, jnp.asarray(7, jnp.int32))._asdict()
  return _randomize(state, jax.random.key(seed + 1))


@jax.jit
def _randomize(tree, key):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  leaves = [jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, leaves)


def save_run(config, steps=(4, 8)):
  """Checkpoints at `steps` as train() writes them, plus a metrics file."""
  manager = ckpt.open_manager(config.out)
  for step in steps:
    state = make_state(config, seed=step)
    state["step"] = jnp.asarray(step, jnp.int32)
    ckpt.save(manager, step, state, trainer._checkpoint_meta(config, step, 0), force=True)
  manager.wait_until_finished()
  manager.close()
  with metrics.MetricsLog(config.out) as log:
    for step in range(max(steps)):
      log.write({"step": step, "loss": 1.0})


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_round_trip_is_bit_exact(data_config, tmp_path):
  config = make_config(data_config, tmp_path)
  state = make_state(config)
  meta = trainer._checkpoint_meta(config, 7, 0)
  manager = ckpt.open_manager(tmp_path)
  assert ckpt.save(manager, 7, state, meta, force=True)
  manager.wait_until_finished()
  step, restored, restored_meta = ckpt.restore(manager, make_state(config, seed=3))
  manager.close()
  assert step == 7 and restored_meta == meta
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  assert TrainConfig.from_dict(restored_meta["config"]) == config
  assert restored_meta["policy"] == config.policy.to_dict() and restored_meta["data_position"] == 7


@pytest.mark.slow
def test_the_newest_checkpoint_is_the_default(data_config, tmp_path):
  """restore, restore_meta and resume_meta default to the newest step (every other test had one checkpoint)."""
  config = make_config(data_config, tmp_path)
  save_run(config, steps=(4, 8))
  manager = ckpt.open_manager(tmp_path, create=False)
  assert ckpt.restore_meta(manager)[0] == 8
  step, state, _ = ckpt.restore(manager, make_state(config))
  assert step == 8 and int(state["step"]) == 8
  manager.close()
  assert resume_lib.resume_meta(tmp_path)[0] == 8


@pytest.mark.slow
def test_restore_into_another_model_is_refused(data_config, tmp_path):
  config = make_config(data_config, tmp_path)
  save_run(config, steps=(4,))
  target = make_state(config)
  wider = dict(target, params=jax.tree.map(  # as if d_ff had changed: one kernel of another shape
      lambda x: jax.ShapeDtypeStruct((x.shape[0], 2 * x.shape[1]), x.dtype) if x.shape == (64, 192) else x,
      target["params"]))
  manager = ckpt.open_manager(tmp_path, create=False)
  with pytest.raises(ckpt.CheckpointError, match="Checkpoint 4 .* does not match .* stored \\(64, 192\\) float32, "
                     "expected \\(64, 384\\) float32"):
    ckpt.restore(manager, wider)
  fewer = dict(target, params={k: v for k, v in target["params"].items() if k != "lm_head"})
  with pytest.raises(ckpt.CheckpointError, match="unexpected params.lm_head"):
    ckpt.restore(manager, fewer)
  with pytest.raises(ckpt.CheckpointError, match="No checkpoint for step 5"):
    ckpt.restore(manager, target, step=5)
  manager.close()


def test_a_mismatch_names_the_params_before_the_optimizer_copies(tmp_path):
  def state(width):  # mu and nu sort before params, and would fill the five problems the error lists
    params = {"blocks": {str(i): jnp.zeros((4, width)) for i in range(6)}}
    return {"params": params, "opt_state": {"mu": params, "nu": params}, "step": jnp.asarray(1, jnp.int32)}

  manager = ckpt.open_manager(tmp_path)
  ckpt.save(manager, 1, state(4), {}, force=True)
  manager.wait_until_finished()
  with pytest.raises(ckpt.StateMismatchError, match=r"does not match [^:]*: params\.blocks\.0: stored \(4, 4\) "
                     r"float32, expected \(4, 8\) float32;.*\(and 13 more\)"):
    ckpt.restore(manager, state(8))
  # The TrainState a user holds works as the target too (save stores its dict of fields); other types are named.
  step, restored, _ = ckpt.restore(manager, steps_lib.TrainState(**state(4)))
  assert step == 1 and restored["osci"] is None and restored["params"]["blocks"]["0"].shape == (4, 4)
  with pytest.raises(TypeError, match="state dict"):
    ckpt.restore(manager, [state(4)])
  manager.close()


def test_restore_without_a_step_reads_the_newest_checkpoint(tmp_path):
  """step=None means the latest checkpoint, for the state and for the metadata alike, not the oldest kept one."""
  state = lambda step: {"params": {"w": jnp.full(3, step, jnp.float32)}, "step": jnp.asarray(step, jnp.int32)}
  manager = ckpt.open_manager(tmp_path)
  for step in (4, 8):
    ckpt.save(manager, step, state(step), {"config": {"at": step}}, force=True)
  manager.wait_until_finished()
  step, restored, meta = ckpt.restore(manager, state(0))
  assert step == 8 and int(restored["step"]) == 8 and meta["config"] == {"at": 8}
  assert ckpt.restore_meta(manager) == (8, {"config": {"at": 8}})
  manager.close()


def test_resume_without_checkpoints_is_a_clear_error(data_config, tmp_path):
  with pytest.raises(ckpt.CheckpointError, match="no checkpoints"):
    trainer.train(make_config(data_config, tmp_path / "never", resume=True), log=None)
  assert not (tmp_path / "never").exists()
  (tmp_path / "empty" / ckpt.CHECKPOINT_DIR).mkdir(parents=True)
  with pytest.raises(ckpt.CheckpointError, match=r"is empty\)\. Run without --resume"):
    trainer.train(make_config(data_config, tmp_path / "empty", resume=True), log=None)
  assert cli.main(["train", "--resume", "--out", str(tmp_path / "never")]) == cli.EXIT_USAGE


def test_a_run_killed_before_its_first_step_leaves_no_run_to_protect(tmp_path):
  """kill -9 between setting up the folder and the first step: empty checkpoints/ and metrics.jsonl."""
  out = tmp_path / "killed"
  (out / ckpt.CHECKPOINT_DIR).mkdir(parents=True)
  (out / metrics.METRICS_FILE).touch()
  folder, lock = runfolder.open_run_folder(out, resume=False, overwrite=False, process_index=0, process_count=1)
  lock.release()
  assert folder == out
  (out / metrics.METRICS_FILE).write_text('{"step": 0, "loss": 5.0}\n')  # killed after a step, before a checkpoint
  with pytest.raises(ValueError, match="already holds a run"):
    runfolder.open_run_folder(out, resume=False, overwrite=False, process_index=0, process_count=1)
  with pytest.raises(ckpt.CheckpointError, match="stopped before its first checkpoint: pass --overwrite"):
    runfolder.open_run_folder(out, resume=True, overwrite=False, process_index=0, process_count=1)


def test_a_save_killed_midway_is_no_checkpoint(tmp_path):
  """kill -9 during the first save leaves only orbax's unfinished tmp folder: a fresh run used to be refused
  ("pass --resume") while --resume found "No checkpoints" with no advice."""
  out = tmp_path / "killed"
  (out / ckpt.CHECKPOINT_DIR / "4.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
  (out / metrics.METRICS_FILE).write_text('{"step": 0, "loss": 5.0}\n')
  hint = r"holds no finished checkpoint\)\. It holds metrics of a run stopped before its first checkpoint"
  with pytest.raises(ckpt.CheckpointError, match=hint):
    runfolder.open_run_folder(out, resume=True, overwrite=False, process_index=0, process_count=1)
  with pytest.raises(ckpt.CheckpointError, match=hint):
    cli.config_from_args(["--resume", "--out", str(out)])
  _, lock = runfolder.open_run_folder(out, resume=False, overwrite=True, process_index=0, process_count=1)
  lock.release()
  assert not (out / metrics.METRICS_FILE).exists()
  _, lock = runfolder.open_run_folder(out, resume=False, overwrite=False, process_index=0, process_count=1)
  lock.release()


# What tensorstore raised when a checkpoint filled a 2 MiB tmpfs (fp4jax train --out on it, 2026-12-05), shortened.
TENSORSTORE_ENOSPC = ('RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.nu.blocks.0.attn.o.kernel.value/0.0" in OCDBT '
                      'database at local file "/mnt/run/checkpoints/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/'
                      'ocdbt.process_0/": Failed to write 14793 bytes to file 5: No space left on device '
                      "[os_error_code='28']")


def test_os_reason_of_a_failed_write():
  assert ckpt.os_reason(ValueError(TENSORSTORE_ENOSPC)) == "No space left on device"
  assert ckpt.os_reason(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device"
  assert ckpt.os_reason(OSError(errno.EDQUOT, "")) == "Disk quota exceeded"
  assert ckpt.os_reason(ValueError("another model")) is None and ckpt.os_reason(OSError("no errno")) is None


@contextlib.contextmanager
def file_size_limit(nbytes: int):
  """Writes (by any thread of this process) beyond `nbytes` of a file fail with EFBIG while inside, as writes on a
  full disk fail with ENOSPC: the same error path in tensorstore and orbax, without root for a small tmpfs."""
  before = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, before[1]))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, before)
    signal.signal(signal.SIGXFSZ, handler)


def test_a_save_that_cannot_be_written_names_the_folder_and_keeps_the_finished_ones(tmp_path):
  manager = ckpt.open_manager(tmp_path)
  state = {"w": np.arange(50_000, dtype=np.float32)}  # 200 KB: one data file beyond the limit below
  assert ckpt.save(manager, 4, state, {"config": TrainConfig(out=str(tmp_path)).to_dict()}, force=True)
  ckpt.wait(manager)
  with file_size_limit(64 * 1024):
    assert ckpt.save(manager, 8, state, {"config": TrainConfig(out=str(tmp_path)).to_dict()}, force=True)
    with pytest.raises(ckpt.CheckpointSaveError) as info:
      ckpt.wait(manager)
  folder = ckpt.checkpoint_dir(tmp_path)
  assert str(info.value).startswith(f"Could not write checkpoint 8 in {folder}: File too large (")
  assert str(info.value).endswith(" MiB free there). The run stopped; the unfinished step is no checkpoint and "
                                  f"--resume continues from the newest finished one, step 4. Free space in {folder} "
                                  "(or give another --out), then run again.")
  assert ckpt.available_steps(manager) == [4]
  manager.close()
  assert [p.name for p in folder.iterdir() if p.name.startswith("8")][0].startswith("8.orbax-checkpoint-tmp")
  assert resume_lib.resume_meta(tmp_path)[0] == 4


@pytest.mark.slow
# tensorstore's write callbacks that land after orbax closed its event loop report "Event loop is closed" (noise).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_run_whose_checkpoint_cannot_be_written_stops_and_resumes_from_the_last_finished_one(env, tmp_path):
  """The final save of a run fails (as on a full disk): the run logged "Done" and then died with orbax's raw
  RESOURCE_EXHAUSTED ValueError (4 orbax tracebacks before it). Now it stops with CheckpointSaveError naming the
  folder, its free space and the step --resume continues from; the unfinished step is not resumed from."""
  config = tiny_config(env, tmp_path, steps=4, checkpoint_every=2, recipe="bf16")
  limit = contextlib.ExitStack()

  def fill_the_disk(step, record):
    del record
    if step == 3:  # after the last step, once checkpoint 2 is on disk: the final save (step 4) fails
      deadline = time.monotonic() + 60
      while not (ckpt.checkpoint_dir(tmp_path) / "2").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
      limit.enter_context(file_size_limit(16 * 1024))

  lines = []
  with limit, pytest.raises(ckpt.CheckpointSaveError, match=r"Could not write checkpoint 4 in .*: File too large "
                            r"\(.* --resume continues from the newest finished one, step 2\."):
    trainer.train(config, [fill_the_disk], log=lines.append, compile_cache=env["cache"])
  assert not [line for line in lines if line.startswith("Done")]
  assert resume_lib.resume_meta(tmp_path)[0] == 2
  summary = run(env, config.replace(resume=True))
  assert summary["start_step"] == 2 and summary["checkpoint_step"] == 4


@pytest.mark.slow
def test_corrupt_latest_is_moved_aside_and_the_previous_restored_bit_for_bit(data_config, tmp_path):
  config = make_config(data_config, tmp_path)
  save_run(config)
  ck_dir = ckpt.checkpoint_dir(tmp_path)
  manager = ckpt.open_manager(tmp_path, create=False)
  _, want, _ = ckpt.restore(manager, make_state(config), 4)
  manager.close()
  data_files = [p for p in (ck_dir / "8" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert data_files
  for p in data_files:  # bit rot in the array data of the latest checkpoint
    p.write_bytes(b"\0" * p.stat().st_size)
  corrupt, kept = snapshot(ck_dir / "8"), snapshot(ck_dir / "4")

  # Read-only paths report it and change nothing.
  assert cli.main(["eval", "--out", str(tmp_path)]) == cli.EXIT_USAGE
  assert resume_lib.resume_meta(tmp_path)[0] == 8  # its metadata is intact; only the arrays are damaged
  assert snapshot(ck_dir / "8") == corrupt

  notes = []
  step, state, meta = resume_lib.restore_readable(tmp_path, make_state(config), log=notes.append)
  assert step == 4 and meta["step"] == 4
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  moved = list((tmp_path / resume_lib.MOVED_DIR).iterdir())
  assert len(moved) == 1 and moved[0].name.startswith("8.corrupt.")
  assert snapshot(moved[0]) == corrupt and snapshot(ck_dir / "4") == kept  # renamed, byte for byte
  assert len(notes) == 1 and "Moved checkpoint 8 aside" in notes[0] and "not deleted" in notes[0]
  manager = ckpt.open_manager(tmp_path, create=False)
  assert ckpt.available_steps(manager) == [4]
  manager.close()

  # With no readable checkpoint left, nothing is moved and the error lists why.
  (ck_dir / "4" / "meta" / "metadata").write_text("{not json")
  before = snapshot(tmp_path)
  with pytest.raises(ckpt.CorruptCheckpointError, match="No readable checkpoint .* nothing was moved"):
    resume_lib.restore_readable(tmp_path, make_state(config))
  with pytest.raises(ckpt.CorruptCheckpointError, match="No readable checkpoint"):
    cli.config_from_args(["--resume", "--out", str(tmp_path)])
  assert cli.main(["train", "--resume", "--out", str(tmp_path)]) == cli.EXIT_USAGE
  assert snapshot(tmp_path) == before


def test_resume_step_moves_later_checkpoints_aside(data_config, tmp_path):
  config = make_config(data_config, tmp_path)
  save_run(config, steps=(4, 8, 12))
  ck_dir = ckpt.checkpoint_dir(tmp_path)
  (ck_dir / "12" / "meta" / "metadata").write_text("{not json")
  later = {s: snapshot(ck_dir / str(s)) for s in (8, 12)}
  with pytest.raises(ckpt.CheckpointError, match="No checkpoint for step 5"):
    resume_lib.restore_readable(tmp_path, make_state(config), 5)
  notes = []
  step, state, _ = resume_lib.restore_readable(tmp_path, make_state(config), 4, log=notes.append)
  assert step == 4 and int(state["step"]) == 4
  moved = {p.name.split(".")[0]: p for p in (tmp_path / resume_lib.MOVED_DIR).iterdir()}
  assert sorted(moved) == ["12", "8"] and all(".after-resume-4." in p.name for p in moved.values())
  assert all(snapshot(moved[str(s)]) == later[s] for s in (8, 12))
  assert len(notes) == 2 and "comes after --resume-step 4" in notes[0]


def test_a_checkpoint_missing_its_array_metadata_is_corrupt_not_another_model(data_config, tmp_path):
  """A lost state/_METADATA (partial copy) once read as "does not match this run's model", so --resume refused to
  fall back past it."""
  config = make_config(data_config, tmp_path)
  save_run(config)
  (ckpt.checkpoint_dir(tmp_path) / "8" / "state" / "_METADATA").unlink()
  manager = ckpt.open_manager(tmp_path, create=False)
  with pytest.raises(ckpt.CorruptCheckpointError, match="_METADATA"):
    ckpt.restore(manager, make_state(config), 8)
  manager.close()
  step, _, _ = resume_lib.restore_readable(tmp_path, make_state(config), log=lambda _: None)
  assert step == 4
  assert [p.name.split(".")[:2] for p in (tmp_path / resume_lib.MOVED_DIR).iterdir()] == [["8", "corrupt"]]


def test_metadata_without_a_run_config_is_corrupt(data_config, tmp_path):
  """Checkpoint metadata without the run's config (another tool's folder, a damaged file) once surfaced as a bare
  KeyError from `fp4jax eval` and `--resume`; now it is a CorruptCheckpointError, skipped by resume_meta."""
  config = make_config(data_config, tmp_path)
  save_run(config)
  (ckpt.checkpoint_dir(tmp_path) / "8" / "meta" / "metadata").write_text('{"step": 8}')
  with pytest.raises(ckpt.CorruptCheckpointError, match="no run config"):
    trainer.evaluate(tmp_path, 8)
  assert resume_lib.resume_meta(tmp_path)[0] == 4


@pytest.mark.slow
def test_fresh_run_never_overwrites_an_existing_one(data_config, tmp_path):
  config = make_config(data_config, tmp_path)
  save_run(config)
  before = snapshot(tmp_path)
  with pytest.raises(ValueError, match="already holds a run"):
    trainer.train(config, log=None)
  assert snapshot(tmp_path) == before
  # --overwrite clears the old run before anything else happens (here: before a bad corpus is noticed).
  bad = config.replace(overwrite=True, data=data.DataConfig(corpus=str(tmp_path / "nope")))
  with pytest.raises(FileNotFoundError):
    trainer.train(bad, log=None)
  assert not ckpt.checkpoint_dir(tmp_path).exists() and not (tmp_path / metrics.METRICS_FILE).exists()


def test_metrics_after_the_resumed_step_are_dropped(tmp_path):
  with metrics.MetricsLog(tmp_path) as log:
    for step in range(10):
      log.write({"step": step, "loss": float(step), "val_loss": float("nan") if step == 3 else 1.0})
  assert metrics.truncate_metrics(tmp_path, 5) == 4
  records = metrics.read_metrics(tmp_path)
  assert [r["step"] for r in records] == list(range(6)) and records[3]["val_loss"] == "nan"
  json.dumps(records, allow_nan=False)  # strict JSON: non-finite values are stored as strings
  kept = tmp_path / "moved" / "branch.jsonl"
  assert metrics.truncate_metrics(tmp_path, 2, keep_dropped=kept) == 3
  assert [json.loads(line)["step"] for line in kept.read_text().splitlines()] == [3, 4, 5]
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [0, 1, 2]
  assert metrics.truncate_metrics(tmp_path, 2, keep_dropped=tmp_path / "none.jsonl") == 0
  assert not (tmp_path / "none.jsonl").exists()  # nothing dropped, nothing written


def test_a_metrics_line_cut_short_is_left_out_and_removed_on_resume(tmp_path):
  """A killed run can leave its last record half-written: readers skip it, truncating (resume) removes it and says
  so; a broken line anywhere else is an error naming the file and line."""
  with metrics.MetricsLog(tmp_path) as log:
    for step in range(4):
      log.write({"step": step, "loss": float(step)})
  path = tmp_path / metrics.METRICS_FILE
  complete = path.read_text()
  path.write_text(complete + '{"step": 4, "lo')
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [0, 1, 2, 3]
  notes = []
  assert metrics.truncate_metrics(tmp_path, 10, log=notes.append, keep_dropped=tmp_path / "branch.jsonl") == 0
  assert path.read_text() == complete and len(notes) == 1 and "cut short" in notes[0]
  assert not (tmp_path / "branch.jsonl").exists()  # no record dropped: no branch file
  assert metrics.truncate_metrics(tmp_path, 10, log=notes.append) == 0 and len(notes) == 1  # nothing more to say
  path.write_text(complete + '{"step": 4, "lo\n' + '{"step": 5, "loss": 5.0}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl, line 5: not a JSON record"):
    metrics.read_metrics(tmp_path)
  with pytest.raises(ValueError, match="line 5"):
    metrics.truncate_metrics(tmp_path, 2)
  # A whole record cut just before its newline (a full disk) parses and is kept: it gets its newline, so the
  # resumed run's first record does not land on its line (which made every later read fail).
  path.write_text(complete + '{"step": 4, "loss": 4.0}')
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
  assert metrics.truncate_metrics(tmp_path, 10) == 0
  with metrics.MetricsLog(tmp_path) as log:
    log.write({"step": 5, "loss": 5.0})
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]


def test_resume_with_a_changed_state_shape_names_the_changed_settings(data_config, tmp_path):
  config = make_config(data_config, tmp_path, steps=8, recipe="nvfp4")
  save_run(config, steps=(4,))
  wider = config.replace(resume=True, model=dataclasses.replace(config.model, d_ff=2 * config.model.d_ff))
  with pytest.raises(ckpt.StateMismatchError, match=r"(?s)does not match.*This run changes model.d_ff from the stored "
                     r"run's\. A resumed run keeps the stored model's shapes"):
    trainer.train(wider, log=None)
  with_outcontrol = cli.config_from_args(["--out", str(tmp_path), "--resume", "--outcontrol-fraction", "0.1",
                                          "--outcontrol-start", "0", "--outcontrol-window", "2"])
  with pytest.raises(ckpt.StateMismatchError, match="changes outcontrol_fraction.*neither can be switched on or off"):
    trainer.train(with_outcontrol, log=None)


def test_resume_switching_gradient_clipping_names_it(data_config, tmp_path):
  """--grad-clip 0 on resume drops an optimizer stage; the refusal once blamed the model, OutControl or OsciReset."""
  config = make_config(data_config, tmp_path, steps=8)
  save_run(config, steps=(4,))
  with pytest.raises(ckpt.StateMismatchError, match=r"(?s)This run changes grad_clip from the stored run's\..*nor "
                     r"gradient clipping"):
    trainer.train(config.replace(resume=True, grad_clip=0.0), log=None)
