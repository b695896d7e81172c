"""A run folder's ownership: an exclusive lock held for the life of a training run, and opening the folder.

`fcntl.flock` on <out>/run.lock: the kernel drops the lock when its holder exits, however it exits, so a lock can
never outlive a dead process on the same machine. The holder writes its pid, host, start time and command into the
file and empties it on a clean exit; a non-empty file found with the lock free is therefore the trace of a run that
died (killed, crashed, machine lost), which `acquire` reports before taking the lock over. In a multi-process run
process 0 locks run.lock, as a single-process run does, and each other process its own run.<process>.lock: a
second run on the same folder is refused whether it has one process or several (before 2026-12-04 process 0 of a
multi-process run locked run.0.lock, so a single-process run and a multi-process one could share a folder).

--overwrite deletes what fp4jax wrote: metrics.jsonl and, in checkpoints/, the step folders (orbax's unfinished ones
and its root metadata included); anything else there is kept, and said. A run folder may not be the home folder or a
folder above it (`--out '~'` expands to the home folder, where --overwrite would delete ~/checkpoints/<step>), nor
start with a '~user' that names no user (a usage error, not pathlib's RuntimeError).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pathlib
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable

import jax

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import distributed
from fp4jax.pretrain.metrics import METRICS_FILE

LOCK_FILE = "run.lock"
# What orbax writes beside the step folders: a save killed midway (<step>[.partial_save].orbax-checkpoint-tmp-<time>)
# and the manager's root metadata folder (some versions).
_ORBAX_TMP = re.compile(r"[0-9]+\..*orbax-checkpoint-tmp")
_ORBAX_NAMES = ("metadata",)


class RunLockedError(ValueError):
  """Another live process holds the run folder's lock."""


def lock_path(out_dir: str | pathlib.Path, process_index: int = 0, process_count: int = 1) -> pathlib.Path:
  """The lock file of process `process_index` in `out_dir`: run.lock for process 0 (whatever the process count, so
  single- and multi-process runs exclude each other), run.<i>.lock for the others of a multi-process run."""
  del process_count  # process 0 of any run, single or multi-process, holds run.lock
  name = LOCK_FILE if process_index == 0 else f"run.{process_index}.lock"
  return pathlib.Path(out_dir).expanduser().absolute() / name


def _describe(holder: dict) -> str:
  if not holder:
    return "a process that has not written its details yet"
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
  command = " ".join(holder.get("argv", []))
  return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}"
          + (f" ({command})" if command else ""))


def _read_holder(fd: int) -> dict:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = b""
  while chunk := os.read(fd, 65536):
    raw += chunk
  if not raw.strip():
    return {}
  try:
    holder = json.loads(raw)
  except ValueError:
    return {"pid": "?", "host": "?", "argv": [f"unparsable lock file: {raw[:80]!r}"]}
  return holder if isinstance(holder, dict) else {}


def _pid_alive(pid) -> bool:
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


@dataclasses.dataclass
class RunLock:
  """A held lock; `release()` (or leaving the `with` block) empties the file and unlocks it.

  `stale` is the holder record a dead run left behind ({} when the previous run exited cleanly).
  """

  path: pathlib.Path
  fd: int
  stale: dict

  def release(self) -> None:
    """Empties and unlocks the lock file (idempotent)."""
    if self.fd < 0:
      return
    try:
      os.ftruncate(self.fd, 0)  # a clean exit leaves an empty file: nothing stale to report next time
    finally:
      fcntl.flock(self.fd, fcntl.LOCK_UN)
      os.close(self.fd)
      self.fd = -1

  def __enter__(self) -> RunLock:
    return self

  def __exit__(self, *exc) -> None:
    self.release()


_HELD_ERRNOS = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's answers for a lock another holds


