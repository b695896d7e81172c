"""Text from a trained model: `fp4jax sample --out RUN`, and `generate` for notebooks.

  fp4jax sample --out runs/x                      (continues the first 32 tokens of the held-out text)
  fp4jax sample --out runs/x --prompt "ROMEO:" --tokens 300 --temperature 0.8 --top-k 40 --seed 1

The model runs as it trained at the checkpoint's step: every linear layer with the recipe of that step's precision
phase (an NVFP4 layer quantizes its forward GEMM's operands as in training), with OutControl's outlier channels when
they were on, and the run's evaluation key for recipes whose forward pass draws random bits. Each new token is drawn
from the logits at the context's last position. The context is the last `window` tokens (default: the run's
training sequence length), at positions 0, 1, ... and zero-padded after its end, so that one compiled function
serves every length. Causal attention keeps the padding out of the logits, except through per-tensor scales: under
recipes that have them (nvfp4, four_over_six, quartet2) the padded rows join each activation's per-tensor amax, as
the later tokens of a training row do. Block-scaled and BF16 layers are exactly causal.

The same checkpoint, prompt, settings and seed give the same tokens: token i is drawn with
fold_in(key(seed), i).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import outcontrol as outcontrol_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer

DEFAULT_PROMPT_TOKENS = 32  # of the held-out text, when no prompt is given


@dataclasses.dataclass(frozen=True)
class SampleConfig:
  """How tokens are drawn. temperature 0 takes the most likely token (greedy); top_k keeps the k most likely."""

  new_tokens: int = 200
  temperature: float = 0.8
  top_k: int | None = None  # None: the whole vocabulary
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.new_tokens, int) or isinstance(self.new_tokens, bool) or self.new_tokens < 1:
      raise ValueError(f"new_tokens (fp4jax sample --tokens) must be an int >= 1; got {self.new_tokens!r}.")
    if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"temperature (--temperature) must be a finite number >= 0 (0: greedy); got {self.temperature!r}.")
    if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1):
      raise ValueError(f"top_k (--top-k) must be None or an int >= 1; got {self.top_k!r}.")
    if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
      # jax.random.key keeps the low 32 bits (without x64): seed 2**32 + k would draw seed k's text.
      raise ValueError(f"seed (--seed) must be an int in [0, 2**32); got {self.seed!r}.")


def pick_token(logits_V: jax.Array, key: jax.Array, temperature, top_k: int | None = None,
               vocab_size: int | None = None) -> jax.Array:
  """One token id (int32) from float logits [V]: argmax when temperature is 0, else a draw from
  softmax(logits / temperature) over the top_k largest (ties at the k-th kept) among the first vocab_size ids."""
  logits_V = logits_V.astype(jnp.float32)
  if vocab_size is not None and vocab_size < logits_V.shape[0]:  # ids the tokenizer cannot decode
    logits_V = jnp.where(jnp.arange(logits_V.shape[0]) < vocab_size, logits_V, -jnp.inf)
  if top_k is not None and top_k < logits_V.shape[0]:
    kth = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  drawn = jax.random.categorical(key, logits_V / jnp.where(temperature > 0, temperature, 1.0))
  return jnp.where(temperature > 0, drawn, jnp.argmax(logits_V)).astype(jnp.int32)


@functools.lru_cache(maxsize=16)
def make_next_token(graphdef, *, top_k: int | None = None, vocab_size: int | None = None):
  """next(params, tokens_1xW, length, model_key, key, index, temperature, outcontrol) -> (token, logits finite):
  the token after the first `length` tokens of the window, drawn with fold_in(key, index); jitted, and kept per
  (graphdef, top_k, vocab_size), so that later calls of `generate` with the same model do not compile again."""

  def next_token(params, tokens_1xW, length, model_key, key, index, temperature, outcontrol):
    model = nnx.merge(graphdef, params)
    if outcontrol is not None:
      model = steps_lib.with_outliers(model, outcontrol)
    logits_V = model(tokens_1xW, key=model_key)[0, length - 1]
    token = pick_token(logits_V, jax.random.fold_in(key, index), temperature, top_k, vocab_size)
    return token, jnp.all(jnp.isfinite(logits_V))

  return jax.jit(next_token)


def _check_prompt(prompt, vocab: int) -> np.ndarray:
  ids = np.asarray(prompt)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"The prompt must be a non-empty 1D array of token ids; got {ids.dtype} {ids.shape}.")
  if ids.min() < 0 or ids.max() >= vocab:
    raise ValueError(f"Prompt token ids must lie in [0, {vocab}); got range [{ids.min()}, {ids.max()}].")
  return ids.astype(np.int32)


def generate(graphdef, params, prompt, sample: SampleConfig = SampleConfig(), *, window: int,
             model_key: jax.Array | None = None, outcontrol=None, vocab_size: int | None = None,
             progress: bool = False) -> np.ndarray:
  """`sample.new_tokens` token ids (int32) continuing `prompt` (1D token ids) with the model `graphdef` holding
  `params` (e.g. `nnx.split(model)`), each drawn from the last `window` tokens of the context (see the module
  docstring). model_key: the key of the model's own randomness (needed when a layer's recipe draws random bits);
  outcontrol: an OutControlState whose outlier channels run in MXFP8; vocab_size: draw only ids below it (a
  tokenizer smaller than the model's vocabulary)."""
  config = nnx.merge(graphdef, params).config
  if not isinstance(window, int) or not 1 <= window <= config.max_seq_len:
    raise ValueError(f"window must be an int in [1, max_seq_len={config.max_seq_len}]; got {window!r}.")
  context = list(_check_prompt(prompt, config.vocab_size))
  next_token = make_next_token(graphdef, top_k=sample.top_k, vocab_size=vocab_size)
  key = jax.random.key(sample.seed)
  temperature = jnp.float32(sample.temperature)
  tokens_W = np.zeros(window, np.int32)
  out = []
  for i in tqdm.trange(sample.new_tokens, desc="sample", unit="token", leave=False, disable=not progress):
    last = context[-window:]
    tokens_W[:len(last)] = last
    tokens_W[len(last):] = 0
    token, finite = jax.device_get(next_token(params, tokens_W[None], len(last), model_key, key, i, temperature,
                                              outcontrol))
    if not finite:
      raise ValueError(f"The model's logits are not finite at new token {i}: nothing to draw from.")
    context.append(int(token))
    out.append(int(token))
  return np.asarray(out, np.int32)


def sample_run(out: str | pathlib.Path, sample: SampleConfig = SampleConfig(), *, prompt: str | None = None,
               step: int | None = None, corpus: str | None = None, window: int | None = None, progress: bool = False,
               recipe=None, log=print) -> dict[str, Any]:
  """Text continuing `prompt` (default: the first 32 tokens of the held-out text) from checkpoint `step` (default:
  latest) of the run in `out`, read with the checkpoint's tokenizer and data (`corpus`, as for `fp4jax eval`).
  `recipe`: another recipe in the layers the run's policy quantizes (trainer.with_forward_recipe).

  Returns {"step", "layers" (recipe name: count of linear layers), "prompt", "text", "tokens", "window", and the
  SampleConfig's fields}.
  """
  if jax.process_count() > 1:
    raise ValueError("fp4jax sample runs in one process: start it without the FP4JAX_* multi-process variables.")
  setup = trainer.eval_setup(out, step, eval_batches=1, corpus=corpus, recipe=recipe, log=log, command="fp4jax sample")
  dataset = setup.dataset
  if prompt is None:
    source = dataset.val if dataset.val.size else dataset.train
    prompt_ids = np.asarray(source[:DEFAULT_PROMPT_TOKENS], np.int32)
  else:
    prompt_ids = data_lib.encode(dataset, prompt)
    if not prompt_ids.size:
      raise ValueError("The prompt is empty: give some text (or leave --prompt out to continue the held-out text).")
  run = trainer.restore_run(out, setup)
  window = setup.config.train_seq_len if window is None else window
  graphdef = run.phases.graphdef(run.at)
  oc_on = run.outcontrol is not None and outcontrol_lib.phase(run.at, setup.config.outcontrol) == "on"
  tokens = generate(graphdef, run.params, prompt_ids, sample, window=window, model_key=run.keys["eval"],
                    outcontrol=run.outcontrol if oc_on else None, vocab_size=dataset.vocab_size, progress=progress)
  layers = collections.Counter(run.phases.layer_recipes(run.at).values())
  return {"step": run.step, "layers": dict(layers), "prompt": data_lib.decode(dataset, prompt_ids),
          "text": data_lib.decode(dataset, tokens), "tokens": tokens.tolist(), "window": window,
          **dataclasses.asdict(sample)}
