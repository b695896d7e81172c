"""What the training loop calls around each step: `Hook(fn, every=N)` and the `StepInfo` a hook sees.

fp4jax.pretrain.trainer runs its own periodic work (validation, quantization statistics, checkpoints, the metrics
log) as hooks too, and re-exports these names (trainer.Hook, trainer.StepInfo, trainer.record_hook, trainer.as_hook).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any

from fp4jax.pretrain.steps import TrainState


@dataclasses.dataclass
class StepInfo:
  """What a hook sees: the step index, the train state, and the step's metrics record (hooks may add to it: the
  trainer writes it to metrics.jsonl after the hooks, on log_every steps, the last step and validation steps).

  Hooks before the update see `state` before step `step`; hooks after it see the updated state and the step's loss.
  `final` marks the one extra call after the last step (step == config.steps). The next step donates `state`
  (steps.Phases): a hook that keeps arrays for later must copy them (e.g. `jax.tree.map(np.array, info.state)`);
  a kept jax.Array raises "Array has been deleted" when read after that step.
  """

  step: int
  state: TrainState
  record: dict[str, Any]
  final: bool = False


@dataclasses.dataclass(frozen=True)
class Hook:
  """Periodic work: `fn(info)` at steps that are multiples of `every` (0: never), and at the final call.

  reads_state=False promises that `fn` reads `info.step` and `info.record` only (as a `record_hook` does). The loop
  may then send the next step to the device before calling it, so the device does not wait for the host; by then
  the next step has taken `info.state`'s buffers (a read raises "Array has been deleted"). A hook that reads the
  state (the default) is called before the next step starts.
  """

  fn: Callable[[StepInfo], None]
  every: int = 1
  reads_state: bool = True

  def __post_init__(self):
    if not callable(self.fn):
      raise TypeError(f"Hook: fn must be callable as fn(info); got {self.fn!r}.")
    if not isinstance(self.every, numbers.Integral) or isinstance(self.every, bool) or self.every < 0:
      raise ValueError(f"Hook: every must be an int >= 0 (0: only at the final call); got {self.every!r}.")
    if not isinstance(self.reads_state, bool):
      raise TypeError(f"Hook: reads_state must be True or False; got {self.reads_state!r}.")

  def due(self, step: int, final: bool = False) -> bool:
    """Whether the hook runs at `step` (or at the final call)."""
    return final or (self.every > 0 and step % self.every == 0)

  def __call__(self, info: StepInfo) -> None:
    if self.due(info.step, info.final):
      self.fn(info)


def record_hook(fn: Callable[[int, dict[str, Any]], None], every: int = 1) -> Hook:
  """A Hook from a callable (step, record) -> None, called after each step and once more at the end."""
  return Hook(lambda info: fn(info.step, info.record), every, reads_state=False)


def as_hook(hook: Hook | Callable[[int, dict[str, Any]], None]) -> Hook:
  """`hook` itself, or `record_hook(hook)` for a callable (step, record) -> None.

  A callable that cannot take (step, record), such as a Hook's fn(info) passed without Hook, is refused here,
  before the run starts, rather than failing after the first step has compiled and run.
  """
  if isinstance(hook, Hook):
    return hook
  if not callable(hook):
    raise TypeError(f"hooks must hold Hook objects or callables (step, record) -> None; got {hook!r}.")
  try:
    inspect.signature(hook).bind(0, {})
  except TypeError:
    raise TypeError(f"The hook {hook!r} cannot be called as fn(step, record): a bare callable gets the step and its "
                    "metrics record; wrap a function of one StepInfo as Hook(fn, every=N).") from None
  except ValueError:  # no signature to inspect (some builtins): it is called as given
    pass
  return record_hook(hook)
