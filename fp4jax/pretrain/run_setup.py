"""What a run is built from before its first step: PRNG streams, the model, the data and the step-0 train state.

Shared by `trainer.train` and `trainer.evaluate` (which rebuilds a run from its checkpointed config) and by the
benchmarks and experiments that set up a model the way training does; trainer re-exports the public names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import osci as osci_lib
from fp4jax.pretrain import outcontrol as outcontrol_lib
from fp4jax.pretrain.config import TrainConfig
from fp4jax.pretrain.steps import TrainState

# Independent streams derived from the run key.
_INIT_STREAM, _STEP_STREAM, _EVAL_STREAM, _STATS_STREAM = 0, 1, 2, 3


def run_keys(seed: int) -> dict[str, jax.Array]:
  """The run's PRNG streams: init, step (fold in the step index), eval, stats."""
  base = jax.random.key(seed)
  return {name: jax.random.fold_in(base, stream) for name, stream in
          (("init", _INIT_STREAM), ("step", _STEP_STREAM), ("eval", _EVAL_STREAM), ("stats", _STATS_STREAM))}


def build_model(config: TrainConfig, key: jax.Array) -> model_lib.Transformer:
  """The model with freshly initialised float32 params, built with the policy's per-layer recipes of step 0."""
  names = model_lib.layer_names(config.model)
  return init_model(config.model, config.policy.layer_recipes(names, config.model.n_layers, 0, config.steps), key)


def init_model(model_config: model_lib.ModelConfig, recipe, key: jax.Array) -> model_lib.Transformer:
  """A Transformer with `recipe` (as Transformer takes it) and params initialised from `key` under one compile per
  model config; the params do not depend on the recipe."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda k: _make_model(model_config, recipe, k), key))
  return nnx.merge(graphdef, _init_state(model_config, key))


def _make_model(model_config, recipe, key):
  return model_lib.Transformer(model_config, recipe=recipe, rngs=nnx.Rngs(params=key))


# Initialised under jit: one compile per model config instead of one per eager initializer op. Recipes are static
# layer settings that initialisation never reads, so the params come from a BF16 model of the same shapes.
@functools.partial(jax.jit, static_argnums=0)
def _init_state(model_config, key):
  return nnx.state(_make_model(model_config, None, key))


def load_data(config: TrainConfig, process_index: int = 0, process_count: int = 1
              ) -> tuple[data_lib.TokenDataset, list[dict[str, np.ndarray]]]:
  """The dataset and the fixed validation batches (row block `process_index` of `process_count`); checks the
  vocabulary fits the model."""
  dataset = data_lib.load_dataset(config.data)
  if dataset.vocab_size > config.model.vocab_size:
    raise ValueError(f"The tokenizer has {dataset.vocab_size} tokens but the model's vocab_size is "
                     f"{config.model.vocab_size}: pass --model.vocab_size {dataset.vocab_size}.")
  _check_corpus_size(dataset, config)
  if not config.evaluation.batches:
    return dataset, []
  val = data_lib.val_batches(dataset, batch_size=config.batch_size, seq_len=config.train_seq_len,
                             num_batches=config.evaluation.batches, process_index=process_index,
                             process_count=process_count)
  return dataset, val


def _smallest_corpus(window: int, frac: float, val_need: int) -> int:
  """The fewest tokens whose train split (n - ceil(n * frac)) holds `window` and held-out split `val_need` tokens."""
  val = lambda n: math.ceil(n * frac) if frac > 0 else 0
  # Below (val_need - 1) / frac the held-out split is too short; start just under it (float slack) and count up.
  need = max(window, int((val_need - 1) / frac) - 1) if val_need else window
  while need - val(need) < window or val(need) < val_need:
    need += 1
  return need


def _check_corpus_size(dataset: data_lib.TokenDataset, config: TrainConfig) -> None:
  """Every window takes seq_len+1 tokens from one split; says how to fix a corpus too small for that."""
  window, frac = config.train_seq_len + 1, config.data.val_fraction
  n_train, n_val = dataset.train.size, dataset.val.size if config.evaluation.batches else window
  if n_train >= window and n_val >= window:
    return
  if config.evaluation.batches and frac <= 0:
    raise ValueError(f"data.val_fraction=0 leaves no validation split, but eval_batches={config.evaluation.batches}: "
                     "pass --eval-batches 0 or a --data.val_fraction > 0.")
  n = n_train + dataset.val.size
  # The validation windows eval_batches x batch_size asks for (batches.val_batches) need seq_len + n_windows tokens:
  # a hint that would fail in the next check helps no one.
  n_windows = config.evaluation.batches * config.batch_size
  need = _smallest_corpus(window, frac, window - 1 + n_windows if config.evaluation.batches else 0)
  # The longest --seq-len that leaves a training window and those validation windows.
  fits = min(n_train - 1, dataset.val.size - n_windows) if config.evaluation.batches else n_train - 1
  # Byte tokens only: BPE cuts the text, and another cut learns another vocabulary (other token counts).
  split = (_val_fraction_that_fits(n, window, window - 1 + n_windows)
           if config.evaluation.batches and config.data.tokenizer == "byte" else None)
  raise ValueError(
      f"The corpus is too small: it has {n} tokens (train split {n_train}, validation split {dataset.val.size} at "
      f"val_fraction={frac}), but every window needs seq_len+1={window} tokens from one split"
      + (f" and validation takes {n_windows} windows (eval_batches x batch_size)" if config.evaluation.batches else "")
      + f", so it needs at least {need} tokens. Use a larger --corpus"
      + (f", a --seq-len of at most {fits}" if fits >= 1 else "")
      + (f", a --data.val_fraction of {split} when training" if split is not None else "")
      + (", or --eval-batches 0 to skip validation." if config.evaluation.batches else "."))


def _val_fraction_that_fits(n: int, window: int, val_need: int) -> str | None:
  """A val_fraction (2 significant digits) whose split of `n` tokens leaves a `window` to train on and `val_need`
  validation tokens; None when none does."""
  val = lambda f: math.ceil(n * f)
  if n - val_need < window:
    return None
  step = 10.0 ** (math.floor(math.log10(val_need / n)) - 1)
  f = math.ceil(val_need / n / step) * step
  while val(float(f"{f:.2g}")) < val_need:  # float slack in the product
    f += step
  f = float(f"{f:.2g}")
  return f"{f:g}" if f < 1 and n - val(f) >= window else None


def initial_state(config: TrainConfig, params, optimizer_init: Callable) -> TrainState:
  """The step-0 TrainState for `params`: optimizer_init(params), and zero OsciReset / OutControl statistics when
  they are on."""
  return TrainState(params=params, opt_state=optimizer_init(params), step=jnp.asarray(0, jnp.int32),
                    osci=osci_lib.initial_state(config, params), outcontrol=outcontrol_lib.initial_state(config))
