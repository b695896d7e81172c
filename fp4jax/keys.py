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
