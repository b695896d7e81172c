"""OsciReset's numerics: the quantized weight a layer's forward sees, the oscillation ratio, and the reset.

TetraJet-v2 (Chen et al., arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training,
olmo2-training/olmo/quantization_real/oscillation_reset.py and calibrate.py) finds weights whose quantized value
keeps flipping between two FP4 grid points while the float32 master weight barely moves. Over a window of steps it
sums, per element, the distance travelled by the quantized weight, sum |Q(w_t) - Q(w_{t-1})|, and by the master
weight, sum |w_t - w_{t-1}|; an element whose ratio reaches a threshold (8 in the paper's runs) has its master
weight set to its current quantized value, which puts it back in the middle of its FP4 bin. The optimizer state is
left as it is, as in the authors' code.

These are pure array functions; the schedule (start step, period, window) and the statistics carried between steps
live in fp4jax.pretrain.osci.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import recipes as recipes_lib
from fp4jax.quantize import dequantize, quantize


def check_recipe(recipe: recipes_lib.Recipe) -> None:
  """Raises ValueError if `recipe`'s Fprop weight has no quantized value in weight space that OsciReset can use."""
  cfg = recipe.fprop.rhs
  if not cfg.quantized:
    return  # the weight stays in high precision: Q(w) = w, nothing ever oscillates
  if cfg.rht:
    raise ValueError(f"OsciReset: recipe {recipe.name!r} applies a Hadamard transform to the Fprop weight, so its "
                     "quantized value is not a weight-space value to reset to; use a recipe without forward RHT.")


def quantized_weight(w_KxN: jax.Array, recipe: recipes_lib.Recipe, outliers_K: jax.Array | None = None
                     ) -> jax.Array:
  """The float32 values of the weight operand of `recipe`'s Fprop GEMM for master weight `w_KxN` [in, out].

  Blocks run along K (the contraction axis) and follow the recipe: 16x16 for NVIDIA's 2D weights, 1x16 with a
  float32 scale per 1x128 group for TetraJet-v2's double-block scales. A weight the recipe keeps in high
  precision comes back unchanged (as float32).
  outliers_K: bool [K], the rows OutControl runs in MXFP8 (fp4jax.outcontrol): as in the forward's rest operand,
  they are zeroed before the quantization (so they play no part in the block and tensor scales) and come back 0.
  """
  if w_KxN.ndim != 2:
    raise ValueError(f"quantized_weight expects a [K, N] weight; got shape {w_KxN.shape}.")
  if outliers_K is not None and (outliers_K.shape != w_KxN.shape[:1] or outliers_K.dtype != jnp.bool_):
    raise ValueError(f"quantized_weight: outliers_K must be a bool [K={w_KxN.shape[0]}] row mask; got "
                     f"{outliers_K.dtype} {outliers_K.shape}.")
  check_recipe(recipe)
  cfg = recipe.fprop.rhs
  w32 = w_KxN.astype(jnp.float32)
  if not cfg.quantized:
    return w32
  if outliers_K is not None:
    w32 = jnp.where(outliers_K[:, None], jnp.zeros((), jnp.float32), w32)
  q = quantize(w32, cfg.fmt, axis=0, block_2d=cfg.block_2d, pad=cfg.pad)
  return dequantize(q, jnp.float32)


def track(dist_q: jax.Array, dist_w: jax.Array, w: jax.Array, w_prev: jax.Array, q: jax.Array,
          q_prev: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One step of the window: (dist_q + |q - q_prev|, dist_w + |w - w_prev|), all float32, elementwise."""
  f = lambda a: a.astype(jnp.float32)
  return dist_q + jnp.abs(f(q) - f(q_prev)), dist_w + jnp.abs(f(w) - f(w_prev))


def oscillation_ratio(dist_q: jax.Array, dist_w: jax.Array) -> jax.Array:
  """sum|dQ(w)| / sum|dw| per element; 0 where the master weight did not move (as the authors' code sets it)."""
  moved = dist_w > 0
  return jnp.where(moved, dist_q / jnp.where(moved, dist_w, 1.0), 0.0)


def reset(w: jax.Array, q: jax.Array, dist_q: jax.Array, dist_w: jax.Array, threshold: float,
          outliers_K: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(w with the elements whose oscillation ratio is >= `threshold` replaced by q, that boolean mask).

  outliers_K: bool [K], rows of a [K, N] w that OutControl runs in MXFP8: never reset (the authors reset only the
  FP4 channels), whatever their sums gathered before they were selected."""
  if w.shape != q.shape or w.shape != dist_q.shape or w.shape != dist_w.shape:
    raise ValueError(f"reset: w {w.shape}, q {q.shape}, dist_q {dist_q.shape} and dist_w {dist_w.shape} must "
                     "have one shape.")
  mask = oscillation_ratio(dist_q, dist_w) >= threshold
  if outliers_K is not None:
    if w.ndim != 2 or outliers_K.shape != w.shape[:1]:
      raise ValueError(f"reset: outliers_K must be a [K] row mask of the [K, N] weight; got {outliers_K.shape} "
                       f"for w {w.shape}.")
    mask = mask & ~outliers_K[:, None]
  return jnp.where(mask, q.astype(w.dtype), w), mask
