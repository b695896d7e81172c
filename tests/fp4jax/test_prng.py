"""The counter-based stochastic-rounding generator (fp4jax.prng): uniform bits, independent neighbours and keys.

Every statistic uses fixed keys and a 5-sigma bound (chi-square statistics: mean + 5 standard deviations of the
chi-square distribution, df + 5 sqrt(2 df)), so a failure means a real defect, not bad luck (p ~ 3e-7 per check).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import prng
import compiled_hlo

SHAPE = (1024, 1024)  # 2^20 words per draw
N = SHAPE[0] * SHAPE[1]


def _bits(key, shape=SHAPE, sr_bits="hash"):
  return np.asarray(jax.jit(prng.random_bits, static_argnums=(1, 2))(key, shape, sr_bits))


def _chi2_bound(df):
  return df + 5 * np.sqrt(2 * df)


def _chi2_uniform(values, bins):
  counts = np.bincount(values.ravel(), minlength=bins)
  expected = values.size / bins
  return np.sum((counts - expected)**2) / expected


def _uniform01(words):
  return words.astype(np.float64) / 2.0**32


def test_element_index_is_the_row_major_position():
  for shape in ((7,), (3, 5), (2, 3, 4), (16, 1, 8)):
    np.testing.assert_array_equal(np.asarray(prng.element_index(shape)), np.arange(np.prod(shape)).reshape(shape))


def test_too_many_elements_for_a_32_bit_index_raises():
  with pytest.raises(ValueError, match="32 bits"):
    prng.element_index((2**16, 2**16 + 1))


def test_unknown_generator_raises():
  with pytest.raises(ValueError, match="sr_bits"):
    prng.random_bits(jax.random.key(0), (4,), "philox")


def test_threefry_option_is_jax_random_bits():
  key = jax.random.key(3)
  np.testing.assert_array_equal(_bits(key, (64, 32), "threefry"), np.asarray(jax.random.bits(key, (64, 32))))


def test_hash_is_the_documented_function_of_seed_and_index():
  """A NumPy re-implementation of h = fmix(fmix(i * 0x9E3779B9 + seed0) ^ seed1) gives the same words."""
  key = jax.random.key(11)
  seed = np.asarray(prng.seed_from_key(key)).astype(np.uint64)
  mask = np.uint64(0xFFFFFFFF)

  def fmix(x):
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & mask
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & mask
    return x ^ (x >> np.uint64(16))

  i = np.arange(48 * 40, dtype=np.uint64)
  want = fmix(fmix((i * np.uint64(0x9E3779B9) + seed[0]) & mask) ^ seed[1]).astype(np.uint32)
  np.testing.assert_array_equal(_bits(key, (48, 40)), want.reshape(48, 40))


def test_same_key_same_bits_and_jit_equals_eager():
  key = jax.random.key(5)
  a = _bits(key, (64, 64))
  np.testing.assert_array_equal(a, _bits(key, (64, 64)))
  np.testing.assert_array_equal(a, np.asarray(prng.random_bits(key, (64, 64))))
  # Bits depend on the global position only: a prefix of rows is the same draw.
  np.testing.assert_array_equal(a[:32], _bits(key, (32, 64)))


def test_every_bit_is_one_half_the_time():
  words = _bits(jax.random.key(0))
  ones = np.array([np.count_nonzero(words & np.uint32(1 << b)) for b in range(32)])
  sigma = np.sqrt(N / 4)
  assert np.all(np.abs(ones - N / 2) < 5 * sigma), (ones - N / 2) / sigma


@pytest.mark.parametrize("shift,width", [(0, 8), (8, 8), (16, 8), (24, 8), (16, 16)])
def test_bit_fields_are_uniform_chi_square(shift, width):
  words = _bits(jax.random.key(1))
  field = (words >> np.uint32(shift)) & np.uint32((1 << width) - 1)
  bins = 1 << width
  assert _chi2_uniform(field.astype(np.int64), bins) < _chi2_bound(bins - 1)


@pytest.mark.parametrize("offset", [1, 2, 16, 1024])  # next element, next-but-one, next block, next row
def test_neighbouring_elements_are_independent(offset):
  """Correlation of the uniforms of elements `offset` apart, and the joint histogram of their top 4 bits."""
  flat = _bits(jax.random.key(2)).ravel()
  a, b = flat[:-offset], flat[offset:]
  r = np.corrcoef(_uniform01(a), _uniform01(b))[0, 1]
  assert abs(r) < 5 / np.sqrt(a.size), r
  pair = ((a >> np.uint32(28)) << np.uint32(4)) | (b >> np.uint32(28))
  assert _chi2_uniform(pair.astype(np.int64), 256) < _chi2_bound(255)


def test_nearby_keys_are_independent():
  """Streams of consecutive seeds key(0..7), of split keys and of fold_in keys are pairwise uncorrelated."""
  shape = (256, 1024)
  n = shape[0] * shape[1]
  base = jax.random.key(100)
  families = [[jax.random.key(i) for i in range(8)], list(jax.random.split(base, 8)),
              [jax.random.fold_in(base, i) for i in range(8)]]
  for keys in families:
    u = np.stack([_uniform01(_bits(k, shape).ravel()) for k in keys])
    r = np.corrcoef(u)
    off = r[~np.eye(len(keys), dtype=bool)]
    assert np.max(np.abs(off)) < 5 / np.sqrt(n), off


def test_one_bit_seed_change_flips_half_the_output_bits():
  """The mixer itself (not only threefry's seed): seeds one bit apart give words differing in ~16 of 32 bits."""
  idx = prng.element_index((64, 256))
  n = 64 * 256
  seed = jnp.asarray([0x12345678, 0x9ABCDEF0], jnp.uint32)
  base = np.asarray(prng.hash_bits(seed, idx))
  for word in (0, 1):
    for bit in (0, 7, 31):
      other = seed.at[word].set(seed[word] ^ jnp.uint32(1 << bit))
      diff = np.unpackbits((base ^ np.asarray(prng.hash_bits(other, idx))).view(np.uint8)).reshape(n, 32)
      flips = diff.mean(axis=0)  # per output bit
      assert np.all(np.abs(flips - 0.5) < 5 * 0.5 / np.sqrt(n)), (word, bit, flips)


def test_one_bit_index_change_flips_each_output_bit_half_the_time():
  """Avalanche over the index: for every input bit flipped, every output bit flips with probability ~1/2."""
  seed = jnp.asarray([0xDEADBEEF, 0x0BADF00D], jnp.uint32)
  n = 1 << 14
  idx = jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(2654435761)  # spread indices over all 32 bits
  base = np.asarray(prng.hash_bits(seed, idx))
  for bit in range(32):
    flipped = np.asarray(prng.hash_bits(seed, idx ^ jnp.uint32(1 << bit)))
    flips = np.unpackbits((base ^ flipped).view(np.uint8)).reshape(n, 32).mean(axis=0)
    assert np.all(np.abs(flips - 0.5) < 5 * 0.5 / np.sqrt(n)), (bit, flips)


def _entry_ops_with_shape(fn, args, shape_text):
  """Top-level ops of the compiled computation (kernels and their outputs) whose result has type `shape_text`."""
  entry = compiled_hlo.entry(compiled_hlo.compiled_text(fn, *args))
  return [i.line for i in compiled_hlo.instructions(entry) if i.type.split("{")[0] == shape_text]


@pytest.mark.parametrize("sr_bits,fused", [("hash", True), ("threefry", False)])
def test_hash_bits_are_computed_inside_the_quantizer_loop(sr_bits, fused):
  """No full-size uint32 array in the compiled SR quantizer: the index iota and the hash fuse into the elementwise
  pass (threefry's bits, for contrast, are a separate full-size array)."""
  x = jnp.zeros((256, 256), jnp.float32)
  f = lambda x, k: fp4jax.fake_quant(x, "nvfp4", rounding="stochastic", key=k, sr_bits=sr_bits)
  rows = _entry_ops_with_shape(f, (x, jax.random.key(0)), "u32[256,256]")
  assert (len(rows) == 0) == fused, rows


@pytest.mark.parametrize("make_key", [lambda s: jax.random.key(s), lambda s: jax.random.PRNGKey(s),
                                      lambda s: jax.random.key(s, impl="rbg")], ids=["threefry", "raw", "rbg"])
def test_batched_derivations_equal_one_call_per_key(make_key):
  key = make_key(7)
  data = (1, 2, 3, 4, 5, 1000, 2**31)
  many = prng.fold_in_many(key, data)
  one_by_one = [jax.random.fold_in(key, d) for d in data]
  data_of = lambda k: np.asarray(jax.random.key_data(k) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) else k)
  for i, k in enumerate(one_by_one):
    np.testing.assert_array_equal(data_of(many[i]), data_of(k))
  seeds = np.asarray(prng.seeds_from_keys(many))
  assert seeds.shape == (len(data), 2) and seeds.dtype == np.uint32
  for i, k in enumerate(one_by_one):
    np.testing.assert_array_equal(seeds[i], np.asarray(prng.seed_from_key(k)))


