"""Flax Linen layer: `fp4jax.linen.Dense`, with stochastic-rounding keys from the "quant" RNG collection.

To quantize an existing Linen model (one you did not write), use `fp4jax.quantize_model(model, rules)`: its Dense
and DenseGeneral layers then run quantized GEMMs, picked by module path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from flax import errors as flax_errors
import flax.linen as nn
import jax.numpy as jnp

from fp4jax.dot_general import cast_output
from fp4jax.dot_general import dot_general
from fp4jax import contraction
from fp4jax import gemm
from fp4jax import model_quantize
from fp4jax import recipes as recipes_lib


class Dense(nn.Module):
  """y = x W (+ b) with W [in, features] and GEMMs quantized by `recipe`; SR keys from `self.make_rng("quant")`.

  Defaults differ from nn.Dense's, as fp4jax.nn.Linear's from nnx.Linear's: no bias, bfloat16 compute (dtype=None
  infers it as nn.Dense does), recipe None = "bf16". nn.Dense's precision, bias_init, dot_general and
  preferred_element_type are not taken: the recipe decides the GEMM. Errors name the layer's scope path.
  """

  features: int
  recipe: Any = None
  use_bias: bool = False
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    recipe = recipes_lib.get_recipe(self.recipe if self.recipe is not None else "bf16")
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
    key = _quant_key(self, recipe, self.name or "Dense") if recipe.needs_key else None
    # dtype=None (Flax's "infer"): the promoted input and parameter dtype, as nn.Dense; x.astype(None) is float32.
    dtype = self.dtype if self.dtype is not None else jnp.result_type(x.dtype, kernel.dtype)
    x = x.astype(dtype)
    kernel = kernel if recipe.is_quantized else kernel.astype(dtype)
    out_dtype = jnp.float32 if recipe.is_quantized else gemm.unquantized_output_dtype(recipe, dtype)
    try:  # the error names this layer: a model has many
      y = dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), recipe=recipe, key=key,
                      preferred_element_type=out_dtype)
    except ValueError as e:
      where = ".".join(map(str, self.scope.path)) or self.name or "Dense"
      raise ValueError(f"fp4jax.linen.Dense {where!r} ({x.shape[-1]} -> {self.features}, recipe "
                       f"{recipe.name!r}): {e}") from None
    # cast_output: its transpose hands the backward rule dY as the bfloat16 values it is (see its docstring).
    y = cast_output(y, jnp.dtype(dtype)) if recipe.is_quantized else y.astype(dtype)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(dtype)
    return y


# --- quantize_model: quantized GEMMs in an existing model's Dense / DenseGeneral layers -----------------------------

@dataclasses.dataclass(frozen=True)
class QuantizedModel:
  """A Linen model whose Dense / DenseGeneral layers run quantized GEMMs, chosen by path rules.

  Use its `init` / `apply` in place of the model's (same arguments, same variables: parameters do not change).
  `apply` needs `rngs={"quant": key}` when a recipe uses stochastic rounding: each layer call draws
  `make_rng("quant")`, fresh per layer and per call (pass a new key each step). `init` runs the layers unquantized
  (parameters do not depend on the recipe). Layers are found as they are traced, via `nn.intercept_methods`, so
  `report` lists the layers seen by the calls so far.
  """

  module: nn.Module
  rules: tuple[model_quantize.Rule, ...]
  _seen: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # path -> Layer, as traced

  def init(self, *args, **kwargs):
    """`module.init` (same arguments and variables; the layers run unquantized, parameters do not depend on it)."""
    with nn.intercept_methods(self._intercept):
      return self.module.init(*args, **kwargs)

  def apply(self, *args, **kwargs):
    """`module.apply` with the matched Dense / DenseGeneral layers quantized (add rngs={"quant": key} for SR)."""
    with nn.intercept_methods(self._intercept):
      return self.module.apply(*args, **kwargs)

  @property
  def report(self) -> model_quantize.Report:
    """Which traced layers matched which rule (print it); layers not yet traced by `init` / `apply` are missing."""
    return model_quantize.Report(self.rules, tuple(self._seen[p] for p in sorted(self._seen)))

  def _intercept(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(module, Dense):  # fp4jax's own: its recipe is a field
      path = model_quantize.path_name(module.scope.path)
      i = model_quantize.first_match(self.rules, path)
      if i is not None and self.rules[i].quantizes:
        raise ValueError(f"quantize_model: a rule quantizes {model_quantize.shown(path)!r}, an fp4jax.linen.Dense: "
                         "it runs its own `recipe` field (set it, Dense(..., recipe=...)); quantize_model edits "
                         "flax's nn.Dense / DenseGeneral layers. Narrow the rules so they match none of them.")
      own = recipes_lib.get_recipe(module.recipe if module.recipe is not None else "bf16")
      self._seen[path] = model_quantize.Layer(path, "fp4jax Dense", i, own)
    if context.method_name == "__call__" and isinstance(module, nn.Einsum):  # calls jnp.einsum: nothing to replace
      path = model_quantize.path_name(module.scope.path)
      i = model_quantize.first_match(self.rules, path)
      if i is not None and self.rules[i].quantizes:
        raise ValueError(f"quantize_model: a rule quantizes {model_quantize.shown(path)!r}, a Linen nn.Einsum, which "
                         "has no dot_general to replace, so it would run unquantized. Narrow the rules (or put "
                         f"({path!r}, None) first), or use nn.DenseGeneral or NNX's nnx.Einsum, which it quantizes.")
    if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral)):
      return next_fun(*args, **kwargs)
    path = model_quantize.path_name(module.scope.path)
    i = model_quantize.first_match(self.rules, path)
    self._seen[path] = model_quantize.Layer(path, type(module).__name__, i)
    rule = self.rules[i] if i is not None else None
    if rule is None or not rule.quantizes or module.is_initializing():
      return next_fun(*args, **kwargs)
    if _is_ours(module.dot_general):  # a subclass's super().__call__: this call already set it and drew its key
      return next_fun(*args, **kwargs)
    if module.dot_general is not None or module.dot_general_cls is not None:
      raise ValueError(f"{model_quantize.shown(path)}: this {type(module).__name__} already has a custom "
                       "dot_general; quantize_model will not replace it.")
    key = _quant_key(module, rule.recipe, model_quantize.shown(path)) if rule.recipe.needs_key else None
    # Linen modules are frozen dataclasses: set the field for this call only (the module is this apply's own).
    object.__setattr__(module, "dot_general", functools.partial(
        contraction.linear_dot_general, recipe=rule.recipe, key=key, where=model_quantize.shown(path)))
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "dot_general", None)


def _quant_key(module: nn.Module, recipe, where: str):
  """module.make_rng("quant"), or a ValueError saying how to pass the key (Flax's own error names no fix)."""
  try:
    return module.make_rng("quant")
  except flax_errors.InvalidRngError as e:  # not has_rng(): in nn.scan with "quant" unsplit it is False, yet this works
    raise ValueError(f"{where}: recipe {recipe.name!r} needs randomness (stochastic rounding or random RHT signs): "
                     "pass a new key every step, model.apply(variables, x, rngs={'quant': key}); inside nn.scan, "
                     "list 'quant' in split_rngs.") from e


def _is_ours(dot_general) -> bool:
  return isinstance(dot_general, functools.partial) and dot_general.func is contraction.linear_dot_general


def quantize_model(model: nn.Module, rules, *, rngs=None) -> QuantizedModel:
  """`model` with the GEMMs of its Dense / DenseGeneral layers quantized by ordered (regex, recipe) path rules.

  Paths are the layers' scope names joined by dots ("Block_0.Dense_1"); the first fully matching rule wins; a None
  or "bf16" recipe leaves a layer alone. fp4jax.linen.Dense layers run their own `recipe` field: a quantizing rule
  that matches one is refused when the model runs. DenseGeneral with batch_dims is refused when a quantized rule
  matches it, and so is Linen's nn.Einsum (it calls jnp.einsum, with no dot_general to replace).
  `rngs` is NNX's argument, refused here: Linen takes the SR keys per step, `apply(..., rngs={"quant": key})`.
  """
  if not isinstance(model, nn.Module):
    raise ValueError(f"fp4jax.linen.quantize_model expects a flax.linen.Module; got {type(model).__name__}.")
  if rngs is not None:  # a key given once here would be every step's key
    raise ValueError("quantize_model of a Linen model takes no rngs: pass a new key to every step, "
                     "qmodel.apply(variables, x, rngs={'quant': key}).")
  return QuantizedModel(model, model_quantize.compile_rules(rules))
