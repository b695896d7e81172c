"""Helpers shared by the pretraining tests (the `env` fixture lives in conftest.py)."""

import jax
import numpy as np

from fp4jax.pretrain import trainer


def run(env, config, hooks=()):
  """trainer.train with the module's compile cache and no log output."""
  return trainer.train(config, hooks, log=None, compile_cache=env["cache"])


def tree_equal(a, b) -> bool:
  """True when two pytrees have the same leaves, bit for bit."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
