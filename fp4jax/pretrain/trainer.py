"""The training loop: `train(config)` and `evaluate(out)`.

The loop runs the compiled step of the current precision phase; everything periodic (validation, quantization
statistics, checkpoints, the metrics log, the caller's hooks) is a `Hook(fn, every=N)` (hooks.py); the model,
data and step-0 state come from run_setup.py. Batches are a pure function of (seed, step) and the step key is
fold_in(run key, step), so a run resumed from a checkpoint reproduces an uninterrupted one bit for bit, stochastic
rounding included. Step s + 1 goes to the device before the host reads step s's loss (see _Loop.run), so a step's
`step_time` in metrics.jsonl is the loop's period: from when the device could start it until its loss was read.

Multi-process runs (fp4jax.pretrain.distributed.init_distributed first): every process runs this same loop on its
own rows of each batch; process 0 alone writes metrics.jsonl and the log (each checkpoint holds the config),
creates or clears the run folder and moves superseded checkpoints aside, while all processes save and restore the
orbax checkpoints together (process 0 holds run.lock, each other process its own run.<i>.lock). A Ctrl-C or SIGTERM
on any process stops all of them after the same step (within _STOP_CHECK_EVERY steps). Unreadable checkpoints are not
skipped in multi-process runs (see fp4jax.pretrain.resume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import tqdm
from flax import nnx

import fp4jax
from fp4jax import gemm as gemm_lib
from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import distributed
from fp4jax.pretrain import metrics as metrics_lib
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import osci as osci_lib
from fp4jax.pretrain import policy as policy_lib
from fp4jax.pretrain import profiling
from fp4jax.pretrain import resume as resume_lib
from fp4jax.pretrain import runfolder
from fp4jax.pretrain import sharding as sharding_lib
from fp4jax.pretrain.config import TrainConfig
# Re-exported: trainer.Hook, trainer.build_model, ... (their homes are hooks.py and run_setup.py).
from fp4jax.pretrain.hooks import Hook, StepInfo, as_hook, record_hook
from fp4jax.pretrain.run_setup import build_model, initial_state, load_data, run_keys
from fp4jax.pretrain.sharding import Placement
from fp4jax.pretrain.steps import CompileCache, Phases, TrainState

# What processes other than process 0 write metrics to.
_NO_METRICS = types.SimpleNamespace(write=lambda record: None)


class TrainingDiverged(RuntimeError):
  """The loss, gradient norm or parameters became non-finite; the state of that step was discarded."""

  def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None):
    self.step, self.loss, self.grad_norm, self.last_checkpoint = step, loss, grad_norm, last_checkpoint
    kept = (f"the last good checkpoint is step {last_checkpoint}" if last_checkpoint is not None
            else "no checkpoint was saved")
    super().__init__(f"Training diverged at step {step}: loss={loss}, grad_norm={grad_norm} (non-finite). "
                     f"The diverged state was not saved; {kept}. Try a lower --lr, more BF16 layers "
                     "(--bf16-last), or another --recipe.")


def _placement(config: TrainConfig, state: TrainState) -> Placement:
  # The layers the policy keeps in BF16 have no blocks to keep inside shards. The others run the recipe (after a
  # late switch, the same blocks or none).
  quantized = config.policy.quantized_layers(model_lib.layer_names(config.model), config.model.n_layers)
  return Placement.for_mesh(config.mesh, state, recipe=config.policy.recipe,
                            batch_size=config.batch_size, seq_len=config.train_seq_len,
                            grad_accum=config.grad_accum, quantized_layers=quantized)


# --- run folder ---------------------------------------------------------------------------------------------------

def _checkpoint_meta(config: TrainConfig, step: int, phase: int,
                     data: data_lib.DataIdentity | None = None) -> dict[str, Any]:
  keys = run_keys(config.seed)
  config_dict = config.to_dict()
  meta = {"config": config_dict, "policy": config_dict["policy"], "recipe": config_dict["policy"]["recipe"],
          "seed": config.seed,
          "run_key_data": np.asarray(jax.random.key_data(keys["step"])).tolist(),
          "data_position": step, "step": step, "phase": phase, "fp4jax_version": fp4jax.__version__,
          "gemm_mode": gemm_lib.resolve_gemm_mode(config.policy.recipe)}  # "auto" as resolved on this machine
  if data is not None:
    meta["data"] = data.to_dict()  # which data the run trained on: see resume.check_data_kept
  return meta


def _replicated_key(key: jax.Array, placement: Placement) -> jax.Array:
  """`key` replicated over the placement's devices once, not moved there by every step call; made from host data,
  since a multi-process run refuses to device_put one process's array onto the global devices."""
  data = jax.device_put(np.asarray(jax.random.key_data(key)), placement.replicated)
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


TERMINAL_BAR_INTERVAL, LOG_BAR_INTERVAL = 0.1, 30.0