def test_a_hash_seed_draws_the_bits_of_its_key():
  key = jax.random.key(3)
  seed = prng.HashSeed(prng.seed_from_key(key))
  np.testing.assert_array_equal(_bits(seed, (64, 48)), _bits(key, (64, 48)))
  x = jax.random.normal(jax.random.key(4), (64, 64), jnp.float32)
  for fmt in (fp4jax.NVFP4(), fp4jax.MXFP4()):
    a = fp4jax.quantize(x, fmt, rounding="stochastic", key=key)
    b = fp4jax.quantize(x, fmt, rounding="stochastic", key=seed)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
  with pytest.raises(ValueError, match="HashSeed seeds the hash generator only"):
    fp4jax.quantize(x, fp4jax.NVFP4(), rounding="stochastic", key=seed, sr_bits="threefry")
  with pytest.raises(ValueError, match="HashSeed seeds the hash generator only"):
    prng.random_bits(seed, (4,), "threefry")
  for bad in (jnp.zeros((2,), jnp.float32), jnp.zeros((3,), jnp.uint32)):
    with pytest.raises(ValueError, match=r"HashSeed holds uint32 words of shape \(2,\)"):
      fp4jax.quantize(x, fp4jax.NVFP4(), rounding="stochastic", key=prng.HashSeed(bad))
