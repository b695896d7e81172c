"""A persistent compilation cache for the command-line entry points, on by default.

Compiling the train and eval steps is most of a short CPU run: `fp4jax train --model tiny --recipe nvfp4 --steps 20`
took 18-19 s without the cache and 7.6 s with it warm, to the same final loss bits (2 cores, benchmarks/RESULTS.md).
JAX can keep compiled programs on disk (`jax_compilation_cache_dir`). Its key covers the program, the jax/jaxlib
versions, the XLA flags and the device kind, but on CPU not the instruction set, so a folder shared by two CPU types
could hand one a program built for the other: the default folder is named after this machine's CPU. A cached program
is the one a fresh compile gives, so the results are the same bits.

`fp4jax train|eval`, `python -m experiments.NAME` and the probes call `enable` before their first compile; `import
fp4jax` never does (a library must not write to the user's home on import). Settings, in order of precedence:
  JAX_COMPILATION_CACHE_DIR=DIR   (or jax.config's jax_compilation_cache_dir) JAX's own setting: left alone
  FP4JAX_COMPILE_CACHE=off        no persistent cache (also 0, false, no, none)
  FP4JAX_COMPILE_CACHE=DIR        this folder (shared by several CPU types, it is the user's choice)
  default                         $XDG_CACHE_HOME/fp4jax/xla-<cpu id> (XDG_CACHE_HOME defaults to ~/.cache)
The folder is kept under MAX_BYTES: when it holds more, the least recently written programs are deleted first.

A multi-process run on CPUs runs without the cache, whatever the settings: JAX writes entries from process 0 only
and the other processes' keys differ, so process 0 loads its step from the cache and waits at the first collective
while the others compile, and XLA:CPU's gloo setup gives up after a fixed 30 s (a rerun whose step compiled for
longer failed with DEADLINE_EXCEEDED). Every process compiling is no slower, since all wait for the slowest.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
from collections.abc import Callable

import jax

from fp4jax import gemm
from fp4jax.pretrain import data

ENV = "FP4JAX_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "none")
MAX_BYTES = 2 * 2**30


def cpu_id() -> str:
  """A short stable name of this CPU type: a hash of the machine type and the CPU's feature flags (the instruction
  sets XLA:CPU compiles for)."""
  parts = [platform.machine(), platform.processor(), " ".join(sorted(gemm.cpu_flags()))]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def default_dir() -> pathlib.Path:
  """$XDG_CACHE_HOME/fp4jax/xla-<cpu id>, XDG_CACHE_HOME defaulting to ~/.cache."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "fp4jax" / f"xla-{cpu_id()}"


def prune(folder: pathlib.Path, max_bytes: int = MAX_BYTES) -> int:
  """Deletes the least recently written files of `folder` until it holds at most `max_bytes`; returns how many.

  Files another process deletes or writes meanwhile are skipped: a cache file missing when JAX looks is a miss.
  """
  entries = []
  for p in folder.iterdir():
    try:
      st = p.stat()
    except OSError:
      continue
    if p.is_file():
      entries.append((st.st_mtime, st.st_size, p))
  total = sum(size for _, size, _ in entries)
  removed = 0
  for _, size, p in sorted(entries, key=lambda e: e[0]):
    if total <= max_bytes:
      break
    try:
      p.unlink()
    except OSError:
      continue
    total -= size
    removed += 1
  return removed


def enable(log: Callable[[str], None] | None = None) -> pathlib.Path | None:
  """Turns on JAX's persistent compilation cache as the module docstring says; returns the folder (None if off).

  Call it before the first compile of the process: JAX opens its cache at the first compile and keeps it. Raises
  ValueError for a FP4JAX_COMPILE_CACHE that names no folder ("~user/..." of an unknown user); a folder that cannot
  be made or written is a note, and no cache.
  """
  configured = jax.config.jax_compilation_cache_dir
  setting = os.environ.get(ENV, "").strip()
  off = setting.lower() in OFF
  if not configured and not off:  # a setting that names no folder is an error on every process
    folder = data.expand_folder(ENV, setting, f"(or {ENV}=off)") if setting else default_dir()
  if jax.distributed.is_initialized() and jax.default_backend() == "cpu":
    jax.config.update("jax_enable_compilation_cache", False)
    if log is not None and (configured or not off):
      log("Note: no compilation cache in a multi-process CPU run (fp4jax.pretrain.compile_cache says why).")
    return None
  if configured:
    return pathlib.Path(configured)
  if off:
    return None
  try:
    folder.mkdir(parents=True, exist_ok=True)
    prune(folder)
  except OSError as e:  # a read-only home, a file in the way: run without the cache
    if log is not None:
      log(f"Note: no compilation cache ({folder}: {e.strerror or e}); set {ENV}=DIR or {ENV}=off.")
    return None
  jax.config.update("jax_compilation_cache_dir", str(folder))
  return folder
