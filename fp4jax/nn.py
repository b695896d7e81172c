"""Flax NNX layers whose GEMMs run through fp4jax.dot_general under a recipe.

Build new models with `fp4jax.nn.Linear`; quantize an existing NNX model (one you did not write) with
`fp4jax.quantize_model(model, rules, rngs=nnx.Rngs(quant=seed))`, which injects quantized GEMMs into its
nnx.Linear / LinearGeneral / Einsum layers by module path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp4jax.dot_general import cast_output
from fp4jax.dot_general import check_layer_shape
from fp4jax.dot_general import dot_general
from fp4jax import contraction
from fp4jax import gemm
from fp4jax import model_quantize
from fp4jax import outcontrol
from fp4jax import recipes as recipes_lib

default_kernel_init = nnx.initializers.lecun_normal()


class Linear(nnx.Module):
  """y = x W (+ b) with W [in_features, out_features] float32 and the GEMMs quantized by `recipe`.

  `recipe` is a plain (static) attribute: assign a new one to switch this layer's precision; a jitted model then
  recompiles once per distinct recipe. Randomness for stochastic rounding comes from the `key` argument, or else
  from the "quant" stream of the `rngs` the layer was built with.
  OutControl (fp4jax.outcontrol; set by the training step): `outliers` (int array [k] or None) are input channels
  run in MXFP8; with `record_inputs` each call sows its input's per-channel sum of squares as the nnx.Intermediate
  "x_sq_norms". A call's `out_sharding` is the output's sharding, as for nnx.Linear.
  """

  def __init__(self, in_features: int, out_features: int, *, recipe: recipes_lib.Recipe | str | None = None,
               use_bias: bool = False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
               kernel_init=default_kernel_init, rngs: nnx.Rngs):
    self.in_features, self.out_features = in_features, out_features
    self.recipe = recipes_lib.get_recipe(recipe if recipe is not None else "bf16")
    try:  # at construction, not at the first call: a model with a layer its recipe cannot run fails where it is built
      check_layer_shape(in_features, out_features, self.recipe)
    except ValueError as e:
      raise ValueError(f"{self._label()}: {e}") from None
    self.dtype, self.param_dtype = dtype, param_dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    # The bias draws a params key it does not need, as nnx.Linear's bias_init does, so that later layers built from
    # the same nnx.Rngs initialise as in a model of nnx.Linear layers.
    self.bias = nnx.Param(nnx.initializers.zeros(rngs.params(), (out_features,), param_dtype)) if use_bias \
        else nnx.data(None)
    # Only an explicit "quant" stream: nnx.Rngs falls back to its default stream for unknown names.
    self.quant_rngs = rngs["quant"].fork() if "quant" in rngs else nnx.data(None)
    self.outliers = nnx.data(None)
    self.record_inputs = False

  def _label(self, recipe=None) -> str:
    recipe = recipe if recipe is not None else self.recipe
    name = recipes_lib.get_recipe(recipe).name
    return f"fp4jax.nn.Linear({self.in_features}, {self.out_features}, recipe={name!r})"

  def __call__(self, x_xK, *, key=None, out_sharding=None):
    if x_xK.shape[-1] != self.in_features:
      raise ValueError(f"Linear expects inputs [..., {self.in_features}]; got shape {x_xK.shape}.")
    recipe = recipes_lib.get_recipe(self.recipe)  # a name assigned after construction works too
    if recipe.needs_key and key is None:
      if self.quant_rngs is None:
        raise ValueError(f"recipe {recipe.name!r} needs randomness: pass key= or build the layer with "
                         f"nnx.Rngs(params=..., quant=...).")
      key = self.quant_rngs()
    # dtype=None (Flax's "infer"): the promoted input and parameter dtype, as nnx.Linear; x.astype(None) is float32.
    dtype = self.dtype if self.dtype is not None else jnp.result_type(x_xK.dtype, self.kernel.dtype)
    x_xK = x_xK.astype(dtype)
    if self.record_inputs:
      self.sow(nnx.Intermediate, "x_sq_norms", outcontrol.channel_sq_norms(x_xK))
    # Quantized recipes quantize the float32 master weight directly, so the weight gradient stays float32.
    kernel = self.kernel[...] if recipe.is_quantized else self.kernel[...].astype(dtype)
    dims = (((x_xK.ndim - 1,), (0,)), ((), ()))
    try:  # the error names this layer: a model has many
      if self.outliers is not None and recipe.is_quantized:  # a layer in BF16 (the late switch) ignores them
        y = outcontrol.dot_general(x_xK, kernel, dims, recipe=recipe, key=key, preferred_element_type=jnp.float32,
                                   outliers=self.outliers, out_sharding=out_sharding)
      else:
        out_dtype = jnp.float32 if recipe.is_quantized else gemm.unquantized_output_dtype(recipe, dtype)
        y = dot_general(x_xK, kernel, dims, recipe=recipe, key=key, preferred_element_type=out_dtype,
                        out_sharding=out_sharding)
    except ValueError as e:
      raise ValueError(f"{self._label(recipe)}: {e}") from None
    # cast_output: its transpose hands the backward rule dY as the bfloat16 values it is (see its docstring).
    y = cast_output(y, jnp.dtype(dtype)) if recipe.is_quantized else y.astype(dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y


# --- quantize_model: inject quantized GEMMs into an existing model's layers ----------------------------------------

class QuantizedDotGeneral(nnx.Module):
  """A `dot_general` for a flax layer that runs `recipe`, with a fresh key per call from its own "quant" stream.

  A Module (not a function) so the stream is part of the model: nnx.jit / nnx.grad carry its state and every call
  advances it. quantize_model stores one as the layer's `dot_general` attribute.
  """

  def __init__(self, recipe: recipes_lib.Recipe, path: str, quant_rngs=None, original=None):
    self.recipe, self.path = recipe, path
    self.original = original  # what the layer had before, restored by an unquantized rule
    # Kept while a recipe without SR runs (it draws nothing), so a later SR recipe continues the stream.
    self.quant_rngs = quant_rngs if quant_rngs is not None else nnx.data(None)

  def _key(self):
    return self.quant_rngs() if self.recipe.needs_key else None

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
               out_sharding=None):
    return contraction.linear_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                          recipe=self.recipe, key=self._key(), where=self.path,
                                          out_sharding=out_sharding)


class QuantizedEinsum(QuantizedDotGeneral):
  """An `einsum_op` for nnx.Einsum: a linear-layer equation as one quantized GEMM (others refused, naming the layer)."""

  def __call__(self, equation, lhs, rhs, precision=None, preferred_element_type=None, *, out_sharding=None):
    return contraction.linear_einsum(equation, lhs, rhs, precision, preferred_element_type, recipe=self.recipe,
                                     key=self._key(), where=self.path, out_sharding=out_sharding)


def _check_layer(module, path: str) -> None:
  """Raises ValueError, naming the layer, if quantize_model cannot quantize it (not a linear layer's contraction, or
  a dot_general the user already customised)."""
  if isinstance(module, nnx.Einsum):
    if not (module.einsum_op is jnp.einsum or isinstance(module.einsum_op, QuantizedEinsum)):
      raise ValueError(f"{path}: this nnx.Einsum already has a custom einsum_op; quantize_model will not replace it.")
    if module.einsum_str is not None:
      equation = module.einsum_str.replace(" ", "")
      lhs_ndim = len(equation.split(",")[0].replace("...", ""))
      try:
        contraction.einsum_as_dot_general(equation, lhs_ndim, len(module.kernel_shape))  # one layer's, unstacked
      except ValueError as e:
        raise ValueError(f"{path} (nnx.Einsum): {e} Keep it out of the quantized rules (a None rule).") from None
    return
  if isinstance(module, nnx.LinearGeneral):
    if module.batch_axis:
      raise ValueError(f"{path}: nnx.LinearGeneral with batch_axis={dict(module.batch_axis)} is a batched "
                       f"contraction, not a linear layer; keep it out of the quantized rules (a None rule).")
    if module.dot_general_cls is not None:
      raise ValueError(f"{path}: this nnx.LinearGeneral has a dot_general_cls; quantize_model will not replace it.")
  if not (module.dot_general in (None, jax.lax.dot_general) or isinstance(module.dot_general, QuantizedDotGeneral)):
    raise ValueError(f"{path}: this {type(module).__name__} already has a custom dot_general; quantize_model will "
                     f"not replace it.")


def _stack_shape(module) -> tuple[int, ...]:
  """The leading axes of a layer stacked by nnx.vmap (a kernel of more axes than the layer's features give)."""
  if isinstance(module, nnx.Linear):
    own = 2
  elif isinstance(module, nnx.LinearGeneral):
    own = len(module.in_features) + len(module.out_features)
  else:  # Einsum: kernel_shape is one layer's (nnx.vmap stacks the kernel, not the attribute)
    own = len(module.kernel_shape)
  return tuple(module.kernel.shape[:module.kernel.ndim - own])


def _stream_id(stream) -> bytes:
  """A stream's base key, as bytes: two streams with one base key draw the same keys."""
  return np.asarray(jax.random.key_data(stream.key[...])).tobytes()


def _quant_stream(rngs: nnx.Rngs, stack_shape: tuple[int, ...], taken: set[bytes]):
  """A "quant" stream of its own for one layer; one key per layer of a stacked layer, so that nnx.scan over the
  stack hands each layer its own stream (and independent stochastic rounding). Forks past the base keys in `taken`
  (the streams layers kept from an earlier call, whose forks the same seed would make again), and adds its own."""
  while True:
    stream = rngs["quant"].fork() if not stack_shape else rngs["quant"].split(stack_shape)
    if _stream_id(stream) not in taken:
      taken.add(_stream_id(stream))
      return stream


def _stream_of(module):
  """The "quant" stream an earlier quantize_model call gave `module`, or None."""
  op = getattr(module, "einsum_op" if isinstance(module, nnx.Einsum) else "dot_general")
  return op.quant_rngs if isinstance(op, QuantizedDotGeneral) else None


def _layer_shape(module) -> tuple[int, int] | None:
  """(K, N) of a Linear / LinearGeneral layer's GEMM; None for Einsum (known only from its equation at call time)."""
  if isinstance(module, nnx.Linear):
    return module.in_features, module.out_features
  if isinstance(module, nnx.LinearGeneral):
    return math.prod(module.in_features), math.prod(module.out_features)
  return None


def quantize_model(model: nnx.Module, rules, *, rngs: nnx.Rngs | int | None = None) -> model_quantize.Report:
  """Runs the GEMMs of `model`'s nnx.Linear / LinearGeneral / Einsum layers under recipes chosen by path rules.

  fp4jax.nn.Linear layers carry their own `recipe` attribute: a quantizing rule that matches one is refused (set
  its recipe instead); an unquantized rule leaves them as they are. The report lists them with their own recipe.

  Args:
    model: any NNX model; edited in place (each quantized layer's `dot_general` / `einsum_op` becomes a
      QuantizedDotGeneral / QuantizedEinsum holding its own "quant" stream). Parameters are untouched.
    rules: ordered (regex, recipe) pairs, first full match of the layer path ("blocks.0.attn.query") wins; a recipe
      of None or "bf16" restores the layer's own computation. Layers no rule matches run their own computation too
      (a layer quantized by an earlier call is restored: each call sets every layer). A layer that an earlier call
      quantized with a stream and this one quantizes again keeps that stream, so its keys continue (they do not
      restart at the seed), also through a phase whose recipe draws no key (fp8, no SR), where it stays in the
      layer's state; restore it first (a None rule) to reseed it.
    rngs: nnx.Rngs with a "quant" stream (or an int seed for one), needed when a recipe uses stochastic rounding.

  The streams are model state (`nnx.RngKey` / `nnx.RngCount` under each quantized layer's `dot_general` or
  `einsum_op`), not parameters: a checkpoint of `nnx.state(model)` holds them and restores into a model quantized
  the same way; to restore into the plain model, save or restore `nnx.state(model, nnx.Param)`. Under `nnx.scan`
  with a layer broadcast (`in_axes=None`), NNX hands every step the stream as it was and discards the advance, so
  every call and step would draw the same key (as it does for nnx.Dropout): pass the model as `nnx.Carry`, or
  pass keys yourself.

  Returns:
    A Report (print it) of which layer matched which rule and which rules matched nothing.
  """
  rules = model_quantize.compile_rules(rules)
  if rngs is not None and not isinstance(rngs, nnx.Rngs):
    rngs = nnx.Rngs(quant=rngs)  # a seed or a key
  layers, plan, own_recipe = [], [], []
  for parts, module in nnx.iter_modules(model):
    if isinstance(module, Linear):  # fp4jax's own layer: its recipe is an attribute, not an injected dot_general
      path = model_quantize.path_name(parts)
      i = model_quantize.first_match(rules, path)
      if i is not None and rules[i].quantizes:
        own_recipe.append(model_quantize.shown(path))
      layers.append(model_quantize.Layer(path, "fp4jax Linear", i, recipes_lib.get_recipe(module.recipe)))
      continue
    if not isinstance(module, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)):
      continue
    path = model_quantize.path_name(parts)
    i = model_quantize.first_match(rules, path)
    layers.append(model_quantize.Layer(path, type(module).__name__, i))
    plan.append((module, path, rules[i] if i is not None else None))
  if own_recipe:
    raise ValueError(f"quantize_model: a rule quantizes {own_recipe[:3]}{'...' if len(own_recipe) > 3 else ''}, "
                     "which are fp4jax.nn.Linear layers: they run their own `recipe` attribute (set it, e.g. "
                     "layer.recipe = fp4jax.recipes.nvfp4()); quantize_model edits flax's nnx.Linear / "
                     "LinearGeneral / Einsum layers. Narrow the rules so they match none of them.")
  needs_key = [model_quantize.shown(path) for module, path, rule in plan
               if rule is not None and rule.quantizes and rule.recipe.needs_key and _stream_of(module) is None]
  if needs_key and (rngs is None or "quant" not in rngs):
    raise ValueError(f"the recipes of {needs_key[:3]}{'...' if len(needs_key) > 3 else ''} use stochastic rounding: "
                     f"pass rngs=nnx.Rngs(quant=seed) (or rngs=seed) so each call draws a fresh key.")
  for module, path, rule in plan:  # check every layer before editing any
    if rule is not None and rule.quantizes:
      path = model_quantize.shown(path)
      _check_layer(module, path)
      shape = _layer_shape(module)
      if shape is not None:
        try:
          check_layer_shape(*shape, rule.recipe)
        except ValueError as e:
          raise ValueError(f"{path} ({type(module).__name__}): {e}") from None
  # A second call with the same seed forks the first call's streams again: a new layer skips those that layers keep.
  taken = {_stream_id(_stream_of(module)) for module, _, rule in plan
           if rule is not None and rule.quantizes and _stream_of(module) is not None}
  for module, path, rule in plan:
    attr = "einsum_op" if isinstance(module, nnx.Einsum) else "dot_general"
    original = getattr(module, attr)
    if isinstance(original, QuantizedDotGeneral):  # quantized by an earlier call
      original = original.original
    if rule is None or not rule.quantizes:
      if original is not getattr(module, attr):
        setattr(module, attr, nnx.static(original))
      continue
    op = QuantizedEinsum if attr == "einsum_op" else QuantizedDotGeneral
    # A layer quantized by an earlier call keeps its stream: a late switch continues its keys instead of replaying
    # them from the seed (restore the layer with a None rule first to reseed it).
    kept = _stream_of(module)
    stream = kept if kept is not None else (
        _quant_stream(rngs, _stack_shape(module), taken) if rule.recipe.needs_key else None)
    setattr(module, attr, nnx.data(op(rule.recipe, model_quantize.shown(path), stream, original)))
  return model_quantize.Report(rules, tuple(layers))
