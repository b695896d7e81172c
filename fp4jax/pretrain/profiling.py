"""`--profile START:STOP`: a jax.profiler trace of training steps START..STOP-1, written into the run folder.

The trace lands in `<out>/profile` (`<out>/profile/process_<i>` on each process of a multi-process run) as
`plugins/profile/<time>/<host>.xplane.pb`, which TensorBoard's profile plugin (`tensorboard --logdir <out>/profile`)
and XProf read, and `<host>.trace.json.gz`, which https://ui.perfetto.dev opens. Step 0 compiles the step, so a
window after it (e.g. `5:8`) shows steady-state steps only. The loop reads each step's loss before the next starts,
so the trace holds whole steps.
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import jax

PROFILE_DIR = "profile"


def parse_window(spec: str) -> tuple[int, int]:
  """(start, stop) of a 'START:STOP' window of steps (STOP not included); raises ValueError on anything else."""
  match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec) if isinstance(spec, str) else None
  if match is None or int(match[1]) >= int(match[2]):
    raise ValueError(f"profile must be 'START:STOP' with 0 <= START < STOP (steps START..STOP-1 are traced, e.g. "
                     f"'5:8'); got {spec!r}.")
  return int(match[1]), int(match[2])


def trace_dir(out: str | pathlib.Path) -> pathlib.Path:
  """Where this process writes its trace in the run folder `out`."""
  root = pathlib.Path(out) / PROFILE_DIR
  return root / f"process_{jax.process_index()}" if jax.process_count() > 1 else root


class StepProfiler:
  """Starts jax.profiler before the window's first step that this call runs, stops it after the window's last.

  `before(step)` and `after(step)` go around each step; use it as a context manager so that an exception or an
  interrupt inside the window still stops the trace (a second start_trace in the process would fail otherwise).
  """

  def __init__(self, window: tuple[int, int] | None, out, log=print):
    self.window, self.out, self.log = window, out, log
    self.active = False
    self.traced: list[int] = []

  def start_note(self, start: int) -> str | None:
    """What a run starting at step `start` (a resume) says when it misses all or part of the window."""
    if self.window is None or start <= self.window[0]:
      return None
    a, b = self.window
    if start >= b:
      return f"Note: --profile {a}:{b} lies before this run's first step {start}: nothing is traced."
    return f"Note: --profile {a}:{b} starts before this run's first step {start}: steps {start}..{b - 1} are traced."

  def before(self, step: int) -> None:
    """Starts the trace when `step` is the first of the window."""
    if self.window is not None and not self.active and self.window[0] <= step < self.window[1]:
      trace_dir(self.out).mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(trace_dir(self.out)))
      self.active = True

  def starts_or_stops_before(self, step: int) -> bool:
    """Whether the trace starts or stops before `step` (the trainer then lets the step before finish first, so that
    the trace holds the window's steps only)."""
    if self.window is None:
      return False
    return step >= self.window[1] if self.active else self.window[0] <= step < self.window[1]

  def after(self, step: int) -> None:
    """Records `step` as traced; stops the trace after the window's last step."""
    if self.active:
      self.traced.append(step)
      if step + 1 >= self.window[1]:
        self._stop()

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    self.active = False
    self.log(f"Profile of steps {self.traced[0]}..{self.traced[-1]} in {trace_dir(self.out)} "
             f"(tensorboard --logdir, or *.trace.json.gz in ui.perfetto.dev).")

  def __enter__(self) -> StepProfiler:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if not self.active:
      return
    if exc_type is None:
      self._stop()
      return
    with contextlib.suppress(Exception):  # the loop's own exception is the one to report
      jax.profiler.stop_trace()
    self.active = False
