"""Resuming a run: the newest readable checkpoint, damaged ones moved aside, and what a longer --steps means.

Nothing here deletes a checkpoint. A checkpoint that cannot be read, and (with an explicit --resume-step) every
checkpoint after the chosen one, is renamed into <out>/checkpoints_moved/<step>.<reason>.<UTC time>, where orbax no
longer sees it and a later save can never overwrite it. The metric records of steps an explicit --resume-step
abandons go there too (metrics.after-resume-<step>.<UTC time>.jsonl). A refused resume (other data, a checkpoint
beyond --steps, a BF16 switch it would undo) moves nothing: restore_readable's check runs before any move.

The learning-rate schedule and a fractional --switch-at are functions of --steps. Resuming with another --steps
therefore starts a new schedule at the checkpoint's step: steps already taken followed the old one, so the result
equals neither the old run continued nor a fresh run of the new length (unless both schedules agree on the steps
taken). `keep_schedule` keeps the old run's warmup and decay lengths (and the switch's distance from the end) in
steps, which is the usual way to lengthen a warmup-stable-decay run from a checkpoint taken before its decay. A run
that has switched to BF16 is not switched back: `keep_schedule` keeps a past switch where it was, and a --steps that
would move it past the checkpoint is refused (`check_switch_kept`).

Each checkpoint records its data's identity (data.DataIdentity: the corpus as absolute paths, a fingerprint of its
bytes, the tokenizer). The CLI's --resume and `fp4jax eval` read the recorded absolute corpus, so a relative
--data.corpus means what it meant when the run trained, wherever the command runs. Resuming on other data (an edited
corpus, another tokenizer) is refused (`check_data_kept`) unless --data-changed is given; checkpoints saved before
the identity was recorded resume with a note, unchecked.

Multi-process runs: process 0 alone moves checkpoints aside, the others waiting for it. Falling back past an
unreadable checkpoint is refused there (processes could disagree on which checkpoint reads, and would then restore
different steps): resume once with a single process, or pass --resume-step with a readable step.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fp4jax import gemm
from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import distributed
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import runfolder
from fp4jax.pretrain.config import TrainConfig

MOVED_DIR = "checkpoints_moved"
# The options (flat names) keep_schedule sets; giving them on the command line as well is ambiguous.
SCHEDULE_FIELDS = ("warmup_fraction", "decay_fraction", "switch_at")


def moved_path(out_dir: str | pathlib.Path, name: str, suffix: str = "") -> pathlib.Path:
  """A path <out>/checkpoints_moved/<name>.<UTC time>[.n]<suffix> that nothing holds yet (the folder may not exist)."""
  root = pathlib.Path(out_dir).expanduser().absolute() / MOVED_DIR
  stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  dest = root / f"{name}.{stamp}{suffix}"
  n = 1
  while dest.exists():
    n += 1
    dest = root / f"{name}.{stamp}.{n}{suffix}"
  return dest


def move_aside(out_dir: str | pathlib.Path, step: int, reason: str) -> pathlib.Path:
  """Renames checkpoint `step` of the run in `out_dir` into <out>/checkpoints_moved/; returns its new path."""
  src = ckpt.checkpoint_dir(out_dir) / str(step)
  if not src.is_dir():
    raise ckpt.CheckpointError(f"Cannot move checkpoint {step} aside: {src} is not a folder.")
  dest = moved_path(out_dir, f"{step}.{reason}")
  dest.parent.mkdir(exist_ok=True)
  src.rename(dest)  # same file system: atomic, and the data is never copied or dropped
  return dest


def resume_meta(out_dir: str | pathlib.Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
  """(step, meta) of the checkpoint --resume would start from: `step`, else the newest with readable metadata.

  Read-only (the training run itself moves damaged checkpoints aside, under the run folder's lock). Each process of
  a multi-process run reads on its own, so one that fails here leaves none of the others waiting in orbax.
  """
  runfolder.check_resumable(out_dir)  # the same error and advice as `train` gives for a folder with none
  manager = ckpt.open_manager(out_dir, create=False, local=True)
  try:
    if step is not None:
      return ckpt.restore_meta(manager, step)
    steps = ckpt.available_steps(manager)
    errors = []
    for s in reversed(steps):
      try:
        return ckpt.restore_meta(manager, s)
      except ckpt.CorruptCheckpointError as e:
        errors.append(str(e))
    if not errors:
      raise ckpt.CheckpointError(f"No checkpoints found in {manager.directory}.")
    raise ckpt.CorruptCheckpointError(f"No readable checkpoint in {manager.directory}; nothing was moved or "
                                      "deleted:\n  " + "\n  ".join(errors))
  finally:
    manager.close()


def restore_readable(out_dir: str | pathlib.Path, target: dict[str, Any], step: int | None = None, *,
                     log: Callable[[str], None] = print, process_index: int | None = None,
                     process_count: int | None = None,
                     check: Callable[[int, dict[str, Any]], None] | None = None
                     ) -> tuple[int, dict[str, Any], dict[str, Any]]:
  """(step, state, meta) to resume the run in `out_dir` from; moves damaged or superseded checkpoints aside.

  step None: the newest checkpoint that restores; newer damaged ones are moved aside (reason "corrupt").
  step N: checkpoint N, which must restore; later checkpoints are moved aside (reason "after-resume-N") so the
    resumed run's saves cannot mix with them. A checkpoint that does not match the run (another model or optimizer)
    is an error, never a reason to fall back. Nothing is moved unless a checkpoint restored.
  check(step, meta): refuses the restored checkpoint by raising ValueError, before anything is moved.
  Multi-process (process_index/process_count default to JAX's): an unreadable checkpoint raises instead of falling
  back; process 0 alone moves checkpoints aside and the others wait for it.
  """
  pi = jax.process_index() if process_index is None else process_index
  pc = jax.process_count() if process_count is None else process_count
  manager = ckpt.open_manager(out_dir, create=False)
  moves: list[tuple[int, str, str]] = []  # (step, reason, why)
  multi = pc > 1
  try:
    steps = ckpt.available_steps(manager)
    if step is not None:
      result = ckpt.restore(manager, target, step)
      moves = [(s, f"after-resume-{step}", f"it comes after --resume-step {step}") for s in steps if s > step]
    else:
      result, errors = None, []
      for s in reversed(steps):
        try:
          result = ckpt.restore(manager, target, s)
          break
        except ckpt.CorruptCheckpointError as e:
          if multi:
            raise ckpt.CorruptCheckpointError(
                f"{e}\nThis is a multi-process run: unreadable checkpoints are not skipped or moved aside here "
                "(the processes could disagree on which step reads). Resume once with a single process (which moves "
                "it to checkpoints_moved/), or pass --resume-step with an older, readable step.") from None
          errors.append(str(e))
          moves.append((s, "corrupt", "it is unreadable"))
      if result is None:
        if not errors:
          raise ckpt.CheckpointError(f"No checkpoints found in {manager.directory}.")
        raise ckpt.CorruptCheckpointError(f"No readable checkpoint in {manager.directory}; nothing was moved or "
                                          "deleted:\n  " + "\n  ".join(errors))
  finally:
    manager.close()
  error = None
  if check is not None:  # a refused resume leaves the folder as it was
    try:
      check(result[0], result[2])
    except ValueError as e:  # held until the processes agree: one host's corpus alone may differ
      error = e
  if pi == 0 and error is None:  # the others wait below, so no process opens a manager on a half-moved folder
    for s, reason, why in moves:
      try:
        dest = move_aside(out_dir, s, reason)
      except ckpt.CheckpointError as e:
        error = e
      except OSError as e:  # a CheckpointError (a ValueError) reaches the CLI as a usage error, not a traceback
        error = ckpt.CheckpointError(
            f"Could not move checkpoint {s} aside ({why}) to {moved_path(out_dir, f'{s}.{reason}').parent}: {e}. "
            f"The run needs to write its folder {out_dir}; nothing was deleted.")
      if error is not None:
        break
      log(f"Moved checkpoint {s} aside to {dest} ({why}; kept, not deleted).")
  if multi:
    failed = distributed.any_process(error is not None)  # a collective: also the barrier
    if failed and error is None:
      raise ckpt.CheckpointError(f"process {pi}: another process refused checkpoint {result[0]} or could not move "
                                 "superseded checkpoints aside; see its error.")
  if error is not None:
    raise error
  return result


def recorded_corpus(meta: dict[str, Any], step: int, retry: str | None) -> str | None:
  """The absolute corpus spec checkpoint `step` recorded (None in checkpoints from before it was recorded).

  Raises FileNotFoundError when a recorded path is gone; `retry` is the command to name the corpus with instead
  (None where no option names it: the message then says to put it back).
  """
  recorded = meta.get("data")
  if not recorded:
    return None
  corpus = recorded["corpus"]
  missing = [e for e in corpus.split(",") if e != data_lib.BUILTIN_CORPUS and not pathlib.Path(e).exists()]
  if missing:
    fix = (f"name it: {retry} --corpus PATH" if retry is not None else "put it back at that path")
    raise FileNotFoundError(f"Checkpoint {step} was trained on the corpus {corpus!r}, and {', '.join(missing)} no "
                            f"longer exists. If the corpus moved, {fix} (its content is checked against the "
                            "checkpoint's fingerprint).")
  return corpus


class DataChangedError(ValueError):
  """A checkpoint would resume on data other than it was trained on; `changes` and `recorded_corpus` say how."""

  def __init__(self, message: str, changes: list[str], recorded_corpus: str):
    super().__init__(message)
    self.changes, self.recorded_corpus = changes, recorded_corpus


def check_data_kept(recorded: dict[str, Any] | None, current: data_lib.DataIdentity, start: int,
                    data_changed: bool = False) -> str | None:
  """Refuses resuming checkpoint `start` on data other than it was trained on (DataChangedError), unless
  `data_changed`.

  `recorded`: the checkpoint meta's "data" (None in checkpoints from before it was recorded: not checked, a note).
  Returns a note to log, or None.
  """
  if not recorded:
    return (f"Note: checkpoint {start} does not record which data it was trained on (saved by an older fp4jax), so "
            f"the corpus {current.corpus!r} (fingerprint {current.fingerprint}) is used unchecked; checkpoints "
            "saved from now on record it.")
  changes = data_lib.identity_changes(data_lib.DataIdentity.from_dict(recorded), current)
  if not changes:
    return None
  if data_changed:
    return (f"Note: --data-changed: resuming checkpoint {start} on other data than it was trained on: "
            f"{'; '.join(changes)}. The run differs from an uninterrupted one.")
  raise DataChangedError(
      f"The data differs from what checkpoint {start} was trained on: {'; '.join(changes)}. To continue the run on "
      "this data deliberately, pass --data-changed; to continue it on its own data, restore the corpus at "
      f"{recorded['corpus']!r}; or start a new run in another --out.", changes, recorded["corpus"])


def eval_data_note(recorded: dict[str, Any] | None, current: data_lib.DataIdentity, step: int, named: bool,
                   stored_corpus: str, corpus_flag: str | None = "--corpus") -> str | None:
  """Refuses evaluating checkpoint `step` on data other than it trained on, unless the corpus was `named`.

  `stored_corpus`: the config's --data.corpus as typed. `corpus_flag`: the option that names other data (None where
  there is none). Returns a note to log, or None.
  """
  if not recorded:
    relative = [e for e in stored_corpus.split(",")
                if e.strip() != data_lib.BUILTIN_CORPUS and not pathlib.Path(e.strip()).expanduser().is_absolute()]
    where = (f" (its relative path {stored_corpus!r} read from the current folder, as {current.corpus!r})"
             if relative and not named else "")
    return (f"Note: checkpoint {step} does not record which data it was trained on (saved by an older fp4jax), so "
            f"the corpus{where} is used unchecked.")
  changes = data_lib.identity_changes(data_lib.DataIdentity.from_dict(recorded), current)
  if not changes:
    return None
  if named:
    return (f"Note: evaluating checkpoint {step} on other data than it was trained on: {'; '.join(changes)}. The "
            "val_loss is not comparable with the run's own.")
  named_instead = ("" if corpus_flag is None else f", or name the corpus explicitly ({corpus_flag} {current.corpus}) "
                   "to use this data deliberately")
  raise ValueError(f"The data differs from what checkpoint {step} was trained on: {'; '.join(changes)}. Restore "
                   f"the corpus to use the run's own data{named_instead}.")


def keep_schedule(stored: TrainConfig, config: TrainConfig, start: int | None = None) -> TrainConfig:
  """`config` with the warmup and decay lengths of `stored` in steps, and a --switch-at as far from the end.

  For a new --steps on resume: the stable phase absorbs the difference, so a checkpoint taken before the old decay
  continues exactly as the old schedule would have until the (moved) decay starts. A switch the stored run had
  already made before the checkpoint's step `start` stays where it was (a run does not switch back).
  """
  if config.steps == stored.steps:
    return config
  warmup = round(stored.optimizer.warmup_fraction * stored.steps)
  decay = round(stored.optimizer.decay_fraction * stored.steps)
  if warmup + decay > config.steps:
    raise ValueError(f"--keep-schedule: the stored run's warmup ({warmup}) and decay ({decay}) steps do not fit in "
                     f"--steps {config.steps}.")
  changes: dict[str, Any] = {"warmup_fraction": warmup / config.steps, "decay_fraction": decay / config.steps}
  switch = stored.policy.switch_step(stored.steps)
  if switch is not None:
    switched = start is not None and switch < start
    changes["switch_at"] = switch if switched else max(config.steps - (stored.steps - switch), 0)
  return config.replace(**changes)


def _lrs(config: TrainConfig, stop: int) -> np.ndarray:
  return np.asarray(optimizer_lib.lr_schedule(config.optimizer, config.steps)(np.arange(stop)), np.float64)


def gemm_mode_note(stored_mode: str | None, recipe) -> str | None:
  """A note when `recipe`'s gemm_mode "auto" resolves here to another GEMM mode than the checkpoint's steps ran in.

  `stored_mode`: the checkpoint meta's "gemm_mode" (None in checkpoints from before it was recorded). "auto" is
  chosen per machine (fp4jax.gemm.auto_gemm_mode), so a run saved on one CPU type and resumed on another can change
  mode: still the same products, but float32 sums in another order, so not the uninterrupted run bit for bit.
  """
  if stored_mode is None or recipe.gemm_mode != "auto" or not recipe.is_quantized:
    return None
  now = gemm.resolve_gemm_mode(recipe)
  if now == stored_mode:
    return None
  return (f"Note: the checkpoint's steps multiplied in gemm_mode {stored_mode!r}, and the recipe's gemm_mode 'auto' is "
          f"{now!r} on this machine: the same products summed in another order, so the run will differ from an "
          f"uninterrupted one in the last bits. Name the mode in the recipe (gemm_mode={stored_mode}) to keep it "
          "across machines.")


def _schedule_inputs(config: TrainConfig) -> tuple:
  """What lr_schedule reads: AdamW's betas, weight decay or clipping change the run, not its schedule."""
  o = config.optimizer
  return config.steps, o.lr, o.min_lr_ratio, o.warmup_fraction, o.decay_fraction, o.decay_shape


def _bf16_from(switch: int | None, start: int) -> int | None:
  """The step from which a run resumed at `start` runs BF16 under `switch` (None: never)."""
  return None if switch is None else max(switch, start)


def check_switch_kept(stored: TrainConfig, config: TrainConfig, start: int) -> None:
  """Refuses a resume that would take a run which has switched to BF16 back to its quantized recipe.

  A fractional --switch-at follows --steps (and --keep-schedule keeps the switch's distance from the end), so a
  longer run moves the switch later; the steps between the checkpoint and the new switch would run quantized again.
  """
  old_switch = stored.policy.switch_step(stored.steps)
  new_switch = config.policy.switch_step(config.steps)
  if old_switch is None or old_switch >= start or new_switch is None or new_switch <= start:
    return
  span = f"step {start}" if new_switch == start + 1 else f"steps {start}..{new_switch - 1}"
  raise ValueError(f"The stored run switched to BF16 at step {old_switch}; resuming at step {start} with --steps "
                   f"{config.steps} moves the switch to step {new_switch}, so {span} would run "
                   f"{config.policy.recipe.name} again. To stay in BF16, pass --switch-at {old_switch} (an int step).")


def switch_mode_note(stored: TrainConfig, config: TrainConfig, start: int) -> str | None:
  """A note when a resume past the stored run's switch to BF16 switches less of it (--switch all -> forward): Dgrad
  and Wgrad, BF16 since the switch, run the quantized recipe again (a deliberate choice, so said, not refused)."""
  old_switch = stored.policy.switch_step(stored.steps)
  new_switch = config.policy.switch_step(config.steps)
  if old_switch is None or old_switch >= start or new_switch is None or new_switch > start:
    return None
  if stored.policy.switch == "all" and config.policy.switch == "forward":
    return (f"Note: the stored run switched all GEMMs to BF16 at step {old_switch}; with --switch forward, Dgrad "
            f"and Wgrad run {config.policy.recipe.name} again from step {start}.")
  return None


def schedule_note(stored: TrainConfig, config: TrainConfig, start: int, *, others_changed: bool = False
                  ) -> str | None:
  """What resuming the checkpoint of `stored` at `start` under `config` does to the schedule (None: nothing)."""
  old_switch = stored.policy.switch_step(stored.steps)
  new_switch = config.policy.switch_step(config.steps)
  same_schedule = _schedule_inputs(stored) == _schedule_inputs(config)
  if same_schedule and old_switch == new_switch:
    return None
  if same_schedule and _bf16_from(old_switch, start) == _bf16_from(new_switch, start):
    return (f"Note: resuming at step {start} with the BF16 switch at step {new_switch} instead of {old_switch}: both "
            f"lie at or before step {start}, so from there on the run is the stored run continued"
            + (" as far as the switch goes (the other changed settings, said below, make it differ)." if others_changed
               else "."))
  lr_old, lr_new = _lrs(stored, start + 1), _lrs(config, start + 1)
  switched_before = [s for s in (old_switch, new_switch) if s is not None and s < start]
  past_agrees = np.array_equal(lr_old[:start], lr_new[:start]) and (old_switch == new_switch or not switched_before)
  longer = config.steps != stored.steps
  what = "learning-rate schedule" + (" and the BF16 switch are" if old_switch != new_switch else " is")
  lines = [f"Note: resuming at step {start} of a {stored.steps}-step run "
           + (f"with --steps {config.steps}: the {what} recomputed for {config.steps} steps." if longer else
              f"with other schedule settings: the {what} recomputed.")
           + f" LR at step {start}: {lr_old[start]:.4g} in the stored schedule, {lr_new[start]:.4g} now."]
  if past_agrees and others_changed:
    lines.append(f"Both schedules agree on steps 0..{start - 1} (the other changed settings, said below, make the "
                 "run differ all the same).")
  elif past_agrees:
    lines.append(f"Both schedules agree on steps 0..{start - 1}, so this run equals a fresh {config.steps}-step run "
                 f"with warmup_fraction {config.optimizer.warmup_fraction:.4g} and decay_fraction "
                 f"{config.optimizer.decay_fraction:.4g}.")
  else:
    lines.append(f"Steps 0..{start - 1} followed the old schedule, so this is a new schedule: the result equals "
                 f"neither the stored run continued nor a fresh {config.steps}-step run.")
  if start >= stored.steps and stored.optimizer.decay_fraction > 0 and lr_new[start] > lr_old[start - 1]:
    lines.append("The stored run had finished its decay; the learning rate rises again.")
  if new_switch is None and old_switch is not None and old_switch < start:
    lines.append(f"The stored run switched to BF16 at step {old_switch}; with the switch removed (--switch-at None), "
                 f"steps from {start} on run {config.policy.recipe.name} again.")
  return " ".join(lines)