def acquire(out_dir: str | pathlib.Path, *, process_index: int = 0, process_count: int = 1,
            log: Callable[[str], None] | None = None) -> RunLock:
  """Locks `out_dir` (which must exist) for this process, or raises RunLockedError naming the holder.

  Never waits: a folder in use is an error, not a queue. A lock left by a dead run is reported through `log` and
  taken over (the dead run's checkpoints stay; resume from them with --resume).
  """
  path = lock_path(out_dir, process_index, process_count)
  # O_CLOEXEC: a child process started by exec (a shell command from a hook) must not inherit the lock.
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in _HELD_ERRNOS:
        raise OSError(e.errno, f"Cannot lock the run folder ({path}): {e.strerror}. The file system may not "
                      "support flock; use an --out on a local or lock-capable file system.") from e
      holder = _read_holder(fd)
      raise RunLockedError(
          f"{pathlib.Path(out_dir)} is in use by another fp4jax run: {_describe(holder)}. Two runs in one folder "
          "would overwrite each other's checkpoints and interleave metrics. Wait for that run to finish, stop it, "
          f"or choose another --out. (Lock file: {path}.)") from None
    stale = _read_holder(fd)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
    os.write(fd, json.dumps(record).encode())
    os.fsync(fd)
  except BaseException:
    os.close(fd)
    raise
  if stale and log is not None:
    same_host = stale.get("host") == socket.gethostname()
    state = ("that process is gone" if same_host and not _pid_alive(stale.get("pid")) else
             "it no longer holds the lock")
    log(f"Note: {pathlib.Path(out_dir)} was locked by a run that did not exit cleanly ({_describe(stale)}); "
        f"{state}, so this run takes the lock over.")
  return RunLock(path=path, fd=fd, stale=stale)


def _has_checkpoints(ck_dir: pathlib.Path) -> bool:
  """Whether `ck_dir` holds a finished checkpoint (a <step> folder). A save killed midway leaves only orbax's
  <step>.orbax-checkpoint-tmp-* folder, which no reader sees: that is no checkpoint to resume from or protect."""
  return ck_dir.is_dir() and any(p.name.isdigit() and p.is_dir() for p in ck_dir.iterdir())


def _existing_run(out: pathlib.Path) -> list[pathlib.Path]:
  """What a run left in `out` worth keeping: a checkpoint folder with a finished checkpoint, metrics with any record.
  A run killed before its first step leaves neither; that is no run to protect (nor one --resume could continue)."""
  ck_dir, metrics_file = ckpt.checkpoint_dir(out), out / METRICS_FILE
  found = []
  if _has_checkpoints(ck_dir):
    found.append(ck_dir)
  if metrics_file.is_file() and metrics_file.stat().st_size > 0:
    found.append(metrics_file)
  return found


def _written_by_fp4jax(entry: pathlib.Path) -> bool:
  """Whether an entry of the checkpoints folder is fp4jax's: a step folder, or what orbax writes beside them."""
  name = entry.name
  return (bool(re.fullmatch(r"[0-9]+", name)) and entry.is_dir()) or bool(_ORBAX_TMP.match(name)) or (
      name in _ORBAX_NAMES)


def _delete_run(out: pathlib.Path, log: Callable[[str], None]) -> None:
  """Deletes the run in `out` for --overwrite: metrics.jsonl and fp4jax's entries in checkpoints/, nothing else."""
  ck_dir, metrics_file = ckpt.checkpoint_dir(out), out / METRICS_FILE
  if ck_dir.is_dir():
    kept = []
    for p in sorted(ck_dir.iterdir()):
      if not _written_by_fp4jax(p):
        kept.append(p.name)
      elif p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
      else:
        p.unlink()
    if kept:
      log(f"--overwrite: kept {len(kept)} entries of {ck_dir} that fp4jax did not write: {', '.join(kept[:10])}"
          + (", ..." if len(kept) > 10 else "") + ".")
    elif not ck_dir.is_symlink():
      ck_dir.rmdir()
  if metrics_file.is_file():
    metrics_file.unlink()


def run_path(out_dir: str | pathlib.Path) -> pathlib.Path:
  """`out_dir` with a leading '~' expanded; refuses the home folder (or one above it) and a '~' that names no user."""
  try:
    out = pathlib.Path(out_dir).expanduser()
  except RuntimeError as e:  # pathlib's answer to a '~user' that names no user, or to no home folder at all
    raise ValueError(f"--out {str(out_dir)!r}: no home folder to expand {pathlib.Path(out_dir).parts[0]!r} to ({e}). "
                     "Give the run folder's full path.") from None
  try:
    home = pathlib.Path.home().resolve()
  except RuntimeError:  # no home folder (no $HOME, no passwd entry): none to protect either
    return out
  where = out.resolve()
  if where == home or where in home.parents:
    what = "your home folder" if where == home else f"a folder above your home folder {home}"
    raise ValueError(f"--out {str(out_dir)!r} is {what} ({where}): a run writes checkpoints/, metrics.jsonl and "
                     "run.lock at the top of its folder, and --overwrite deletes them. Give the run its own folder, "
                     "e.g. --out ~/runs/NAME.")
  return out


