"""The optimizer against a plain NumPy AdamW, and the schedule's step counts (pinned apart from the golden losses)."""

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain.optimizer import OptimizerConfig


def test_warmup_and_decay_lengths_use_pythons_round():
  """round, not int: 0.05 of 30 steps warms up over 2 steps (int would give 1), and resume's arithmetic uses round."""
  args = lambda steps, **kw: optimizer_lib.schedule_args(OptimizerConfig(**kw), steps)
  assert args(30, warmup_fraction=0.05).inv_warmup == np.float32(0.5)
  assert args(10, warmup_fraction=0.05).inv_warmup == 0  # round(0.5) = 0: no warmup
  assert args(10, decay_fraction=0.25).decay_start == 8  # round(2.5) = 2
  assert args(30, decay_fraction=0.25).decay_start == 22  # round(7.5) = 8
  assert args(30, decay_fraction=0.25).inv_decay == np.float32(1.0) / np.float32(8.0)


def _numpy_adamw(params, grads_seq, cfg: OptimizerConfig, lr):
  """Clip to the global norm, then AdamW with bias correction; decoupled weight decay on >= 2-D params only."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, grads in enumerate(grads_seq, start=1):
    g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
    norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
    if norm > cfg.grad_clip:
      g = {k: x * cfg.grad_clip / norm for k, x in g.items()}
    for k in p:
      m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
      v[k] = cfg.b2 * v[k] + (1 - cfg.b2) * g[k] ** 2
      update = (m[k] / (1 - cfg.b1**t)) / (np.sqrt(v[k] / (1 - cfg.b2**t)) + cfg.eps)
      if p[k].ndim >= 2:
        update = update + cfg.weight_decay * p[k]
      p[k] = p[k] - lr * update
  return p


def test_make_optimizer_is_clipped_adamw_with_decay_on_matrices_only():
  """Clip before AdamW, b1 and b2 in their places, decay on the matrix only: each once pinned by golden losses only."""
  cfg = OptimizerConfig(lr=0.1, weight_decay=0.5, grad_clip=1.0, warmup_fraction=0.0, decay_fraction=0.0,
                        b1=0.8, b2=0.9)
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "scale": np.ones(4, np.float32)}
  grads_seq = [{k: (rng.standard_normal(x.shape) * size).astype(np.float32) for k, x in params.items()}
               for size in (50.0, 0.01, 3.0)]  # clipped, not clipped, clipped
  opt = optimizer_lib.make_optimizer(cfg, 10)
  p = jax.tree.map(jnp.asarray, params)
  state = opt.init(p)
  for grads in grads_seq:
    updates, state = opt.update(jax.tree.map(jnp.asarray, grads), state, p)
    p = jax.tree.map(lambda a, b: a + b, p, updates)
  want = _numpy_adamw(params, grads_seq, cfg, lr=0.1)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=2e-5, atol=1e-6, err_msg=k)

  # Zero gradients: the norm scale stays put, the matrix shrinks by exactly (1 - lr * wd).
  opt = optimizer_lib.make_optimizer(cfg, 10)
  p = jax.tree.map(jnp.asarray, params)
  updates, _ = opt.update(jax.tree.map(jnp.zeros_like, p), opt.init(p), p)
  np.testing.assert_array_equal(np.asarray(updates["scale"]), 0.0)
  np.testing.assert_allclose(np.asarray(p["w"] + updates["w"]), params["w"] * (1 - 0.1 * 0.5), rtol=1e-6)
