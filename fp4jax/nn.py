"""Flax NNX layers whose GEMMs run through fp4jax.dot_general under a recipe.

Build new models with `fp4jax.nn.Linear`; quantize an existing NNX model (one you did not write) with
`fp4jax.quantize_model(model, rules, rngs=nnx.Rngs(quant=seed))`, which injects quantized GEMMs into its
nnx.Linear / LinearGeneral / Einsum layers by module path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax.dot_general import dot_general
from fp4jax import recipes as recipes_lib

default_kernel_init = nnx.initializers.lecun_normal()


class Linear(nnx.Module):
  """y = x W (+ b) with W [in_features, out_features] float32 and the GEMMs quantized by `recipe`.

  `recipe` is a plain (static) attribute: assign a new one to switch this layer's precision; a jitted model then
  recompiles once per distinct recipe. Randomness for stochastic rounding comes from the `key` argument, or else
  from the "quant" stream of the `rngs` the layer was built with.
  """

  def __init__(self, in_features: int, out_features: int, *, recipe: recipes_lib.Recipe | str | None = None,
               use_bias: bool = False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
               kernel_init=default_kernel_init, rngs: nnx.Rngs):
    self.in_features, self.out_features = in_features, out_features
    self.recipe = recipes_lib.get_recipe(recipe if recipe is not None else "bf16")
    self.dtype, self.param_dtype = dtype, param_dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else nnx.data(None)
    # Only an explicit "quant" stream: nnx.Rngs falls back to its default stream for unknown names.
    self.quant_rngs = rngs["quant"].fork() if "quant" in rngs else nnx.data(None)

  def __call__(self, x_xK, *, key=None):
    if x_xK.shape[-1] != self.in_features:
      raise ValueError(f"Linear expects inputs [..., {self.in_features}]; got shape {x_xK.shape}.")
    recipe = self.recipe
    if recipe.needs_key and key is None:
      if self.quant_rngs is None:
        raise ValueError(f"recipe {recipe.name!r} needs randomness: pass key= or build the layer with "
                         f"nnx.Rngs(params=..., quant=...).")
      key = self.quant_rngs()
    x_xK = x_xK.astype(self.dtype)
    # Quantized recipes quantize the float32 master weight directly, so the weight gradient stays float32.
    kernel = self.kernel[...] if recipe.is_quantized else self.kernel[...].astype(self.dtype)
    y = dot_general(x_xK, kernel, (((x_xK.ndim - 1,), (0,)), ((), ())), recipe=recipe, key=key,
                                    preferred_element_type=jnp.float32).astype(self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y
