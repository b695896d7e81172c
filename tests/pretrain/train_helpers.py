"""Helpers shared by the pretraining tests (the `env` fixture lives in conftest.py)."""

import contextlib
import uuid

import jax
import numpy as np

from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import steps as steps_lib
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


@contextlib.contextmanager
def train_step_compiles(monkeypatch):
  """Yields a list that gets one entry per compile of a train step built inside the block: True where JAX's
  persistent cache served it, False where XLA compiled it.

  The steps get a name no other run compiles (the name is part of JAX's cache key), so the first compile in the
  block is XLA's, not one served by the session's persistent cache (tests/conftest.py: another test or worker
  compiled the same graph first, or a kept cache from an earlier run).
  """
  name = f"probe_step_{uuid.uuid4().hex}"
  make = steps_lib.make_train_step

  def renamed(*args, **kwargs):
    step = make(*args, **kwargs)
    step.__name__ = step.__qualname__ = name
    return step

  compiles, hit = [], [False]  # JAX reports a persistent-cache hit just before the compile it served
  on_event = lambda event, **kw: hit.__setitem__(0, True) if event.endswith("cache_hits") else None

  def on_duration(event, duration, **kw):
    del duration
    if event.endswith("backend_compile_duration"):
      if str(kw.get("fun_name")) == f"jit({name})":
        compiles.append(hit[0])
      hit[0] = False

  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    with monkeypatch.context() as patch:
      patch.setattr(steps_lib, "make_train_step", renamed)
      yield compiles
  finally:
    jax.monitoring.unregister_event_listener(on_event)
    jax.monitoring.unregister_event_duration_listener(on_duration)