def bar_interval(stream=None) -> float:
  """Seconds between progress-bar redraws on `stream` (default sys.stderr): tqdm's 0.1 s on a terminal and in a
  notebook (whose stderr is not the process's own); 30 s where the process's own stderr is a file or a pipe
  (`fp4jax train ... 2> log`): at 0.1 s a 12-second `tiny` run wrote 67 bars there (5 KB), 2 at 30 s."""
  stream = sys.stderr if stream is None else stream
  try:
    logged = stream is not None and stream is sys.__stderr__ and not stream.isatty()
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    logged = False
  return LOG_BAR_INTERVAL if logged else TERMINAL_BAR_INTERVAL


class Terminated(KeyboardInterrupt):
  """Raised by `train` after the checkpoint that a SIGTERM asked for (a batch scheduler stopping or preempting the
  job); a KeyboardInterrupt, so code that handles Ctrl-C handles it too. `fp4jax train` exits 143 on it."""


class _StopRequest(threading.Event):
  """Set by the first SIGINT or SIGTERM; `signum` says which."""
  signum: int | None = None


_STOP_SIGNALS = {signal.SIGINT: "Interrupted", signal.SIGTERM: "Terminated"}


@contextlib.contextmanager
def _stop_flag():
  """Turns the first Ctrl-C or SIGTERM into a flag the loop checks after each step (every _STOP_CHECK_EVERY steps
  in a multi-process run); a second one interrupts at once, without saving."""
  flag = _StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield flag
    return

  def handler(signum, frame):
    del frame
    if flag.is_set():
      raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    flag.signum = signum
    flag.set()
    again = "Ctrl-C" if signum == signal.SIGINT else "the signal"
    tqdm.tqdm.write(f"{_STOP_SIGNALS[signum]}: saving a checkpoint after this step ({again} again to abort without "
                    "saving).")

  previous = {signum: signal.signal(signum, handler) for signum in _STOP_SIGNALS}
  try:
    yield flag
  finally:
    for signum, old in previous.items():
      signal.signal(signum, old)


# --- the loop -----------------------------------------------------------------------------------------------------

def train(config: TrainConfig, hooks: Sequence[Hook | Callable[[int, dict[str, Any]], None]] = (), *,
          log: Callable[[str], None] | None = print, compile_cache: CompileCache | None = None) -> dict[str, Any]:
  """Trains per `config`, writing <out>/metrics.jsonl and <out>/checkpoints/ (each checkpoint holds its config).

  Holds <out>/run.lock for the whole call: a second run on the same --out raises runfolder.RunLockedError.

  hooks: `Hook`s (called after each step whose index is a multiple of `every`, and once at the end), or callables
    (step, record) -> None called after every step with that step's metrics record (the dict written to
    metrics.jsonl after the hooks, so with what they add: loss, lr, grad_norm, ..., val_loss / quant when computed)
    and once more for the final evaluation record (step == config.steps). A hook that raises ends the run with its
    error, after a checkpoint of the state it saw (single-process runs), so a bug in a hook never loses the training.
  Returns a summary: final_loss, final_val_loss (None without validation), val_losses {step: loss}, losses (this
    call's train losses), steps, start_step, tokens, wall_time, checkpoint_step, out, params (the final nnx.State),
    layer_recipes ({phase: {layer: recipe name}} for the phases this call ran), data (the DataIdentity trained on,
    as a dict).
  compile_cache: reuse jitted steps across calls (see CompileCache).
  Multi-process runs: raises distributed.ConfigMismatchError on every process when the processes' configs differ
  (beyond distributed.PER_PROCESS_FIELDS) or their Hooks with reads_state=True do (their `every`: the loop waits for
  the step in flight before each), before anything is read or compiled, and when the data they read differs
  (distributed.check_same_data), before anything is compiled.
  Raises TrainingDiverged on a non-finite loss (nothing non-finite is ever saved), CheckpointError when --resume
  finds no readable checkpoint (unreadable newer ones are moved aside, see fp4jax.pretrain.resume), RunLockedError
  when another run holds --out, ValueError for bad configs or data, KeyboardInterrupt after saving on Ctrl-C
  (Terminated on SIGTERM), checkpoint.CheckpointSaveError when a checkpoint cannot be written (a full disk; --resume
  continues from the last finished one).
  """
  hooks = hooks if callable(hooks) else list(hooks)  # read twice below: not a one-shot iterator
  if jax.process_count() > 1:  # first: a process started with other settings fails before any data or compile
    distributed.check_same_run(*_run_settings(config, () if callable(hooks) else hooks))
  if callable(hooks):  # one Hook (callable) or function, not a list of them
    raise TypeError(f"train(config, hooks): hooks is a list of Hooks or callables; got one {type(hooks).__name__}: "
                    "pass [hook].")
  user_hooks = [as_hook(h) for h in hooks]  # a hook that cannot be called fails here, not after the first step
  log = log if log and distributed.is_main_process() else (lambda _: None)
  if not config.checkpointing.resume:
    config.check_new_run()
  if config.mesh:  # a bad --mesh fails before the run folder is made
    sharding_lib.make_mesh(config.mesh)
  out, lock = runfolder.open_run_folder(config.out, resume=config.checkpointing.resume,
                                        overwrite=config.checkpointing.overwrite, log=log,
                                        process_index=jax.process_index(), process_count=jax.process_count())
  with lock:
    log(f"Run folder: {out.absolute()}")
    return _train_locked(config, user_hooks, log, compile_cache, out)


