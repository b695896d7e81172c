"""recipe backend='pallas': the custom_vjp rule on the Pallas kernels (interpret mode on CPU) equals the XLA path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax

DIMS = (((1,), (0,)), ((), ()))


@functools.partial(jax.jit, static_argnums=0)
def _fwd_bwd(recipe, x, w, g):
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DIMS, recipe=recipe, key=jax.random.key(3),
                                                   preferred_element_type=jnp.float32), x, w)
  return (y,) + vjp(g)


def test_pallas_backend_matches_xla():
  recipe = "nvfp4"  # SR on Dgrad/Wgrad, RHT fused into the Wgrad quantizer, 2D weight reused by Dgrad
  x = jax.random.normal(jax.random.key(0), (32, 64)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (64, 32)) * 0.1
  g = jax.random.normal(jax.random.key(2), (32, 32))
  ref = _fwd_bwd(fp4jax.recipes.get_recipe(recipe), x, w, g)
  with _no_warning():
    out = _fwd_bwd(fp4jax.recipes.get_recipe(f"{recipe}:backend=pallas"), x, w, g)
  for a, b in zip(out, ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_uncovered_operands_fall_back_with_a_warning():
  from fp4jax import backends
  backends._fallback.cache_clear()
  x = jnp.ones((32, 64), jnp.float32)
  cfg = fp4jax.recipes.mxfp4().fprop.lhs
  with pytest.warns(UserWarning, match="NVFP4-only.*XLA path"):
    assert backends.pallas_quantize(x, cfg, axis=1, recipe=fp4jax.recipes.mxfp4(), key=None, signs=None) is None


class _no_warning:
  def __enter__(self):
    import warnings
    self._cm = warnings.catch_warnings()
    self._cm.__enter__()
    warnings.simplefilter("error")

  def __exit__(self, *exc):
    return self._cm.__exit__(*exc)
