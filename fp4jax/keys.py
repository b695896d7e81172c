"""PRNG key validation: a wrong key (an int seed, a float array) fails with a ValueError naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import prng


def _raw_key_words() -> int:
  """Words of raw uint32 key data under the configured PRNG: threefry (the default) 2, rbg / unsafe_rbg 4."""
  return 4 if jax.config.jax_default_prng_impl in ("rbg", "unsafe_rbg") else 2


def is_key(key) -> bool:
  """Whether `key` is one JAX PRNG key: a typed key (jax.random.key) or raw uint32 data (jax.random.PRNGKey) of
  the configured PRNG implementation's width (other widths would fail later, inside jax.random)."""
  if not isinstance(key, (jax.Array, np.ndarray)):
    return False
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.shape == ()
  return key.dtype == jnp.uint32 and key.shape == (_raw_key_words(),)


def _impl_name(key) -> str:
  """The PRNG implementation of `key`: a typed key's own, the configured default for raw key data."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return str(jax.random.key_impl(key))
  return jax.config.jax_default_prng_impl


def check_layer_stream_key(key, name: str = "key"):
  """`check_key`, refusing keys of the "unsafe_rbg" implementation for a layer's key (fp4jax.dot_general).

  A layer's key is a chain of fold_ins over (step, layer, GEMM tag) (the trainer's, the Flax layers' rng streams,
  dot_general's tags). unsafe_rbg's fold_in(k, d) is k XOR g(d): the chain would not depend on the order of its
  values and equal values would cancel, giving two layers the same stochastic-rounding bits at every step.
  """
  check_key(key, name)
  if _impl_name(key) == "unsafe_rbg":
    raise ValueError(f"{name}: keys of the unsafe_rbg PRNG cannot derive fp4jax's per-layer streams (its fold_in is "
                     "a XOR, so streams folded in another order or twice coincide and layers would share "
                     "stochastic-rounding bits); use the default threefry2x32 or rbg (jax_default_prng_impl, or "
                     "jax.random.key(seed, impl='rbg')).")
  return key


def check_key(key, name: str = "key"):
  """Returns `key` if it is one PRNG key, else raises a ValueError naming the argument `name`."""
  if is_key(key):
    return key
  if isinstance(key, (jax.Array, np.ndarray)):
    what = f"{type(key).__name__} with dtype {key.dtype} and shape {key.shape}"
    if key.dtype == jnp.uint32 and key.ndim == 1:
      what += f" (raw key data of the configured {jax.config.jax_default_prng_impl} PRNG has {_raw_key_words()} words)"
  elif isinstance(key, (bool, int, float, str, np.generic)):
    what = f"{type(key).__name__} {key!r}"
  else:
    what = f"a {type(key).__name__}"
    if type(key).__name__ == "LayerKeys":
      what += " (a layer's keys for fp4jax.dot_general; here pass the key they were derived from)"
  raise ValueError(f"{name} must be one JAX PRNG key such as jax.random.key(seed), not a seed or a batch of keys; "
                   f"got {what}.")


def is_typed_key(key) -> bool:
  """Whether `key` is a typed key array (jax.random.key), of any shape, rather than raw uint32 key data."""
  return jax.dtypes.issubdtype(jnp.result_type(key), jax.dtypes.prng_key)


def check_key_or_hash_seed(key, sr_bits: str, name: str = "key"):
  """Like check_key, but also accepts a prng.HashSeed (uint32 [2]) where the quantizer uses the hash generator."""
  if isinstance(key, prng.HashSeed):
    return prng.check_hash_seed(key, sr_bits, name)
  return check_key(key, name)
