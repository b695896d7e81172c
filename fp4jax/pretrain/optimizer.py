"""AdamW on a warmup-stable-decay learning-rate schedule, with global-norm clipping and weight decay on matrices."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
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


def lr_schedule(config: OptimizerConfig, steps: int) -> optax.Schedule:
  """Warmup-stable-decay over `steps`: linear warmup to `lr`, constant, then linear or 1-sqrt decay to
  `min_lr_ratio * lr`."""
  peak = config.lr
  warmup = round(config.warmup_fraction * steps)
  decay = round(config.decay_fraction * steps)
  decay_start = steps - decay
  floor = config.min_lr_ratio

  def schedule(count):
    s = jnp.asarray(count, jnp.float32)
    # (s + 1) / warmup: the first step already moves the weights.
    warm = jnp.minimum(1.0, (s + 1.0) / warmup) if warmup else jnp.float32(1.0)
    if decay:
      # Reaches the floor at step `steps` (one past the last update), so the last update still moves the weights.
      frac = jnp.clip((s - decay_start) / decay, 0.0, 1.0)
      shape = frac if config.decay_shape == "linear" else jnp.sqrt(frac)
      tail = floor + (1.0 - floor) * (1.0 - shape)
    else:
      tail = jnp.float32(1.0)
    # Broadcast: without warmup and decay every factor is a constant, and a caller passing many steps gets one LR
    # per step, not one for all.
    return jnp.broadcast_to(peak * warm * tail, s.shape)

  return schedule


def decay_mask(params):
  """Weight decay on matrices (linear kernels, embeddings), not on norm scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimizerConfig, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (b1, b2, decoupled weight decay on matrices) on the WSD schedule."""
  adamw = optax.adamw(lr_schedule(config, steps), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw
