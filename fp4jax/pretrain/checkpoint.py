"""Checkpoints: an orbax CheckpointManager holding the train state plus JSON run metadata per step.

Layout: <out>/checkpoints/<step>/{state, meta}. `state` is the pytree {"params", "opt_state", "step"} (float32
master weights and optimizer state, bit-exact); `meta` is JSON: config, recipe, policy, seed and run-key data, the
data position (batches are a pure function of (seed, step), so the step is the position) and the data's identity
("data": data.DataIdentity, checked on resume and evaluation; absent in checkpoints of fp4jax before 2026-12-05).

Failures to find or read a checkpoint raise `CheckpointError` (`CorruptCheckpointError` for damaged files) and never
delete or overwrite anything on disk. A save that fails on the file system (a full disk) raises `CheckpointSaveError`
naming the folder and its free space: orbax writes each step into a <step>.orbax-checkpoint-tmp* folder and renames
it only once complete, so the unfinished step is never listed, restored or resumed from.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import weakref
from typing import Any

import jax
import orbax.checkpoint as ocp

from fp4jax.pretrain import sharding

CHECKPOINT_DIR = "checkpoints"


class CheckpointError(ValueError):
  """A checkpoint is missing, unreadable or does not match the run it is restored into."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files cannot be read (damaged or incomplete), as opposed to not matching the run."""


class StateMismatchError(CheckpointError):
  """A readable checkpoint whose arrays do not fit this run's state (another model shape, OutControl or OsciReset
  switched on or off)."""


class CheckpointSaveError(ValueError):
  """A checkpoint could not be written (a full disk, a file too large for the file system, an I/O error)."""


def os_reason(e: BaseException) -> str | None:
  """The operating system's reason for a failed write (None when `e` is no OS error): an OSError's, or the error
  code tensorstore ends its messages with ("... No space left on device [os_error_code='28']")."""
  if isinstance(e, OSError) and e.errno:
    return e.strerror or os.strerror(e.errno)
  code = re.search(r"os_error_code='(\d+)'", str(e))
  return os.strerror(int(code.group(1))) if code else None


def free_space(folder: pathlib.Path) -> str:
  """How much the file system holding `folder` has free, in MiB ("unknown" when it cannot be read)."""
  try:
    return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB"
  except OSError:
    return "unknown"


def _short(e: Exception, limit: int = 400) -> str:
  """The first `limit` characters of an exception (tensorstore errors embed whole JSON specs)."""
  text = f"{type(e).__name__}: {e}"
  return text if len(text) <= limit else text[:limit] + " ..."


def checkpoint_dir(out_dir: str | pathlib.Path) -> pathlib.Path:
  """Where the checkpoints of the run in `out_dir` live."""
  return pathlib.Path(out_dir).expanduser().absolute() / CHECKPOINT_DIR


def open_manager(out_dir: str | pathlib.Path, *, max_to_keep: int | None = 3, save_interval_steps: int = 1,
                 create: bool = True, local: bool = False) -> ocp.CheckpointManager:
  """A CheckpointManager over <out_dir>/checkpoints (created unless `create=False`).

  local: for reads each process of a multi-process run makes on its own (needs create=False): orbax otherwise ends
  every restore with a collective, which a process that failed before it never joins.
  """
  if save_interval_steps < 1:
    raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}.")
  if max_to_keep is not None and max_to_keep < 1:
    raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}.")
  directory = checkpoint_dir(out_dir)
  if not create and not directory.is_dir():
    raise CheckpointError(f"No checkpoints found: {directory} does not exist.")
  alone = {}
  if local and jax.process_count() > 1:
    alone["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
        primary_host=jax.process_index(), active_processes={jax.process_index()})
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                                         create=create, **alone)
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


# The step of each manager's save still being written in the background (orbax reports its failure later).
_WRITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _save_error(manager: ocp.CheckpointManager, step: int | None, reason: str) -> CheckpointSaveError:
  """The error for a failed save: which checkpoint, where, why, the free space there, and what --resume will do."""
  directory = pathlib.Path(manager.directory)
  try:
    finished = [s for s in available_steps(manager) if s != step]
  except Exception:  # pylint: disable=broad-exception-caught
    finished = []
  which = f"checkpoint {step}" if step is not None else "a checkpoint"
  kept = (f"--resume continues from the newest finished one, step {finished[-1]}" if finished else
          "no checkpoint was finished before it, so start the run again (--overwrite)")
  return CheckpointSaveError(
      f"Could not write {which} in {directory}: {reason} ({free_space(directory)} free there). The run stopped; the "
      f"unfinished step is no checkpoint and {kept}. Free space in {directory} (or give another --out), then run "
      "again.")


def save(manager: ocp.CheckpointManager, step: int, state: dict[str, Any], meta: dict[str, Any], *,
         force: bool = False) -> bool:
  """Saves `state` (a pytree of arrays) and `meta` (JSON-able) at `step`; returns whether a save happened.

  Without `force`, the manager's save interval decides. The caller must never pass a non-finite state.
  Top-level None entries (TrainState.osci when OsciReset is off) are not stored. The save finishes in the
  background: `wait` (or the next save) raises CheckpointSaveError if it failed on the file system.
  """
  if force or manager.should_save(int(step)):
    wait(manager)  # an earlier save that failed is reported as its own step's
  state = {k: v for k, v in state.items() if v is not None}
  args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
  try:
    saved = manager.save(int(step), args=args, force=force)
  except Exception as e:
    reason = os_reason(e)
    if reason is None:
      raise
    raise _save_error(manager, int(step), reason) from e
  if saved:
    _WRITING[manager] = int(step)
  return saved


