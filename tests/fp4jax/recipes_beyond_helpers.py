"""Shared helpers of the recipes-beyond tests (inputs and bit-level checks against the NumPy references)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax
import reference as ref

FOUR_SIX = fp4jax.NVFP4(scale_rule="4over6")
DN = (((1,), (0,)), ((), ()))  # x_MxK @ w_KxN


@functools.partial(jax.jit, static_argnames="recipe")  # one compilation, not op-by-op eager dispatch
def fwd_and_grads(x_MxK, w_KxN, g_MxN, key, recipe):
  """(y, dx, dw) of `fp4jax.dot_general(x, w)` under `recipe`, with output gradient `g`."""
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key), x_MxK, w_KxN)
  return (y,) + vjp(g_MxN)


def inputs(kind, seed=0, shape=(32, 64)):
  rng = np.random.default_rng(seed)
  if kind == "gauss":
    x = rng.standard_normal(shape)
  elif kind == "heavy":  # Student-t with 3 degrees of freedom, spread scales per row: outlier-heavy blocks
    x = rng.standard_t(3, shape) * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))
  elif kind == "zeros_mixed":  # whole zero blocks and a zero row among normal ones
    x = rng.standard_normal(shape)
    x[:, 16:32] = 0
    x[3] = 0
  else:
    raise ValueError(kind)
  return x.astype(np.float32)


def check(x, fmt, r, axis=-1, block_2d=False):
  q = fp4jax.quantize(jnp.asarray(x), fmt, axis=axis, block_2d=block_2d)
  codes = np.asarray(q.unpacked_codes())
  np.testing.assert_array_equal(codes, r["codes"])
  np.testing.assert_array_equal(np.asarray(q.scales, np.float64), r["scales"])
  if fmt.double_block:  # one amax per 1x128 group; the reference repeats it per block
    g = np.repeat(np.asarray(q.amax, np.float64), 8, axis=axis)
    np.testing.assert_array_equal(np.take(g, np.arange(r["scales"].shape[axis]), axis=axis), r["amax"])
  else:
    assert float(q.amax) == r["amax"]
  ref.assert_same_bits(fp4jax.dequantize(q), r["dequant"])
  ref.assert_same_bits(fp4jax.fake_quant(jnp.asarray(x), fmt, axis=axis, block_2d=block_2d), r["dequant"])


def sr_dequant(x, fmt, num_keys, seed):
  keys = jax.random.split(jax.random.key(seed), num_keys)
  f = jax.jit(jax.vmap(lambda k: fp4jax.fake_quant(jnp.asarray(x), fmt, rounding="stochastic", key=k)))
  return np.asarray(f(keys), np.float64)
