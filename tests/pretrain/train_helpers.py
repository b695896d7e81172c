"""Helpers shared by the pretraining tests (the `env` fixture lives in conftest.py)."""

import jax
import numpy as np

from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig


def tiny_config(env, out, **options) -> TrainConfig:
  """A run of the 1-block tiny model on the env's corpus, 32-token sequences, no eval and no progress bar;
  `options` (TrainConfig.from_options names) add to or override these."""
  base = dict(out=str(out), model=model_lib.get_model_config("tiny", n_layers=1), data=env["data"], seq_len=32,
              eval_every=0, eval_batches=0, progress=False)
  base.update(options)
  return TrainConfig.from_options(**base)


def run(env, config, hooks=()):
  """trainer.train with the module's compile cache and no log output."""
  return trainer.train(config, hooks, log=None, compile_cache=env["cache"])


def tree_equal(a, b) -> bool:
  """True when two pytrees have the same leaves, bit for bit."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