HOOKS_READING_STATE = "hooks.reading_state"


def _run_settings(config: TrainConfig, hooks) -> tuple[dict[str, Any], dict[str, str]]:
  """What the processes of a multi-process run compare (distributed.check_same_run): the config, and the `every` of
  the Hooks that read the state during the run (every > 0; the final call comes after the loop). The loop waits for
  the step in flight before such a hook; a process that waits where the others do not meets the stop check's
  collective out of step with theirs, and all hang."""
  reading = sorted(h.every for h in hooks if isinstance(h, Hook) and h.reads_state and h.every > 0)
  flags = {**config_lib.field_flags(), HOOKS_READING_STATE: "train(hooks)'s Hooks with reads_state=True (every)"}
  return {**config.to_dict(), "hooks": {"reading_state": reading}}, flags


def _train_locked(config, user_hooks, log, compile_cache, out) -> dict[str, Any]:
  keys = run_keys(config.seed)
  model = build_model(config, keys["init"])
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  state = initial_state(config, nnx.state(model, nnx.Param), jax.jit(optimizer.init))
  placement = _placement(config, state)
  # Each process reads its own corpus and token cache (a host may lack the corpus, or its cache folder be full):
  # all agree before the first collective, which a process that failed alone would never join.
  dataset, val = distributed.all_started("read its data", lambda: load_data(config, *placement.batch_block()))
  distributed.check_same_data(dataset.identity.to_dict() if dataset.identity is not None else None)
  phases = Phases(config, model, compile_cache, placement)
  # Committed like a restored state (restore reads onto these shardings), so a fresh and a resumed run hit the
  # same compiled step, and a checkpoint saved on one mesh restores onto another.
  state = jax.device_put(state, placement.state)
  start = 0
  if config.checkpointing.resume:  # before opening the manager below: resuming may move checkpoints aside
    start, state = _resume(config, state, out, log, dataset.identity)

  manager = ckpt.open_manager(out, max_to_keep=config.checkpointing.keep,
                              save_interval_steps=config.checkpointing.every)
  try:
    log(config.policy.describe(config.model.n_layers, list(model.linear_layers()), config.steps))
    for line in _training_options_lines(config):
      log(line)
    log(f"Data: {dataset.source}")
    return _Loop(config, log, out, dataset, val, keys, phases, manager, start).run(state, user_hooks)
  finally:
    try:
      ckpt.wait(manager)
    finally:
      manager.close()


def _training_options_lines(config: TrainConfig) -> list[str]:
  """What the run log says about TetraJet-v2's training options when they are on, incl. a schedule that never acts
  within this run (allowed: a later, lengthened resume reaches it)."""
  lines = []
  osci = config.osci_reset
  if osci.enabled:
    first = osci.first_reset_step
    when = (f"first reset after step {first}" if first < config.steps else
            f"its first reset would come after step {first}, beyond this {config.steps}-step run: it resets nothing")
    lines.append(f"OsciReset: cycles of {osci.every} steps from step {osci.start}, window {osci.window}, threshold "
                 f"{osci.threshold}; {when}.")
  out = config.outcontrol
  if out.enabled:
    lines.append(f"OutControl: the top {100 * out.fraction:g} % of each quantized layer's input channels in MXFP8, "
                 f"chosen by their norms over steps {out.start}..{out.select_step}.")
  return lines


_STATE_OPTIONS = ("model", "outcontrol_", "osci_reset_")  # flat option names (config_lib.flatten)


def _state_changes(out, resume_step, config) -> str:
  """Why a checkpoint may not fit: the settings that shape the state and differ from the stored run's."""
  stored = resume_lib.resume_meta(out, resume_step)[1]["config"]
  changed = [k for k in config_lib.result_differences(stored, config.to_dict()) if k.startswith(_STATE_OPTIONS)]
  stored_clip = config_lib.TrainConfig.from_dict(stored).optimizer.grad_clip  # also reads older flat configs
  if (stored_clip > 0) != (config.optimizer.grad_clip > 0):
    changed.append("grad_clip")  # clipping on or off adds or drops a stage of the optimizer state
  said = f"This run changes {', '.join(changed)} from the stored run's. " if changed else ""
  return (f"{said}A resumed run keeps the stored model's shapes and the state that OutControl and OsciReset add: "
          "neither can be switched on or off (nor OutControl's channel fraction changed) mid-run, nor gradient "
          "clipping (--grad-clip 0 against > 0). Resume with the stored settings, or start a new run in another --out.")


