"""AdamW with a warmup-stable-decay schedule, global-norm clipping and weight decay on matrices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fp4jax.pretrain.config import TrainConfig


def lr_schedule(config: TrainConfig) -> optax.Schedule:
  """Warmup-stable-decay: linear warmup to `lr`, constant, then linear or 1-sqrt decay to `min_lr_ratio * lr`."""
  peak, total = config.lr, config.steps
  warmup = round(config.warmup_fraction * total)
  decay = round(config.decay_fraction * total)
  decay_start = total - decay
  floor = config.min_lr_ratio

  def schedule(count):
    s = jnp.asarray(count, jnp.float32)
    # (s + 1) / warmup: the first step already moves the weights.
    warm = jnp.minimum(1.0, (s + 1.0) / warmup) if warmup else jnp.float32(1.0)
    if decay:
      # Reaches the floor at step `total` (one past the last update), so the last update still moves the weights.
      frac = jnp.clip((s - decay_start) / decay, 0.0, 1.0)
      shape = frac if config.decay_shape == "linear" else jnp.sqrt(frac)
      tail = floor + (1.0 - floor) * (1.0 - shape)
    else:
      tail = jnp.float32(1.0)
    return peak * warm * tail

  return schedule


def decay_mask(params):
  """Weight decay on matrices (linear kernels, embeddings), not on norm scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (b1, b2, decoupled weight decay on matrices) on the WSD schedule."""
  adamw = optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw


# The fields the optimizer reads: two configs equal on these build the same update rule (compile-cache key).
OPTIMIZER_FIELDS = ("steps", "lr", "min_lr_ratio", "warmup_fraction", "decay_fraction", "decay_shape", "b1", "b2",
                    "eps", "weight_decay", "grad_clip")


def optimizer_key(config: TrainConfig) -> tuple:
  return tuple(getattr(config, f) for f in OPTIMIZER_FIELDS)
