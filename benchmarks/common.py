"""Shared timing helpers for the benchmarks: jit with donated buffers, warm-up, median of N runs, ratio tables.

Timings on a shared machine are noisy, so every benchmark reports ratios to a baseline measured in the same run,
and each timing keeps its spread (min and max of the runs) next to the median.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import resource
import statistics
import sys
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall-clock seconds of one jitted computation over `elements` elements: median, min and max of the runs.

  `page_faults`: minor page faults of this process per timed call (None if not recorded): a buffer the call
  allocates afresh is mapped in by the kernel page by page on its first write (one fault per 4 KiB page).
  """

  name: str
  group: str
  elements: int
  median_s: float
  min_s: float
  max_s: float
  page_faults: float | None = None

  @property
  def elements_per_s(self) -> float:
    return self.elements / self.median_s


def _fresh_copy(a):
  """A new device buffer with `a`'s contents (a donated buffer is consumed by the call it is passed to)."""
  return jax.tree.map(lambda t: jnp.array(t, copy=True), a)


def time_jitted(fn: Callable, args: Sequence, *, name: str, group: str = "", elements: int | None = None,
                donate_argnums: tuple[int, ...] = (0,), warmup: int = 2, repeats: int = 5) -> Timing:
  """Times `jax.jit(fn, donate_argnums=...)(*args)`: compiled ahead of the clock, `warmup` untimed calls (caches,
  first-touch pages), then `repeats` timed.

  Donated arguments are copied afresh before every call, outside the timed region, so each call may reuse its
  input's memory for the output (as a training step does); the others are passed as they are. `elements` defaults
  to the size of the first argument.

  The result is freed after the clock stops: freeing a large buffer is the caller's cost, not the computation's,
  and it is not small (XLA:CPU unmaps a 64 MiB result at once: ~4.5 ms, twice the in-place `x + 1` it came from).
  """
  if repeats < 1 or warmup < 0:
    raise ValueError(f"need repeats >= 1 and warmup >= 0; got repeats={repeats}, warmup={warmup}.")

  def call_args():
    fresh = [_fresh_copy(a) if i in donate_argnums else a for i, a in enumerate(args)]
    return jax.block_until_ready(fresh)

  with warnings.catch_warnings():  # a donated input that cannot hold the output is only a missed optimisation
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    # Compiled here, not by the first call: with warmup=0 that call would be timed.
    jitted = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
    for _ in range(warmup):
      jax.block_until_ready(jitted(*call_args()))
    runs, faults = [], 0
    for _ in range(repeats):
      call = call_args()
      before = minor_faults()
      start = time.perf_counter()
      out = jax.block_until_ready(jitted(*call))
      runs.append(time.perf_counter() - start)
      faults += minor_faults() - before
      del out  # freed after the clock stops (see the docstring)
  if elements is None:
    elements = math.prod(jax.tree.leaves(args)[0].shape)
  return Timing(name, group, elements, statistics.median(runs), min(runs), max(runs), faults / repeats)


def minor_faults() -> int:
  """Minor page faults of this process so far (all its threads)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def malloc_note() -> str:
  """How this process's malloc maps large buffers, for the header of a CPU table (it moved the `small` train step's
  time by 11-15% and the quantizer rows that write a fresh buffer by up to 2x).

  glibc hands out each buffer above 32 MiB as a fresh mapping, faulted in 4 KiB page by page on first write, on
  nearly every call (a CI run under pytest saw one call of two reuse memory); with
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35, read at process start) it asks for transparent 2 MiB pages
  instead, and with glibc.malloc.mmap_max=0 (and arena_max=1) it reuses freed heap memory.
  """
  tunables = [t.strip() for t in os.environ.get("GLIBC_TUNABLES", "").split(":")]
  huge = any(t in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2") for t in tunables)
  note = "malloc: 2 MiB pages (glibc.malloc.hugetlb)" if huge else "malloc: 4 KiB pages (no glibc.malloc.hugetlb)"
  if "glibc.malloc.mmap_max=0" in tunables:  # with arena_max=1: freed buffers are reused, not mapped afresh
    note += ", no fresh mappings (glibc.malloc.mmap_max=0)"
  return note


def interleaved_medians(runs: dict[str, tuple[Callable, Sequence]], *, steps: int, warmup: int) -> dict[str, float]:
  """Median seconds per call of each `fn(*args)` in `runs`, the calls interleaved run by run (one call of each per
  round) so that load changes on a shared machine hit every run alike; the first `warmup` rounds are not timed.
  Results are freed after the clock stops."""
  times = {name: [] for name in runs}
  for i in range(warmup + steps):
    for name, (fn, args) in runs.items():
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*args))
      if i >= warmup:
        times[name].append(time.perf_counter() - t0)
      del out  # freed outside the timed region, as in time_jitted
  return {name: statistics.median(t) for name, t in times.items()}


def format_table(headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
  """Plain-text table with aligned columns; `align` is one of 'l'/'r' per column (default: first left, rest right)."""
  cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  align = align or "l" + "r" * (len(headers) - 1)

  def line(r):
    return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip()

  rule = "  ".join("-" * w for w in widths)
  return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def ratio_table(timings: Sequence[Timing], baseline: str) -> str:
  """One row per timing: median and spread, elements/s, and throughput relative to the `baseline` row of its group.

  "vs baseline" compares medians; "(min)" compares the fastest runs, which shrugs off other processes' load better.
  A "faults/call" column follows when the timings recorded page faults.
  """
  base = {t.group: t for t in timings if t.name == baseline}
  faults = any(t.page_faults is not None for t in timings)
  rows = []
  for t in timings:
    if t.group not in base:
      raise ValueError(f"group {t.group!r} has no baseline row named {baseline!r}.")
    b = base[t.group]
    rows.append([t.group, t.name, f"{t.median_s * 1e3:.2f}", f"{t.min_s * 1e3:.2f}-{t.max_s * 1e3:.2f}",
                 f"{t.elements_per_s / 1e9:.3f}",
                 f"{(t.elements / t.median_s) / (b.elements / b.median_s):.3f}",
                 f"{(t.elements / t.min_s) / (b.elements / b.min_s):.3f}"]
                + ([f"{t.page_faults:.0f}" if t.page_faults is not None else "-"] if faults else []))
  headers = ["dtype", "computation", "median ms", "min-max ms", "Gelem/s", "vs baseline", "(min)"]
  return format_table(headers + (["faults/call"] if faults else []), rows, align="llrrrrr" + ("r" if faults else ""))


def print_ratio_table(timings: Sequence[Timing], baseline: str, title: str | None = None, file=sys.stdout) -> None:
  """Prints `ratio_table` under an optional title."""
  if title:
    print(title, file=file)
  print(ratio_table(timings, baseline), file=file, flush=True)


_ENTRY_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)(\{[^}]*\})? (\S+?)\((.*?)\)")
_SHAPE = re.compile(r"^\w+\[([\d,]*)\]")
_SKIP = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def hlo_passes(fn: Callable, args: Sequence, full_elements: int) -> list[str]:
  """The optimised HLO's top-level kernels (fusions, copies, custom calls) of `jax.jit(fn)(*args)`, one line each.

  A kernel whose output has at least `full_elements` elements, or which reads a parameter of that size, is a pass
  over the full-size data (marked '*'); the rest touch only per-block or scalar data.
  """
  text = jax.jit(fn).lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY"):].splitlines()[1:]
  sizes = {}
  lines = []
  for row in entry:
    m = _ENTRY_OP.match(row)
    if not m:
      continue
    name, shape, _, op, operands = m.groups()
    dims = _SHAPE.match(shape)
    size = math.prod(int(d) for d in dims.group(1).split(",") if d) if dims else 0
    sizes[name] = size
    if op in _SKIP:
      continue
    reads = [o.strip().lstrip("%") for o in operands.split(",")]
    full = size >= full_elements or any(sizes.get(r, 0) >= full_elements for r in reads)
    kind = re.search(r"kind=(\w+)", row)
    lines.append(f"{'*' if full else ' '} {op}{'(' + kind.group(1) + ')' if kind else ''} -> {shape}  [{name}]")
  return lines