def _windows_note(stored: TrainConfig, config: TrainConfig, start: int) -> str | None:
  """What a resume says when its validation windows differ from the stored run's (both validating)."""
  windows = lambda c: (c.batch_size, c.train_seq_len, c.evaluation.batches, c.data.val_fraction)
  if not (stored.evaluation.batches and config.evaluation.batches) or windows(stored) == windows(config):
    return None
  return (f"Note: the validation windows follow batch_size, seq_len, eval_batches and val_fraction, so from step "
          f"{start} on val_loss is measured on other windows: not comparable with the val_loss logged before.")


def _changes(stored_dict: dict, config: TrainConfig, *, schedule_said: bool) -> tuple[list[str], list[str]]:
  """(changed settings that change training, changed validation settings), as flat option names; without those the
  schedule note speaks for when `schedule_said`."""
  changed = config_lib.result_differences(stored_dict, config.to_dict())
  if schedule_said:  # the schedule note has said what these do
    changed = [c for c in changed if c not in ("steps", "warmup_fraction", "decay_fraction", "switch_at")]
  evaluation = config_lib.group_keys("evaluation")
  return [c for c in changed if c not in evaluation], [c for c in changed if c in evaluation]


def _unscheduled_changes(stored_dict: dict, config: TrainConfig) -> list[str]:
  """The changed settings that change training beyond what the learning-rate schedule and the switch read: with
  none, a resume whose schedule agrees on the steps taken equals a fresh run of the new settings."""
  schedule = ("lr", "min_lr_ratio", "decay_shape")  # and what _changes leaves out when the schedule note speaks
  return [c for c in _changes(stored_dict, config, schedule_said=True)[0] if c not in schedule]


def _changes_notes(stored_dict: dict, config: TrainConfig, *, schedule_said: bool) -> list[str]:
  """What a resume says about settings that changed since the checkpoint: those that change training, and apart,
  the validation and statistics settings (their own PRNG streams: training runs the same, only those records do
  not)."""
  trained, recorded = _changes(stored_dict, config, schedule_said=schedule_said)
  notes = []
  if trained:
    notes.append(f"Note: resuming with changed settings {trained}; the run will differ from an uninterrupted one.")
  if recorded:
    notes.append(f"Note: resuming with changed validation settings {recorded}: training runs as it would have; the "
                 "val_loss and statistics records follow the new settings.")
  return notes


def _resume(config, state, out, log, data: data_lib.DataIdentity) -> tuple[int, TrainState]:
  resume_step = config.checkpointing.resume_step
  if resume_step is not None and resume_step > config.steps:
    raise ValueError(f"--resume-step {resume_step} is beyond --steps {config.steps}.")
  notes = []

  def check(step, meta):  # before restore_readable moves anything aside: a refused resume leaves the folder as it was
    if step > config.steps:
      raise ValueError(f"Checkpoint step {step} is beyond --steps {config.steps}: resume from an earlier checkpoint "
                       f"with --resume-step N (N <= {config.steps}), or pass more --steps.")
    resume_lib.check_switch_kept(TrainConfig.from_dict(meta["config"]), config, step)
    notes.append(resume_lib.check_data_kept(meta.get("data"), data, step, config.checkpointing.data_changed))

  try:
    start, restored, meta = resume_lib.restore_readable(out, state._asdict(), resume_step, log=log,
                                                        process_index=jax.process_index(),
                                                        process_count=jax.process_count(), check=check)
  except ckpt.StateMismatchError as e:
    raise ckpt.StateMismatchError(f"{e}\n{_state_changes(out, resume_step, config)}") from None
  state = TrainState(**restored)
  if int(state.step) != start:
    raise ckpt.CheckpointError(f"Checkpoint {start} holds step counter {int(state.step)}: inconsistent.")
  stored = TrainConfig.from_dict(meta["config"])
  stored_dict = meta["config"]
  if meta.get("data") and isinstance(stored_dict.get("data"), dict):
    # The data's identity was checked (or its change noted) above: how its path was typed, or where its token cache
    # lives, is no change of the run.
    same = {"corpus": config.data.corpus, "cache_dir": config.data.cache_dir}
    stored_dict = {**stored_dict, "data": {**stored_dict["data"], **same}}
  schedule = resume_lib.schedule_note(stored, config, start,
                                     others_changed=bool(_unscheduled_changes(stored_dict, config)))
  if schedule:
    log(schedule)
  note = resume_lib.gemm_mode_note(meta.get("gemm_mode"), config.policy.recipe)
  for line in [*notes, note, resume_lib.switch_mode_note(stored, config, start)]:
    if line:
      log(line)
  for line in _changes_notes(stored_dict, config, schedule_said=bool(schedule)):
    log(line)
  note = _windows_note(stored, config, start)
  if note:
    log(note)
  stored_keep = stored.checkpointing.keep
  if config.checkpointing.keep < stored_keep:  # result-free, so not in `changed`
    log(f"Note: this run keeps {config.checkpointing.keep} checkpoints (--keep-checkpoints), the stored run kept "
        f"{stored_keep}: as it saves, the older checkpoints beyond the newest {config.checkpointing.keep} are deleted.")
  dropped, kept_in = 0, None
  if distributed.is_main_process():
    # Going back with --resume-step abandons a branch: its records are kept beside its moved checkpoints. So are the
    # dropped records when more --steps extend the run: a finished run's final val_loss comes back only where the
    # longer run's schedule validates (also when an unreadable final checkpoint sent the resume further back). A
    # plain resume drops only records the resumed steps write again, the same (resume is exact).
    if resume_step is not None or stored.steps < config.steps:
      kept_in = resume_lib.moved_path(out, f"metrics.after-resume-{start}", ".jsonl")
    dropped = metrics_lib.truncate_metrics(out, start - 1, keep_dropped=kept_in, log=log)
  records = "record" if dropped == 1 else "records"
  said = f" (dropped {dropped} later metric {records}" + (f", kept in {kept_in})" if kept_in is not None else ")")
  log(f"Resumed from step {start} in {out}" + (said if dropped else ""))
  return start, state


