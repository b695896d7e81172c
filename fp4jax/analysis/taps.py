"""Layer taps: swap each linear layer of an NNX model for a wrapper that records its input and output gradient.

A `Tap` keeps the input its layer received (cast to the layer's compute dtype: what the layer's GEMMs quantize) in
a `TapInput` variable and, when asked, adds a zero `TapOutputGrad` variable to the layer's output: the gradient of
a loss with respect to that zero is the layer's output gradient dY. Taps change the model they are put in: tap a
throwaway copy (e.g. from nnx.merge). A `TapCalls` counter lets captures refuse a layer that ran other than once.
Used by fp4jax.analysis.probes (x, W, dY per layer) and by fp4jax.pretrain.metrics (per-layer input statistics).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class TapInput(nnx.Variable):
  """The input a tapped layer received (overwritten by each call; each linear layer runs once per forward)."""


class TapOutputGrad(nnx.Variable):
  """A zero added to a tapped layer's output; its gradient is the layer's output gradient dY."""


class TapCalls(nnx.Variable):
  """How many times a tapped layer ran: a tap holds one call's input, so a capture needs exactly one."""


class Tap(nnx.Module):
  """Wraps a linear layer (anything with in_features, out_features, dtype and `__call__(x, *, key)`)."""

  def __init__(self, inner: nnx.Module, batch_shape: tuple[int, ...], *, output_grad: bool = False):
    self.inner = inner
    self.x_in = TapInput(jnp.zeros((*batch_shape, inner.in_features), inner.dtype))
    self.dy = TapOutputGrad(jnp.zeros((*batch_shape, inner.out_features), inner.dtype)) if output_grad else None
    self.calls = TapCalls(jnp.zeros((), jnp.int32))

  def __call__(self, x, *, key=None):
    self.calls[...] = self.calls[...] + 1
    self.x_in[...] = x.astype(self.inner.dtype)  # what the layer's GEMMs see (Linear casts its input so)
    y = self.inner(x, key=key)
    return y if self.dy is None else y + self.dy[...]


def _parent_and_attr(model: nnx.Module, name: str):
  *path, attr = name.split(".")
  parent = model
  for part in path:
    parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
  return parent, attr


def _linear_layers(model: nnx.Module) -> dict[str, nnx.Module]:
  if not callable(getattr(model, "linear_layers", None)):
    raise ValueError(f"the analysis taps need a model with a linear_layers() method returning {{name: layer}} (as "
                     f"fp4jax.pretrain.model.Transformer has); {type(model).__name__} has none.")
  return model.linear_layers()


def tap_linear_layers(model: nnx.Module, batch_shape: tuple[int, ...], *, output_grads: bool = False
                      ) -> dict[str, Tap]:
  """Replaces every layer of `model.linear_layers()` by a Tap, in place; returns {layer name: Tap}.

  batch_shape: the leading dims of the layers' inputs, e.g. (B, T) for tokens [B, T]. output_grads: add the zero
  TapOutputGrad variables (for dY). Rematerialisation is turned off (`model.config.remat`): recorded values must
  not cross nnx.remat's trace, and a capture needs no memory savings.
  """
  if any(isinstance(module, Tap) for _, module in nnx.iter_modules(model)):
    raise ValueError("the model is already tapped; tap a fresh copy of it.")
  layers = _linear_layers(model)
  if getattr(getattr(model, "config", None), "remat", False):
    model.config = dataclasses.replace(model.config, remat=False)
  taps = {}
  for name, layer in layers.items():
    parent, attr = _parent_and_attr(model, name)
    taps[name] = Tap(layer, tuple(batch_shape), output_grad=output_grads)
    setattr(parent, attr, taps[name])
  return taps


def by_layer(state: Any) -> dict[str, jax.Array]:
  """{layer name: value} from an nnx state holding one kind of tap variable (e.g. nnx.state(model, TapInput))."""
  out = {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value() if hasattr(var, "get_value") else var.value
    out[".".join(map(str, path[:-1]))] = value
  return out


def check_calls(calls: dict[str, Any]) -> None:
  """ValueError unless every tapped layer ran exactly once ({layer name: TapCalls value}, e.g. by_layer's).

  A layer run twice would pair its last input with the sum of both output gradients; one never run, zeros."""
  bad = {name: int(n) for name, n in calls.items() if int(n) != 1}
  if bad:
    name, n = next(iter(bad.items()))
    others = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
    raise ValueError(f"tapped layer {name!r} ran {n} times in one forward{others}; a tap records one call's input: "
                     "capture a model that runs each linear layer exactly once.")


def check_key(model: nnx.Module, key: jax.Array | None) -> jax.Array:
  """`key`, or a placeholder key when no linear layer needs randomness (else ValueError).

  A tapped model's own key check cannot see its layers through the taps: run it before tapping, and pass the
  returned key (the placeholder is never used by layers that need no randomness).
  """
  if key is not None:
    return key
  needing = [name for name, layer in _linear_layers(model).items() if layer.recipe.needs_key]
  if needing:
    raise ValueError(f"key=None, but {len(needing)} linear layers (e.g. {needing[0]!r}) need randomness; pass key=.")
  return jax.random.key(0)


def capture_inputs(model: nnx.Module, tokens_BxT: jax.Array, key: jax.Array | None) -> dict[str, jax.Array]:
  """Runs `model` on tokens and returns each linear layer's input by layer name. Taps `model`: pass a copy.
  Outside jit, a layer that ran other than once is a ValueError (check_calls)."""
  key = check_key(model, key)
  taps = tap_linear_layers(model, tokens_BxT.shape)
  model(tokens_BxT, key=key)
  calls = {name: tap.calls[...] for name, tap in taps.items()}
  if not any(isinstance(n, jax.core.Tracer) for n in calls.values()):  # under jit (metrics) the counts are traced
    check_calls(calls)
  return {name: tap.x_in[...] for name, tap in taps.items()}
