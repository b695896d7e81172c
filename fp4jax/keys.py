"""PRNG key validation: a wrong key (an int seed, a float array) fails with a ValueError naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import prng

# Raw uint32 key data: threefry (the default) is 2 words, rbg / unsafe_rbg are 4.
_RAW_KEY_WORDS = (2, 4)


def is_key(key) -> bool:
  """Whether `key` is one JAX PRNG key: a typed key (jax.random.key) or raw uint32 data (jax.random.PRNGKey)."""
  if not isinstance(key, (jax.Array, np.ndarray)):
    return False
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.shape == ()
  return key.dtype == jnp.uint32 and key.shape in {(w,) for w in _RAW_KEY_WORDS}


def check_key(key, name: str = "key"):
  """Returns `key` if it is one PRNG key, else raises a ValueError naming the argument `name`."""
  if is_key(key):
    return key
  what = f"{type(key).__name__} {key!r}" if np.ndim(key) == 0 and not hasattr(key, "dtype") else (
      f"{type(key).__name__} with dtype {getattr(key, 'dtype', '?')} and shape {np.shape(key)}")
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