_STOP_CHECK_EVERY = 4  # steps between a multi-process run's checks for a Ctrl-C (see _Loop.run's stop_after)


@dataclasses.dataclass
class _Sent:
  """A step sent to the device: its StepInfo (whose state is the step's output), its metrics (device arrays the host
  has not read yet) and when it was sent (time.perf_counter)."""

  info: StepInfo
  metrics: dict[str, Any]
  time: float


class _Loop:
  """One call's loop over steps [start, config.steps) and the built-in hooks it runs around each step."""

  def __init__(self, config, log, out, dataset, val, keys, phases: Phases, manager, start: int):
    self.config, self.log, self.out, self.dataset, self.val = config, log, out, dataset, val
    self.keys, self.phases, self.manager, self.start = keys, phases, manager, start
    self.last_saved = start if config.checkpointing.resume else None
    self.val_losses: dict[int, float] = {}

  # Built-in hooks. Before the update: they see the params step `info.step` starts from.
  def _validate(self, info: StepInfo):
    at = min(info.step, self.config.steps - 1)
    info.record["val_loss"] = self.val_losses[info.step] = self.phases.val_loss(
        info.state.params, self.val, self.keys["eval"], at, info.state.outcontrol)

  def _stats(self, info: StepInfo):
    at = min(info.step, self.config.steps - 1)
    tokens = self.phases.placement.put_batch({"inputs": self.val[0]["inputs"]})["inputs"]  # this process's rows
    raw = self.phases.stats_fn(at)(info.state.params, tokens, self.keys["stats"])
    info.record["quant"] = jax.tree.map(float, raw)

  def _checkpoint(self, info: StepInfo):
    if info.step != self.start or info.final:  # the state at `start` is the one this call began from
      self.save(info.step, info.state, force=info.final)

  def save(self, step: int, state: TrainState, force: bool):
    if step == self.last_saved:
      return
    meta = _checkpoint_meta(self.config, step, self.phases.phase(min(step, self.config.steps - 1)),
                            self.dataset.identity)
    if ckpt.save(self.manager, step, state._asdict(), meta, force=force):
      self.last_saved = step

  def save_after_hook_error(self, info: StepInfo, sent: _Sent | None = None):
    """Keeps the trained state when a user hook raises after a step (or at the final call): its checkpoint is
    saved before the error propagates, so a bug in a logging hook never costs the run. `sent`: the step already
    sent after info's, which took info's state; its own output is saved then, if finite. Single-process runs only:
    the other processes of a multi-process run may not have raised, and a save needs all of them."""
    step = info.step if info.final else info.step + 1
    if jax.process_count() > 1:
      self.log(f"A hook raised after step {step}: no checkpoint saved (a multi-process save needs every process); "
               f"the last one is step {self.last_saved}.")
      return
    saved, state = step, info.state
    if sent is not None:
      if not bool(sent.metrics["finite"]):
        self.log(f"A hook raised after step {step}; the step after it diverged: no checkpoint saved, the last one "
                 f"is step {self.last_saved}.")
        return
      saved, state = sent.info.step + 1, sent.info.state
    self.save(saved, state, force=True)
    ckpt.wait(self.manager)
    self.log(f"A hook raised after step {step}: checkpoint of step {saved} saved in {ckpt.checkpoint_dir(self.out)} "
             "(resume with --resume).")

  def run(self, state: TrainState, user_hooks: list[Hook]) -> dict[str, Any]:
    config, phases = self.config, self.phases
    # The logged LR, computed on the host: in eager jnp it was a dozen dispatches, ~0.45 ms per step.
    schedule = lambda step: optimizer_lib.wsd_lr(phases.schedule, step, xp=np)
    # The schedule's numbers, an input of every train step (not compiled in: see steps.Phases).
    schedule_args = jax.device_put(phases.schedule, phases.placement.replicated)
    run_key = _replicated_key(self.keys["step"], phases.placement)  # each step folds in its own number
    tokens_per_step = config.batch_size * config.train_seq_len
    losses, layer_recipes = [], {}
    t_start = time.perf_counter()
    before = [Hook(self._checkpoint, config.checkpointing.every)]
    if self.val:
      before.append(Hook(self._validate, config.evaluation.every))
    if config.evaluation.stats_every:
      before.append(Hook(self._stats, config.evaluation.stats_every))

    main = distributed.is_main_process()
    bar = tqdm.tqdm(total=config.steps, initial=self.start, disable=not (config.logging.progress and main), unit="step",
                    dynamic_ncols=True, mininterval=bar_interval())
    # Without the bar a run would be silent until it ends: each validation gets a log line instead.
    log_validation = self.log if bar.disable else (lambda _: None)
    metrics_file = metrics_lib.MetricsLog(self.out) if main else contextlib.nullcontext(_NO_METRICS)
    # Every process traces its own devices (profiling.trace_dir); the main one says where.
    profiler = profiling.StepProfiler(config.logging.profile_window, self.out, self.log if main else lambda _: None)
    if main and profiler.start_note(self.start):
      self.log(profiler.start_note(self.start))
    with metrics_file as metrics_log, _stop_flag() as interrupted, bar, profiler:

      def write_metrics(info: StepInfo):
        r = info.record
        if info.final:  # only when something was measured: a val loss, statistics, a hook's numbers
          due = set(r) > {"step", "phase"}
        else:
          due = (info.step % config.logging.every == 0 or info.step == config.steps - 1 or "val_loss" in r
                 or "quant" in r)
        if due:
          metrics_log.write(r)

      def after(info: StepInfo, sent: _Sent | None = None):
        try:
          for hook in user_hooks:
            hook(info)
        except Exception:
          write_metrics(info)
          if sent is not None:  # the checkpoint saved below is the state `sent` made: its row goes with it
            if read_numbers(sent) is None:
              metrics_log.write(sent.info.record)
            else:
              write_metrics(sent.info)
          self.save_after_hook_error(info, sent)
          raise
        except BaseException:
          write_metrics(info)
          raise
        write_metrics(info)  # after the user's hooks, so what they add to the record is logged

      last_done = time.perf_counter()  # when the last finished step's numbers reached the host

      def stop_after(step: int) -> bool:
        """Whether the run stops after `step` for a Ctrl-C or SIGTERM. Across processes that is a collective, which
        waits for the step in flight, so a multi-process run asks every _STOP_CHECK_EVERY steps and at the last."""
        if jax.process_count() > 1 and step % _STOP_CHECK_EVERY and step != config.steps - 1:
          return False
        # All processes stop after the same step, so the checkpoint is saved by all of them together.
        return distributed.any_process(interrupted.is_set())

      def read_numbers(done: _Sent) -> tuple[float, float] | None:
        """Reads step `done`'s numbers into its record (waiting for the device): (loss, grad_norm), or None when
        they are not finite (the record then says "diverged")."""
        nonlocal last_done
        m, step = done.metrics, done.info.step
        numbers = jax.device_get({k: m[k] for k in ("loss", "grad_norm", "finite")})  # one transfer, not three
        loss, grad_norm, finite = float(numbers["loss"]), float(numbers["grad_norm"]), bool(numbers["finite"])
        now = time.perf_counter()
        # From when the device could start the step (sent, and the step before it done) until its loss is here.
        step_time, last_done = now - max(done.time, last_done), now
        profiler.after(step)
        done.info.record.update(loss=loss, lr=float(schedule(step)), grad_norm=grad_norm, step_time=step_time,
                                tokens_per_s=tokens_per_step / step_time)
        if osci_lib.kind(step, config.osci_reset) == "reset":  # fetched only on reset steps
          done.info.record["osci_reset"] = int(m["osci_reset"])
        if not finite:
          done.info.record["diverged"] = True
          return None
        return loss, grad_norm

      def finish(done: _Sent, sent: _Sent | None = None, stopping: bool = False) -> None:
        """Reads step `done`'s numbers, then logs it and runs the hooks after it. `sent`: the step already sent
        after it, which has taken `done`'s output state. `stopping`: the run is stopping after this step (asked
        already)."""
        info, step = done.info, done.info.step
        numbers = read_numbers(done)
        if numbers is None:
          metrics_log.write(info.record)
          raise TrainingDiverged(step, info.record["loss"], info.record["grad_norm"], self.last_saved)
        loss = numbers[0]
        losses.append(loss)
        after(info, sent)
        # Drawn by update() at tqdm's own rate (every 0.1 s): refreshed here, the bar was written to the terminal or
        # log file after every step (~45 us each, and a log grew by a bar per step).
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False,
                        **({"val": f"{info.record['val_loss']:.4f}"} if "val_loss" in info.record else {}))
        bar.update(1)
        if "val_loss" in info.record:
          log_validation(f"step {step}/{config.steps}: loss {loss:.4f}, val_loss {info.record['val_loss']:.4f}, "
                         f"{info.record['tokens_per_s']:.0f} tokens/s")
        if stopping or not stop_after(step):
          return
        if sent is not None:  # the newest state is the one that step makes
          finish(sent, stopping=True)
          step, info = sent.info.step, sent.info
        self.save(step + 1, info.state, force=True)
        ckpt.wait(self.manager)
        terminated = interrupted.signum == signal.SIGTERM
        self.log(f"{'Terminated' if terminated else 'Interrupted'} after step {step + 1}: checkpoint saved in "
                 f"{ckpt.checkpoint_dir(self.out)}.")
        raise Terminated if terminated else KeyboardInterrupt

      # Step s + 1 goes to the device before the host reads step s's numbers, so the host's work between steps
      # (the batch, the step call itself, the metrics) overlaps the device's. The loop waits for a step first where
      # the host needs the state it makes: before a hook that reads it, before a step that compiles, and where a
      # profile's window starts or ends.
      in_flight, last_step_fn = None, None
      for step in range(self.start, config.steps):
        train_step = phases.train_step(step)
        if in_flight is not None and (train_step is not last_step_fn or any(h.due(step) for h in before)
                                      or profiler.starts_or_stops_before(step)):
          finish(in_flight)
          in_flight = None
        info = StepInfo(step, state, {"step": step, "phase": phases.phase(step)})
        if info.record["phase"] not in layer_recipes:
          layer_recipes[info.record["phase"]] = phases.layer_recipes(step)
        for hook in before:
          hook(info)

        block, blocks = phases.placement.batch_block()
        batch = phases.placement.put_batch(data_lib.get_batch(
            self.dataset, "train", step, batch_size=config.batch_size, seq_len=config.train_seq_len,
            seed=config.seed, process_index=block, process_count=blocks))
        profiler.before(step)
        t_sent = time.perf_counter()
        state, m = train_step(state, batch, run_key, schedule_args)
        info.state, last_step_fn = state, train_step  # the hooks after the step see the state it makes
        sent = _Sent(info, m, t_sent)
        if in_flight is not None:
          finish(in_flight, sent)
        in_flight = sent
        if any(h.reads_state and h.due(step) for h in user_hooks):
          finish(in_flight)
          in_flight = None
      if in_flight is not None:
        finish(in_flight)

      final = StepInfo(config.steps, state, {"step": config.steps, "phase": phases.phase(config.steps - 1)},
                       final=True)
      for hook in before[1:]:
        hook(final)
      after(final)
      before[0](final)  # the final checkpoint last, after the final record
      ckpt.wait(self.manager)  # before "Done": a final save that fails (a full disk) raises CheckpointSaveError

    wall = time.perf_counter() - t_start
    val_text = f", val_loss {self.val_losses[config.steps]:.4f}" if self.val else ""
    self.log(f"Done: step {config.steps}{val_text}, {wall:.1f}s; outputs in {self.out}")
    return {"out": str(self.out), "steps": config.steps, "start_step": self.start, "losses": losses,
            "final_loss": losses[-1] if losses else None, "final_val_loss": self.val_losses.get(config.steps),
            "val_losses": self.val_losses, "tokens": (config.steps - self.start) * tokens_per_step,
            "wall_time": wall, "checkpoint_step": self.last_saved, "params": state.params,
            "layer_recipes": layer_recipes,
            "data": self.dataset.identity.to_dict() if self.dataset.identity is not None else None}


