"""Whole-model probes on a fixed batch: capture each linear layer's GEMM inputs, and the loss and parameter
gradient of the model under per-layer recipes against the BF16 model (the BF16-layer choice).

`model` arguments are fp4jax.pretrain.model.Transformer instances (anything with `linear_layers()` and
`config.remat`, whose linear layers have a settable `recipe`); this module does not import the training harness.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fp4jax.recipes as recipes_lib
from fp4jax.analysis import taps
from fp4jax.analysis.gemm_probes import forward_is_random
from fp4jax.analysis.probes import LayerTensors, as_probed, cosine, rel_error, standard_error


# --- capture: per-layer x, W, dY from a BF16 forward/backward ----------------------------------------------------

def with_recipes(model: nnx.Module, recipes) -> nnx.Module:
  """A copy of `model` (its own modules and variables; arrays shared) whose linear layers run `recipes`.

  recipes: one Recipe (or recipe string) for every layer, or {layer name: Recipe} naming every linear layer.
  gemm_mode "auto" runs as "f32" (probes.as_probed): reproducible bit for bit across platforms.
  """
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, state, copy=True)
  layers = copy.linear_layers()
  if isinstance(recipes, Mapping):
    missing, unknown = sorted(set(layers) - set(recipes)), sorted(set(recipes) - set(layers))
    if missing or unknown:
      raise ValueError(f"recipes must name every linear layer exactly; missing {missing[:3]}, unknown {unknown[:3]}.")
    for name, layer in layers.items():
      layer.recipe = as_probed(recipes[name])
  else:
    recipe = as_probed(recipes)
    for layer in layers.values():
      layer.recipe = recipe
  return copy


def _check_batch(batch: Mapping[str, Any], model: nnx.Module) -> tuple[jax.Array, jax.Array]:
  if not isinstance(batch, Mapping) or "inputs" not in batch or "targets" not in batch:
    raise ValueError("batch must be a dict with 'inputs' and 'targets' int arrays [B, T].")
  tokens, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
  if (tokens.ndim != 2 or tokens.shape != targets.shape or not jnp.issubdtype(tokens.dtype, jnp.integer)
      or not jnp.issubdtype(targets.dtype, jnp.integer)):
    raise ValueError(f"batch inputs/targets must be int arrays of one shape [B, T]; got {tokens.dtype}{tokens.shape} "
                     f"and {targets.dtype}{targets.shape}.")
  # Out-of-range ids do not raise inside jit: the embedding lookup returns NaN rows and the loss is silently NaN.
  vocab = getattr(getattr(model, "config", None), "vocab_size", None)
  for name, ids in (("inputs", tokens), ("targets", targets)):
    if vocab is None or not ids.size:
      continue
    lo, hi = int(jnp.min(ids)), int(jnp.max(ids))
    if lo < 0 or hi >= vocab:
      raise ValueError(f"batch {name} must be token ids in [0, {vocab}) (the model's vocab_size); got ids in "
                       f"[{lo}, {hi}].")
  return tokens, targets


def capture_layer_tensors(model: nnx.Module, batch: Mapping[str, Any]
                          ) -> tuple[float, dict[str, LayerTensors]]:
  """(BF16 loss, {layer name: LayerTensors}) from one forward/backward of `model` with every linear layer in BF16.

  dY is the gradient of the mean cross-entropy of `batch` with respect to the layer's (compute-dtype) output: what
  the layer's Dgrad and Wgrad receive in training. `model` is not modified. A linear layer that runs other than
  once in the forward (shared, or unused) is a ValueError: its x and dY would not belong together.
  """
  tokens_BxT, targets_BxT = _check_batch(batch, model)
  tapped = with_recipes(model, recipes_lib.bf16())
  kernels = {name: layer.kernel[...] for name, layer in tapped.linear_layers().items()}
  key = taps.check_key(tapped, None)  # every layer is BF16: a placeholder key
  taps.tap_linear_layers(tapped, tokens_BxT.shape, output_grads=True)
  graphdef, dys, rest = nnx.split(tapped, taps.TapOutputGrad, ...)

  @jax.jit
  def run(dys, rest, tokens_BxT, targets_BxT):
    def loss_fn(dys):
      m = nnx.merge(graphdef, dys, rest, copy=True)  # fresh variables: the taps write theirs in this trace
      logits_BxTxV = m(tokens_BxT, key=key).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT).mean()
      return loss, (nnx.state(m, taps.TapInput), nnx.state(m, taps.TapCalls))
    (loss, (inputs, calls)), grads = jax.value_and_grad(loss_fn, has_aux=True)(dys)
    return loss, inputs, calls, grads

  loss, inputs, calls, grads = run(dys, rest, tokens_BxT, targets_BxT)
  taps.check_calls(taps.by_layer(calls))  # x from one call, dY summed over all: a layer must run exactly once
  inputs, dys = taps.by_layer(inputs), taps.by_layer(grads)
  out = {}
  for name, w_KxN in kernels.items():
    k, n = w_KxN.shape
    out[name] = LayerTensors(inputs[name].reshape(-1, k), w_KxN, dys[name].reshape(-1, n))
  return float(loss), out


# --- model-level probes -------------------------------------------------------------------------------------------

def _flat(tree) -> jax.Array:
  return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])


def _loss_and_grad(graphdef, params, rest, tokens_BxT, targets_BxT, key):
  def loss_fn(params):
    logits_BxTxV = nnx.merge(graphdef, params, rest)(tokens_BxT, key=key).astype(jnp.float32)
    per_token_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
    # The mean over everything, as the trainer's loss; per-sequence means for standard errors.
    return per_token_BxT.mean(), per_token_BxT.mean(axis=1)
  (loss, loss_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, loss_B, _flat(grads)


# graphdef (the model's structure and layer recipes) is static: one compilation per distinct model setting.
_loss_and_grad_jit = jax.jit(_loss_and_grad, static_argnums=0)


def _loss_and_grad_fn(model: nnx.Module):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return lambda params, *args: _loss_and_grad_jit(graphdef, params, rest, *args), params


class Reference(NamedTuple):
  """The BF16 model on a batch: mean loss, per-sequence losses [B] and the flat float32 parameter gradient."""

  loss: float
  seq_losses: np.ndarray
  grad: jax.Array


def reference_gradient(model: nnx.Module, batch: Mapping[str, Any]) -> Reference:
  """Loss, per-sequence losses and flat float32 parameter gradient of the model with every linear layer in BF16."""
  tokens, targets = _check_batch(batch, model)
  fn, params = _loss_and_grad_fn(with_recipes(model, recipes_lib.bf16()))
  loss, loss_B, grad = fn(params, tokens, targets, None)
  return Reference(float(loss), np.asarray(loss_B), grad)


def model_probe(model: nnx.Module, batch: Mapping[str, Any], recipes, key, *,
                reference: Reference, num_draws: int = 4) -> dict[str, Any]:
  """Loss and parameter-gradient error of the model under per-layer `recipes` against the BF16 model.

  recipes: as for `with_recipes`. key: PRNG key (draw d uses fold_in(key, d)); None when no layer needs
  randomness. reference: `reference_gradient(model, batch)`.
  Returns loss; dloss (loss - BF16 loss) with dloss_se, its standard error over the batch's sequences, and
  seq_dloss [B] (per-sequence differences, for paired comparisons); grad_err and grad_cos ([num_draws], vs the BF16
  gradient); grad_bias (error of the mean of the draws). A forward without randomness (stochastic rounding only in
  the backward, the usual case) gives one loss for every draw. A random forward (per-call Fprop RHT signs or
  stochastic rounding in Fprop, in any layer) gives loss and seq_dloss as means over the draws, and dloss_se adds
  the standard error of the per-draw losses (conservative; NaN with num_draws=1).
  """
  if not isinstance(num_draws, int) or num_draws < 1:
    raise ValueError(f"num_draws must be an int >= 1; got {num_draws!r}.")
  if not isinstance(reference, Reference):
    raise ValueError("reference must be the Reference returned by reference_gradient(model, batch).")
  tokens, targets = _check_batch(batch, model)
  if reference.seq_losses.shape != (tokens.shape[0],):
    raise ValueError(f"reference has {reference.seq_losses.shape[0]} sequences; the batch has {tokens.shape[0]}.")
  quantized = with_recipes(model, recipes)
  key = taps.check_key(quantized, key)  # a clear error for key=None with SR layers, a placeholder without them
  layers = quantized.linear_layers().values()
  needs_key = any(layer.recipe.needs_key for layer in layers)
  random_forward = any(forward_is_random(layer.recipe) for layer in layers)
  fn, params = _loss_and_grad_fn(quantized)
  draws = num_draws if needs_key else 1
  errs, coss, total, losses, losses_B = [], [], jnp.zeros_like(reference.grad), [], []
  for d in range(draws):
    l, l_B, g = fn(params, tokens, targets, jax.random.fold_in(key, d))
    if random_forward or not losses:  # else the forward, and so the loss, is the same for every draw
      losses.append(float(l))
      losses_B.append(np.asarray(l_B))
    errs.append(float(rel_error(g, reference.grad)))
    coss.append(float(cosine(g, reference.grad)))
    total = total + g
  # One draw of a random forward is not its loss: average the draws, and count their spread in the error bar.
  loss, loss_B = float(np.mean(losses)), np.mean(losses_B, axis=0)
  seq_dloss = loss_B - reference.seq_losses
  dloss_se = standard_error(seq_dloss)
  if random_forward:
    dloss_se = float(np.hypot(dloss_se, standard_error(losses)))
  return {"loss": loss, "dloss": loss - reference.loss, "dloss_se": dloss_se,
          "seq_dloss": seq_dloss, "grad_err": np.asarray(errs * (num_draws // draws)),
          "grad_cos": np.asarray(coss * (num_draws // draws)),
          "grad_bias": float(rel_error(total / draws, reference.grad))}