def check_resumable(out_dir: str | pathlib.Path) -> None:
  """Raises CheckpointError, saying what to do instead, unless `out_dir` holds a finished checkpoint."""
  out = pathlib.Path(out_dir).expanduser()
  ck_dir = ckpt.checkpoint_dir(out)
  if _has_checkpoints(ck_dir):
    return
  if not ck_dir.is_dir():
    what = f"{ck_dir} does not exist"
  else:
    what = f"{ck_dir} holds no finished checkpoint" if any(ck_dir.iterdir()) else f"{ck_dir} is empty"
  holder = _live_holder(out)
  if holder is not None:  # a run that has not saved its first checkpoint yet: say so, not "start afresh"
    raise RunLockedError(f"{out} is in use by another fp4jax run ({_describe(holder)}), which has saved no checkpoint "
                         "yet to resume from. Wait for it, stop it, or choose another --out.")
  hint = (" It holds metrics of a run stopped before its first checkpoint: pass --overwrite to start afresh."
          if _existing_run(out) else " Run without --resume to start afresh.")
  raise ckpt.CheckpointError(f"--resume: no checkpoints in {out} ({what}).{hint}")


def _live_holder(out: pathlib.Path) -> dict | None:
  """The holder record of a run holding `out`'s run.lock now, else None; reads without taking or changing it."""
  path = lock_path(out)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
      return _read_holder(fd) if e.errno in _HELD_ERRNOS else None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  finally:
    os.close(fd)


class PeerFailedError(ValueError):
  """Another process of a multi-process run failed a step that all processes take together (see its log)."""


def _agree(error: BaseException | None, what: str, process_index: int, process_count: int) -> None:
  """Every process learns whether any failed `what`: raises `error` here, or PeerFailedError if only another did.

  A collective in multi-process runs (all processes must call it), so it is also a barrier; a no-op with one.
  """
  failed = distributed.any_process(error is not None) if process_count > 1 else error is not None
  if error is not None:
    raise error
  if failed:
    raise PeerFailedError(f"process {process_index} of {process_count}: another process failed {what}; see its "
                          "error (process 0's log names it).")


def open_run_folder(out_dir: str | pathlib.Path, *, resume: bool, overwrite: bool,
                    log: Callable[[str], None] | None = None, process_index: int | None = None,
                    process_count: int | None = None) -> tuple[pathlib.Path, RunLock]:
  """Creates and locks `out_dir` for a run; (path, held lock).

  A fresh run (neither `resume` nor `overwrite`) is refused, without touching anything, where a run already is;
  `overwrite` deletes that run's checkpoints and metrics once the lock is held (only what fp4jax wrote: other files
  in checkpoints/ are kept); `resume` needs checkpoints. The home folder (or one above it) is refused (`run_path`).

  Multi-process runs (process_index/process_count default to JAX's): every process checks and locks its own lock
  file (run.lock for process 0, run.<i>.lock for the others), and all agree on the outcome (one refusing makes all
  raise); only process 0 creates the folder and deletes an overwritten run, the others waiting for it.
  """
  pi = jax.process_index() if process_index is None else process_index
  pc = jax.process_count() if process_count is None else process_count
  log = log or (lambda _: None)

  def refuse_existing():
    existing = _existing_run(out)
    if existing and not resume and not overwrite:
      raise ValueError(f"{out} already holds a run ({', '.join(p.name for p in existing)}). Pass --resume to "
                       "continue it, --overwrite to replace it, or choose another --out.")

  error, out = None, None
  try:
    out = run_path(out_dir)
    if resume:
      check_resumable(out)
    refuse_existing()  # before creating the lock file, so a refused run leaves the folder as it was
    if pi == 0:
      try:
        out.mkdir(parents=True, exist_ok=True)
      except OSError as e:  # a file in the way, no permission: a usage error, not a traceback
        what = next((f"{p} is a file" for p in (out, *out.parents) if p.is_file()), e.strerror or e)
        raise ValueError(f"Cannot create the run folder {out}: {what}. Choose another --out.") from e
  except (ValueError, OSError) as e:
    error = e
  _agree(error, "to open the run folder", pi, pc)  # the others wait for process 0's mkdir

  lock = None
  try:
    lock = acquire(out, process_index=pi, process_count=pc, log=log)
    refuse_existing()  # again under the lock: a run may have finished here since the first look
  except (ValueError, OSError) as e:
    error = e
  try:
    _agree(error, "to lock the run folder", pi, pc)
    if overwrite:
      try:
        if pi == 0:
          _delete_run(out, log)
      except OSError as e:
        error = e
      _agree(error, "to delete the overwritten run", pi, pc)  # the others wait for the deletion
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  return out, lock