# --- evaluation of a saved run ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EvalSetup:
  """What `evaluate` reads before restoring the checkpoint's arrays."""

  step: int
  meta: dict[str, Any]
  config: TrainConfig  # with the corpus and the validation batches it evaluates on
  val: list[dict[str, np.ndarray]]  # the fixed validation batches
  dataset: data_lib.TokenDataset | None = None  # the data they come from (its tokenizer: fp4jax.pretrain.sample)
  forward: TrainConfig | None = None  # with another recipe (with_forward_recipe): its layers run the forward


def with_forward_recipe(config: TrainConfig, recipe) -> TrainConfig:
  """`config` whose precision policy runs `recipe` (a spec or Recipe) in every layer it quantizes, for evaluating or
  sampling a checkpoint in another precision than it trained in (`fp4jax eval --recipe`): the policy's BF16 layers
  stay BF16. A late BF16 switch is dropped, so a checkpoint taken after it runs `recipe` too (kept, it would run
  BF16 whatever `recipe` says). OutControl and OsciReset belong to the trained recipe and are off: no MXFP8 outlier
  channels in the forward."""
  return config.replace(recipe=recipe, switch_at=None, switch="all", outcontrol_fraction=0.0, osci_reset_start=None)


def eval_setup(out: str | pathlib.Path, step: int | None = None, *, eval_batches: int | None = None,
               corpus: str | None = None, recipe=None, log: Callable[[str], None] | None = print,
               command: str = "fp4jax eval") -> EvalSetup:
  """The checkpoint's step, meta and config and the checked validation data `evaluate` uses (see there); `recipe`
  (see with_forward_recipe) is checked against the model here, before any array is restored. `command`: the CLI
  command an error's fix names (fp4jax sample passes its own).

  Each process of a multi-process run reads on its own (no collective), so one that fails here can tell the others
  (the CLI's start check) instead of leaving them waiting in orbax's restore.
  """
  log = log or (lambda _: None)
  manager = ckpt.open_manager(out, create=False, local=True)
  try:
    step, meta = ckpt.restore_meta(manager, step)
  finally:
    manager.close()
  config = TrainConfig.from_dict(meta["config"])
  if recipe is not None:
    with_forward_recipe(config, recipe)  # a recipe the model cannot run is refused before the data is read
  stored_corpus = config.data.corpus
  named = corpus is not None
  corpus = corpus if named else resume_lib.recorded_corpus(meta, step, f"{command} --out {out}")
  if corpus is not None:
    config = config.replace(**{"data.corpus": corpus})
  if eval_batches is None and not config.evaluation.batches:
    eval_batches = config_lib.EvalConfig().batches  # the run itself did not validate
  if eval_batches is not None:
    if eval_batches < 1:
      raise ValueError(f"eval_batches (--eval-batches) must be >= 1 to evaluate; got {eval_batches}.")
    config = config.replace(eval_batches=eval_batches)
  dataset, val = load_data(config)
  note = resume_lib.eval_data_note(meta.get("data"), dataset.identity, step, named, stored_corpus)
  if note:
    log(note)
  forward = None if recipe is None else with_forward_recipe(config, recipe)
  return EvalSetup(step=step, meta=meta, config=config, val=val, dataset=dataset, forward=forward)