def wait(manager: ocp.CheckpointManager) -> None:
  """Waits until the manager's background save finished; raises CheckpointSaveError if it failed on the file
  system (other failures propagate as they are)."""
  try:
    manager.wait_until_finished()
  except Exception as e:
    reason = os_reason(e)
    if reason is None:
      raise
    raise _save_error(manager, _WRITING.pop(manager, None), reason) from e
  _WRITING.pop(manager, None)


def available_steps(manager: ocp.CheckpointManager) -> list[int]:
  """Steps with a finished checkpoint, ascending."""
  return sorted(manager.all_steps())


def _pick_step(manager: ocp.CheckpointManager, step: int | None) -> int:
  steps = available_steps(manager)
  if not steps:
    raise CheckpointError(f"No checkpoints found in {manager.directory}.")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise CheckpointError(f"No checkpoint for step {step} in {manager.directory}; available: {steps}.")
  return step


def restore_meta(manager: ocp.CheckpointManager, step: int | None = None) -> tuple[int, dict[str, Any]]:
  """(step, meta) of the checkpoint at `step` (default: latest)."""
  step = _pick_step(manager, step)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  except Exception as e:  # orbax raises many types for damaged files; all mean the same to the caller
    raise CorruptCheckpointError(f"Checkpoint {step} in {manager.directory} is unreadable (metadata): "
                                 f"{_short(e)}. Nothing was deleted; --resume moves it aside and falls back to an "
                                 "earlier one.") from e
  meta = restored["meta"]
  if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):  # every reader needs the run's config
    raise CorruptCheckpointError(f"Checkpoint {step} in {manager.directory} has malformed metadata (no run config): "
                                 f"{repr(meta)[:200]}.")
  return step, meta


def _array_specs(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """{dotted path: (shape, dtype name)} in orbax's naming (namedtuple fields and dict keys alike)."""
  return {sharding.path_str(path): (tuple(leaf.shape), str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_compatible(manager: ocp.CheckpointManager, step: int, abstract) -> None:
  """Compares the stored array names, shapes and dtypes with the target's before reading any data."""
  try:
    stored_tree = manager.item_metadata(step)["state"]
    if stored_tree is None:  # what orbax answers when state/_METADATA is gone: damaged, not another model
      raise FileNotFoundError("the state's array metadata (_METADATA) is missing")
    stored = _array_specs(stored_tree)
  except Exception as e:  # damaged metadata surfaces as many exception types
    raise CorruptCheckpointError(f"Checkpoint {step} in {manager.directory} is unreadable (array metadata): "
                                 f"{_short(e)}. Nothing was deleted; --resume moves it aside and falls back to an "
                                 "earlier one.") from e
  wanted = _array_specs(abstract)
  if stored == wanted:
    return
  params_first = lambda k: (not k.startswith("params."), k)  # else the optimizer's copies fill the first five
  problems = [f"missing {k}" for k in sorted(set(wanted) - set(stored), key=params_first)]
  problems += [f"unexpected {k}" for k in sorted(set(stored) - set(wanted), key=params_first)]
  problems += [f"{k}: stored {stored[k][0]} {stored[k][1]}, expected {wanted[k][0]} {wanted[k][1]}"
               for k in sorted(set(stored) & set(wanted), key=params_first) if stored[k] != wanted[k]]
  more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
  raise StateMismatchError(f"Checkpoint {step} in {manager.directory} does not match this run's model/optimizer "
                        f"(config changed?): {'; '.join(problems[:5])}{more}.")


def restore(manager: ocp.CheckpointManager, target: dict[str, Any], step: int | None = None
            ) -> tuple[int, dict[str, Any], dict[str, Any]]:
  """(step, state, meta) from the checkpoint at `step` (default: latest).

  `target` is a state dict (or the TrainState it comes from) of the same structure (arrays or jax.ShapeDtypeStruct)
  giving shapes, dtypes and shardings; a checkpoint whose structure, shapes or dtypes differ raises CheckpointError. Top-level None entries
  of `target` (not stored, see `save`) come back as None.
  """
  if hasattr(target, "_asdict"):  # a TrainState (NamedTuple): what `save` stores is its dict of fields
    target = target._asdict()
  if not isinstance(target, dict):
    raise TypeError(f"checkpoint.restore: target must be a state dict (TrainState._asdict()) of arrays or "
                    f"jax.ShapeDtypeStruct; got {type(target).__name__}.")
  step = _pick_step(manager, step)
  absent = [k for k, v in target.items() if v is None]
  target = {k: v for k, v in target.items() if v is not None}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  _check_compatible(manager, step, abstract)
  args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
  try:
    restored = manager.restore(step, args=args)
  except Exception as e:  # orbax raises many types for damaged files; all mean the same to the caller
    raise CorruptCheckpointError(f"Checkpoint {step} in {manager.directory} could not be restored: "
                                 f"{_short(e)}. Nothing was deleted; --resume moves it aside and falls back to an "
                                 "earlier one.") from e
  state, meta = restored["state"], restored["meta"]
  want = jax.tree.structure(abstract)
  got = jax.tree.structure(state)
  if want != got:
    raise StateMismatchError(f"Checkpoint {step} in {manager.directory} has a different state structure than this "
                          f"run (model or optimizer config changed?).\n  expected {want}\n  found    {got}")
  for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise StateMismatchError(f"Checkpoint {step} in {manager.directory} holds an array {b.shape} {b.dtype} where "
                            f"this run expects {a.shape} {a.dtype} (model config changed?).")
  return step, {**state, **dict.fromkeys(absent)}, meta
