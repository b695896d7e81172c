"""Flax Linen layer: `fp4jax.linen.Dense`, with stochastic-rounding keys from the "quant" RNG collection.

To quantize an existing Linen model (one you did not write), use `fp4jax.quantize_model(model, rules)`: its Dense
and DenseGeneral layers then run quantized GEMMs, picked by module path.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp4jax.dot_general import dot_general
from fp4jax import recipes as recipes_lib


class Dense(nn.Module):
  """y = x W (+ b) with W [in, features] and GEMMs quantized by `recipe`; SR keys from `self.make_rng("quant")`."""

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
    key = self.make_rng("quant") if recipe.needs_key else None
    x = x.astype(self.dtype)
    kernel = kernel if recipe.is_quantized else kernel.astype(self.dtype)
    y = dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), recipe=recipe, key=key,
                                    preferred_element_type=jnp.float32).astype(self.dtype)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(self.dtype)
    return y