@dataclasses.dataclass(frozen=True)
class RestoredRun:
  """A checkpoint's arrays with what runs them: `phases.graphdef(at)` is the model in the precision phase of the
  checkpoint's step (`at`: the step, capped at the run's last), with the setup's forward recipe if it has one
  (`outcontrol` is then None), `keys` the run's PRNG streams (run_setup.run_keys)."""

  step: int
  at: int
  params: Any
  outcontrol: Any  # the OutControlState, or None when OutControl is off
  phases: Phases
  keys: dict[str, jax.Array]


def restore_run(out: str | pathlib.Path, setup: EvalSetup) -> RestoredRun:
  """Restores checkpoint `setup.step` of the run in `out` (a collective in multi-process runs)."""
  config = setup.config
  keys = run_keys(config.seed)
  model = build_model(config, keys["init"])
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  target = initial_state(config, nnx.state(model, nnx.Param), optimizer.init)
  manager = ckpt.open_manager(out, create=False)
  try:
    step, restored, _ = ckpt.restore(manager, target._asdict(), setup.step)
  finally:
    manager.close()
  outcontrol, phases = restored.get("outcontrol"), Phases(config, model)
  if setup.forward is not None:  # the same params; only the layers' recipes (the graphdef) differ
    forward_model = nnx.eval_shape(lambda: build_model(setup.forward, keys["init"]))
    outcontrol, phases = None, Phases(setup.forward, forward_model)
  return RestoredRun(step=step, at=min(step, config.steps - 1), params=restored["params"], outcontrol=outcontrol,
                     phases=phases, keys=keys)


