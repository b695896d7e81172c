"""Stochastic rounding decisions bit for bit against NumPy, given the same random bits; the tensor amax reduction.

The quantizer computes the round-up probability as the fractional part of a / step (grids.e2m1_floor_fraction);
the reference computes p = (a - lo) / (hi - lo) from the grid neighbours in float64. Both must round up exactly
where the uniform drawn from the bits is below p (32-bit mode), or its top 8 bits below floor(256 p) (8-bit mode).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
import reference as ref

FMT = fp4jax.NVFP4()


def _edge_magnitudes():
  """Grid points, midpoints, one float32 ulp either side of both, the binade edges 1, 2, 4, tiny values, > 6."""
  grid = ref.E2M1_GRID
  mids = (grid[:-1] + grid[1:]) / 2
  base = np.concatenate([grid, mids, [1e-30, 1e-7, 0.01, 0.2499, 6.0001, 7.0, 1e30, np.inf]]).astype(np.float32)
  ups = np.nextafter(base, np.float32(np.inf))
  downs = np.nextafter(base, np.float32(0))
  return np.concatenate([base, ups, downs]).astype(np.float32)


@pytest.mark.parametrize("random_bits", [32, 8])
@pytest.mark.parametrize("sr_bits", ["hash", "threefry"])
def test_round_e2m1_stochastic_matches_numpy_given_the_bits(random_bits, sr_bits):
  edges = _edge_magnitudes()
  rng = np.random.default_rng(3)
  y = np.concatenate([edges, -edges, rng.uniform(-7, 7, 4096 - 2 * edges.size)]).astype(np.float32)
  y = np.tile(y, 4).reshape(64, 256)  # each value meets several draws
  key = jax.random.key(21)
  bits = np.asarray(fp4jax.prng.random_bits(key, y.shape, sr_bits))
  got = np.asarray(jax.jit(lambda v: fp4jax.rounding.round_e2m1_stochastic(v, key, random_bits, sr_bits))(
      jnp.asarray(y)))
  want = ref.e2m1_sr(y, bits, random_bits)
  np.testing.assert_array_equal(got.astype(np.float64), want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(y))  # -0 stays -0
  codes = np.asarray(jax.jit(lambda v: fp4jax.rounding.e2m1_codes_stochastic(v, key, random_bits, sr_bits))(
      jnp.asarray(y)))
  np.testing.assert_array_equal(ref.e2m1_value(codes), want)
  np.testing.assert_array_equal(codes >= 8, np.signbit(y))


def test_nan_stays_nan_with_its_sign():
  y = jnp.asarray([np.nan, -np.nan, 1.3, -0.0], jnp.float32)
  got = np.asarray(fp4jax.rounding.round_e2m1_stochastic(y, jax.random.key(0)))
  assert np.isnan(got[0]) and np.isnan(got[1]) and np.signbit(got[1]) and not np.signbit(got[0])
  assert got[2] in (1.0, 1.5) and got[3] == 0 and np.signbit(got[3])


@pytest.mark.parametrize("random_bits", [32, 8])
def test_nvfp4_stochastic_quantize_matches_numpy_given_the_bits(random_bits):
  """The whole quantizer: reference scaled values, then the reference decisions on the hash bits of the key."""
  rng = np.random.default_rng(5)
  x = (rng.standard_normal((32, 128)) * np.exp(rng.standard_normal((32, 1)))).astype(np.float32)
  x[0, :16] = 0.0
  x[1, :16] = -0.0
  x[2, :16] = ref.E2M1_GRID[[0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0]]  # on the grid after scaling
  key = jax.random.key(8)
  kw = dict(rounding="stochastic", key=key, random_bits=random_bits)
  q = jax.jit(lambda v: fp4jax.quantize(v, FMT, **kw))(jnp.asarray(x))
  r = ref.nvfp4_quantize(x)
  bits = np.asarray(fp4jax.prng.random_bits(key, x.shape))
  want = ref.e2m1_sr(r["scaled"].astype(np.float32), bits, random_bits)
  np.testing.assert_array_equal(ref.e2m1_value(ref.unpack_codes(np.asarray(q.codes), -1)), want)
  np.testing.assert_array_equal(ref.as_f64(q.scales), r["scales"])
  fq = np.asarray(jax.jit(lambda v: fp4jax.fake_quant(v, FMT, **kw))(jnp.asarray(x)))
  np.testing.assert_array_equal(fq.view(np.uint32), np.asarray(fp4jax.dequantize(q)).view(np.uint32))


@pytest.mark.parametrize("special", [None, np.inf, -np.inf, np.nan])
def test_tensor_amax_is_the_max_magnitude_and_propagates_nan(special):
  """The tensor amax (an unsigned max over the block amaxes' bits) equals max|x|; NaN anywhere gives NaN."""
  x = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
  x[3, 17] = -7.5
  if special is not None:
    x[9, 40] = special
  q = jax.jit(lambda v: fp4jax.quantize(v, FMT))(jnp.asarray(x))
  if special is not None and np.isnan(special):
    assert np.isnan(float(q.amax))
    assert np.all(np.isnan(np.asarray(fp4jax.dequantize(q))))
  else:
    assert float(q.amax) == np.max(np.abs(x.astype(np.float64)))
  zeros = jax.jit(lambda v: fp4jax.quantize(v, FMT))(jnp.zeros((4, 32), jnp.float32))
  assert float(zeros.amax) == 0.0 and not np.signbit(float(zeros.amax))
