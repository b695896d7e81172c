"""Random bits for stochastic rounding: a counter-based hash of (seed, global element index), or JAX's threefry.

"hash" (the default) derives a 64-bit seed from the JAX key once per call (two threefry words) and maps every element's
row-major index in the whole (global, padded) tensor through a keyed integer mixer. The bits depend only on the key and
the element's position, so they are the same however the tensor is sharded, and the index is an iota that XLA fuses
into the quantizer's elementwise loop: no random tensor is written or read. The mixer is two keyed rounds of a
32-bit avalanche finalizer (multiply by odd constants, xor-shifts; the "lowbias32" constants found by C. Wellons'
hash-prospector search), with the index first spread by a Weyl step (the golden-ratio increment of SplitMix):

  h = fmix(i * 0x9E3779B9 + seed0);  h = fmix(h ^ seed1)

Each fmix is a bijection of the 32-bit words, so for a fixed seed distinct indices (below 2^32) get distinct words.
tests/fp4jax/test_stochastic_rounding.py checks per-bit frequencies, byte histograms, correlations between
neighbouring elements and between nearby keys, and the unbiasedness of stochastic rounding built on these bits.

"threefry" is `jax.random.bits(key, shape, uint32)` (partitionable threefry): the reference generator, ~10x slower
on CPU because it is a 20-round block cipher evaluated per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SR_BITS = ("hash", "threefry")
_WEYL = np.uint32(0x9E3779B9)
_M1, _M2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)


def check_sr_bits(sr_bits: str) -> None:
  if sr_bits not in SR_BITS:
    raise ValueError(f"sr_bits must be one of {SR_BITS}; got {sr_bits!r}.")


def _shr(x, n):
  return jax.lax.shift_right_logical(x, jnp.uint32(n))


def fmix(x):
  """A 32-bit avalanche finalizer (bijective on uint32): xor-shift, multiply, xor-shift, multiply, xor-shift."""
  x = x ^ _shr(x, 16)
  x = x * _M1
  x = x ^ _shr(x, 15)
  x = x * _M2
  return x ^ _shr(x, 16)


def seed_from_key(key) -> jax.Array:
  """The hash generator's seed: two uint32 words drawn from `key` with threefry (one tiny draw per call)."""
  return jax.random.bits(key, (2,), jnp.uint32)


def element_index(shape) -> jax.Array:
  """uint32 row-major index of every element of an array of `shape` (an iota XLA fuses into its consumer)."""
  size = int(np.prod(shape, dtype=np.int64))
  if size > 2**32:
    raise ValueError(f"the hash generator indexes elements with 32 bits; a tensor of shape {tuple(shape)} has "
                     f"{size} elements. Use sr_bits='threefry', or split the tensor.")
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for d in reversed(range(len(shape))):
    term = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    idx = idx + (term * np.uint32(stride) if stride != 1 else term)
    stride *= shape[d]
  return idx


def hash_bits(seed, index):
  """uint32 bits of elements with uint32 `index` under the uint32[2] `seed`."""
  h = fmix(index * _WEYL + seed[0])
  return fmix(h ^ seed[1])


def random_bits(key, shape, sr_bits: str = "hash") -> jax.Array:
  """uint32 random bits of `shape` from `key`: the counter-based hash (default) or threefry's jax.random.bits."""
  check_sr_bits(sr_bits)
  shape = tuple(shape)
  if sr_bits == "threefry":
    return jax.random.bits(key, shape, jnp.uint32)
  return hash_bits(seed_from_key(key), element_index(shape))