def evaluate_setup(out: str | pathlib.Path, setup: EvalSetup) -> dict[str, Any]:
  """Restores checkpoint `setup.step` of the run in `out` and takes its validation loss (a collective in
  multi-process runs: every process calls it)."""
  run = restore_run(out, setup)
  val_loss = run.phases.val_loss(run.params, setup.val, run.keys["eval"], run.at, run.outcontrol)
  return {"step": run.step, "val_loss": val_loss, "phase": run.phases.phase(run.at),
          "eval_batches": setup.config.evaluation.batches,
          "recipe": policy_lib.recipe_spec(run.phases.config.policy.recipe)}


def evaluate(out: str | pathlib.Path, step: int | None = None, *, eval_batches: int | None = None,
             corpus: str | None = None, recipe=None, log: Callable[[str], None] | None = print) -> dict[str, Any]:
  """Validation loss of the checkpoint at `step` (default: latest) of the run in `out`.

  The data is the corpus the checkpoint recorded (its absolute path: a relative --data.corpus means what it meant
  when the run trained); if its content or tokenizer changed since, a ValueError says what changed. `corpus` names
  other data to evaluate on (a note, through `log`, says when it is not the data the checkpoint trained on).
  `recipe` evaluates the checkpoint's weights with another recipe in the layers its policy quantizes (see
  with_forward_recipe): "bf16" for the trained weights without forward quantization, "nvfp4" for a BF16 run
  quantized after training.
  Returns {"step", "val_loss", "phase", "eval_batches", "recipe" (the policy's recipe; in phase 1, past a late BF16
  switch, the forward ran BF16 in every layer, with either switch mode)}. Raises CheckpointError if there is no
  readable checkpoint.
  """
  return evaluate_setup(out, eval_setup(out, step, eval_batches=eval_batches, corpus=corpus, recipe=recipe, log=log))
