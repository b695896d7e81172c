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

Each derivation from a key (`fold_in`, the seed's two words) is a threefry evaluation that XLA compiles into a
small kernel of its own (five per layer of an nvfp4 training step, before they were batched). `fold_in_many` and
`seeds_from_keys` derive many at once, bit for bit what one call per key gives; a `HashSeed` carries a derived seed
to the quantizer in place of its key (what the custom_vjp rule passes, fp4jax.dot_general).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

SR_BITS = ("hash", "threefry")
_WEYL = np.uint32(0x9E3779B9)
_M1, _M2 = np.uint32(0x7FEB352D), np.uint32(0x846CA68B)


def check_sr_bits(sr_bits: str) -> None:
  """Raises ValueError unless `sr_bits` is one of SR_BITS."""
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


class HashSeed(NamedTuple):
  """The hash generator's seed, already derived from a key (`seed_from_key`): uint32 [2].

  Accepted wherever a quantizer takes `key` with sr_bits="hash" and gives the same bits as that key.
  """

  words: jax.Array


def check_hash_seed(seed: HashSeed, sr_bits: str, name: str = "key") -> HashSeed:
  """Returns `seed` if it holds uint32 [2] words and `sr_bits` is the hash generator's; else a ValueError naming
  `name`."""
  words = seed.words
  if getattr(words, "dtype", None) != jnp.uint32 or np.shape(words) != (2,):
    raise ValueError(f"{name}: a HashSeed holds uint32 words of shape (2,); got {getattr(words, 'dtype', '?')} "
                     f"{np.shape(words)}.")
  if sr_bits != "hash":
    raise ValueError(f"{name}: a HashSeed seeds the hash generator only; sr_bits={sr_bits!r} needs the PRNG key "
                     "itself.")
  return seed


def batches_exactly(key) -> bool:
  """Whether draws vmapped over keys give each key's own bits: threefry's do (elementwise in key and counter);
  rbg's bit generator does not, so its derivations are made one key at a time."""
  return str(jax.random.key_impl(key)) == "threefry2x32"


def fold_in_many(key, data: Sequence[int]) -> jax.Array:
  """Keys [len(data)]: `jax.random.fold_in(key, d)` for each d, bit for bit; one batched threefry evaluation."""
  data = [int(d) for d in data]
  if not batches_exactly(key):
    return jnp.stack([jax.random.fold_in(key, d) for d in data])
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(data, jnp.uint32))


def seeds_from_keys(keys_N) -> jax.Array:
  """uint32 [N, 2]: `seed_from_key` of each of N keys, bit for bit; one batched threefry evaluation."""
  if not batches_exactly(keys_N):
    return jnp.stack([seed_from_key(keys_N[i]) for i in range(keys_N.shape[0])])
  return jax.vmap(seed_from_key)(keys_N)


def check_index_range(shape) -> None:
  """ValueError unless every element of an array of `shape` has a uint32 row-major index (the hash's counter)."""
  size = int(np.prod(shape, dtype=np.int64))
  if size > 2**32:
    raise ValueError(f"the hash generator indexes elements with 32 bits; a tensor of shape {tuple(shape)} has "
                     f"{size} elements. Use sr_bits='threefry', or split the tensor.")


def element_index(shape) -> jax.Array:
  """uint32 row-major index of every element of an array of `shape` (an iota XLA fuses into its consumer)."""
  check_index_range(shape)
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
  """uint32 random bits of `shape` from `key`: the counter-based hash (default) or threefry's jax.random.bits.

  `key` may be a HashSeed derived from a key (sr_bits "hash" only): the same bits as that key.
  """
  check_sr_bits(sr_bits)
  shape = tuple(shape)
  if sr_bits == "threefry" and not isinstance(key, HashSeed):
    return jax.random.bits(key, shape, jnp.uint32)
  return hash_bits(hash_seed(key, sr_bits), element_index(shape))


def hash_seed(key, sr_bits: str = "hash") -> jax.Array:
  """The hash generator's uint32 [2] seed for `key`: a HashSeed's own words (checked), else drawn from the key."""
  if isinstance(key, HashSeed):
    return check_hash_seed(key, sr_bits).words
  return seed_from_key(key)
