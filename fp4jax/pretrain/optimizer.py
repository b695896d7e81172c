"""AdamW on a warmup-stable-decay learning-rate schedule, with global-norm clipping and weight decay on matrices."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp4jax.pretrain.options import option

DECAY_SHAPES = ("linear", "1-sqrt")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with a warmup-stable-decay schedule and global-norm clipping; fractions are of the run's steps."""

  lr: float = option(3e-3, "peak learning rate")
  min_lr_ratio: float = option(0.0, "LR floor as a fraction of the peak, reached at step --steps (one past the "
                                    "last update)")
  warmup_fraction: float = option(0.05, "linear warmup, fraction of steps")
  decay_fraction: float = option(0.2, "decay over the last fraction of steps")
  decay_shape: str = option("linear", "decay shape: linear | 1-sqrt")
  b1: float = option(0.9, "AdamW beta1")
  b2: float = option(0.95, "AdamW beta2")
  eps: float = option(1e-8, "AdamW epsilon")
  weight_decay: float = option(0.1, "decoupled weight decay (matrices only)")
  grad_clip: float = option(1.0, "global gradient-norm clip (0 = off)")

  def __post_init__(self):
    def need(ok, message):
      if not ok:
        raise ValueError(f"OptimizerConfig: {message}")

    for name in ("lr", "min_lr_ratio", "warmup_fraction", "decay_fraction", "b1", "b2", "eps", "weight_decay",
                 "grad_clip"):  # a string or None would fail below with a bare TypeError
      value = getattr(self, name)
      need(isinstance(value, numbers.Real) and not isinstance(value, bool),
           f"{name} must be a number; got {value!r} ({type(value).__name__}).")
    need(isinstance(self.decay_shape, str), f"decay_shape must be a str; got {self.decay_shape!r}.")
    for name in ("lr", "eps", "weight_decay", "grad_clip"):  # inf: eps=inf freezes every weight without a word
      need(math.isfinite(getattr(self, name)), f"{name} must be finite; got {getattr(self, name)!r}"
           + (" (0 turns clipping off)." if name == "grad_clip" else "."))
    need(self.lr > 0, f"lr must be > 0; got {self.lr!r}.")
    need(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio must lie in [0, 1]; got {self.min_lr_ratio!r}.")
    for name in ("warmup_fraction", "decay_fraction"):
      value = getattr(self, name)
      need(0.0 <= value <= 1.0, f"{name} must lie in [0, 1]; got {value!r}.")
    need(self.warmup_fraction + self.decay_fraction <= 1.0,
         f"warmup_fraction + decay_fraction must be <= 1; got {self.warmup_fraction} + {self.decay_fraction}.")
    need(self.decay_shape in DECAY_SHAPES, f"decay_shape must be one of {DECAY_SHAPES}; got {self.decay_shape!r}.")
    need(0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0, f"b1, b2 must lie in [0, 1); got {self.b1}, {self.b2}.")
    need(self.eps > 0, f"eps must be > 0; got {self.eps!r}.")
    need(self.weight_decay >= 0, f"weight_decay must be >= 0; got {self.weight_decay!r}.")
    need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 = off); got {self.grad_clip!r}.")


SCHEDULE_FIELDS = ("lr", "min_lr_ratio", "warmup_fraction", "decay_fraction", "decay_shape")


class ScheduleArgs(NamedTuple):
  """The numbers of a run's WSD schedule, float32 scalars: runtime inputs of the train step, so one compiled step
  serves runs of any length (and peak LR, warmup, decay). Fields derived on the host, see `schedule_args`."""

  peak: Any  # the peak learning rate
  inv_warmup: Any  # 1 / warmup steps in float32; 0 without warmup
  decay_start: Any  # the first step of the decay (steps - decay steps)
  inv_decay: Any  # 1 / decay steps in float32; 0 without decay
  floor: Any  # min_lr_ratio
  rise: Any  # 1 - min_lr_ratio, taken in float64 then rounded
  sqrt_decay: Any  # 1.0: the 1-sqrt decay; 0.0: linear


def schedule_args(config: OptimizerConfig, steps: int) -> ScheduleArgs:
  """The schedule of a `steps`-step run as float32 NumPy scalars. Warmup and decay last round(fraction * steps)
  steps (Python's round: halves to even; 0.05 of 10 steps is no warmup, of 30 steps 2).

  They are the constants XLA made of the schedule when its numbers were Python constants of the step: a division
  by a constant n became a multiplication by float32(1 / n), and 1 - min_lr_ratio was a float64 Python number. The
  step computes with these exact values, so the learning rates (and losses) keep their bits.
  """
  warmup = round(config.warmup_fraction * steps)
  decay = round(config.decay_fraction * steps)
  f32 = np.float32
  inverse = lambda n: f32(1.0) / f32(n) if n else f32(0.0)
  return ScheduleArgs(peak=f32(config.lr), inv_warmup=inverse(warmup), decay_start=f32(steps - decay),
                      inv_decay=inverse(decay), floor=f32(config.min_lr_ratio), rise=f32(1.0 - config.min_lr_ratio),
                      sqrt_decay=f32(config.decay_shape == "1-sqrt"))


def wsd_lr(args: ScheduleArgs, count, xp=jnp) -> jax.Array:
  """The learning rate after `count` updates (a scalar or an array of counts): linear warmup to the peak,
  constant, then linear or 1-sqrt decay to `floor * peak`.

  xp: jax.numpy, or numpy for the host (the trainer's logged LR: no device dispatch per step). Every operation is
  one float32 rounding, correctly rounded in both, so NumPy gives eager JAX's bits (tested).
  """
  f32 = xp.float32
  s = xp.asarray(count, f32)
  # (s + 1) / warmup: the first step already moves the weights.
  warm = xp.where(args.inv_warmup > 0, xp.minimum(f32(1.0), (s + f32(1.0)) * args.inv_warmup), f32(1.0))
  # Reaches the floor at step `steps` (one past the last update), so the last update still moves the weights.
  frac = xp.clip((s - args.decay_start) * args.inv_decay, f32(0.0), f32(1.0))
  shape = xp.where(args.sqrt_decay > 0, xp.sqrt(frac), frac)
  tail = xp.where(args.inv_decay > 0, args.floor + args.rise * (f32(1.0) - shape), f32(1.0))
  return args.peak * warm * tail


def lr_schedule(config: OptimizerConfig, steps: int) -> optax.Schedule:
  """Warmup-stable-decay over `steps`: linear warmup to `lr`, constant, then linear or 1-sqrt decay to
  `min_lr_ratio * lr`."""
  args = schedule_args(config, steps)
  return lambda count: wsd_lr(args, count)


def decay_mask(params):
  """Weight decay on matrices (linear kernels, embeddings), not on norm scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimizerConfig, steps: int | ScheduleArgs) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (b1, b2, decoupled weight decay on matrices) on the WSD schedule.

  steps: the run's length (the schedule's numbers become constants of a step that jits the optimizer), or its
  ScheduleArgs (arrays a jitted step takes as inputs: see `step_settings`). The optimizer state is the same.
  """
  args = steps if isinstance(steps, ScheduleArgs) else schedule_args(config, steps)
  adamw = optax.adamw(lambda count: wsd_lr(args, count), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw


def step_settings(config: OptimizerConfig) -> tuple:
  """The settings a train step taking ScheduleArgs compiles in: all but the schedule's (SCHEDULE_FIELDS)."""
  return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in SCHEDULE_FIELDS)
