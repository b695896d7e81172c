"""Stochastic rounding of NVFP4 elements: neighbours only, unbiased, reproducible, 8-bit mode, sharding-independent."""

import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
import reference as ref
from op_by_op import op_by_op

FMT = fp4jax.NVFP4()
ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_KEYS = 512


def _x(seed=0, shape=(32, 64)):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def _sr(random_bits, axis=-1):
  return jax.jit(functools.partial(fp4jax.quantize, fmt=FMT, axis=axis, rounding="stochastic",
                                   random_bits=random_bits))


@functools.cache
def _sr_many(random_bits):
  """Unpacked codes [NUM_KEYS, ...] for NUM_KEYS keys under one vmap."""
  return jax.jit(jax.vmap(lambda x, k: fp4jax.quantize(x, FMT, rounding="stochastic", key=k,
                                                       random_bits=random_bits).codes, in_axes=(None, 0)))


def _codes_for_keys(x, random_bits=32, seed=0):
  keys = jax.random.split(jax.random.key(seed), NUM_KEYS)
  packed = np.asarray(_sr_many(random_bits)(jnp.asarray(x), keys))
  return ref.unpack_codes(packed, -1)


def _block_of(t, j):
  """A 16-block [6, t, ..., t] * 2^j (S_enc = 1 when the tensor amax is 2688): x * enc_b == t exactly."""
  return (np.array([6.0] + [t] * 15) * 2.0**j).astype(np.float32)


def _exact_fraction_tensor(t):
  """[8, 64]: amax 2688 and 31 blocks whose non-max elements scale to exactly t."""
  x = np.zeros((8, 64), np.float32)
  x[0, :16] = np.float32(2688.0) * np.linspace(1, 0.1, 16, dtype=np.float32)
  for i in range(1, 32):
    x[i // 4, 16 * (i % 4):16 * (i % 4) + 16] = _block_of(t, (i % 7) - 3) * (1 if i % 2 else -1)
  return x


# ---------------------------------------------------------------- basic properties


def test_two_keys_differ_and_same_key_same_bits():
  x = jnp.asarray(_x())
  a = _sr(32)(x, key=jax.random.key(0))
  b = _sr(32)(x, key=jax.random.key(1))
  a2 = _sr(32)(x, key=jax.random.key(0))
  assert np.mean(np.asarray(a.unpacked_codes()) != np.asarray(b.unpacked_codes())) > 0.1
  np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(a2.codes))
  # Op by op and jit draw the same bits from the same key.
  eager = op_by_op(fp4jax.quantize)(x, FMT, rounding="stochastic", key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(eager.codes), np.asarray(a.codes))


def test_scales_and_amax_are_the_round_to_nearest_ones():
  x = _x(1)
  r = ref.nvfp4_quantize(x)
  for bits in (32, 8):
    q = _sr(bits)(jnp.asarray(x), key=jax.random.key(3))
    np.testing.assert_array_equal(ref.as_f64(q.scales), r["scales"])
    np.testing.assert_array_equal(np.float64(q.amax), r["amax"])


@pytest.mark.parametrize("random_bits", [32, 8])
def test_every_code_is_a_neighbour_of_the_exact_value(random_bits):
  """|code_value - x * enc_b| < grid step, and the code is the floor or ceil grid point (after saturation to 6)."""
  x = np.concatenate([_x(2), np.random.default_rng(3).standard_t(2, (32, 64)).astype(np.float32)])
  codes = _codes_for_keys(x, random_bits)  # [512, 64, 64]
  v = ref.nvfp4_quantize(x)["scaled"]
  lo, hi = ref.e2m1_neighbours(v)
  mag = ref.E2M1_GRID[codes & 7]
  assert np.all((mag == lo) | (mag == hi))
  assert np.all(np.abs(mag - np.minimum(np.abs(v), 6)) <= hi - lo)
  # Sign comes from the scaled value (a value rounding to zero keeps its sign bit).
  assert np.all((codes >= 8) == np.signbit(v))
  # Both neighbours really occur wherever the value is off the grid.
  off_grid = lo != hi
  assert np.any(mag == lo, axis=0)[off_grid].mean() > 0.99
  assert np.any(mag == hi, axis=0)[off_grid].mean() > 0.99


def test_unbiased_and_better_than_nearest_on_average():
  """Mean over 512 keys is within 5 standard errors of x * enc_b (Bernoulli variance of each element)."""
  x = _x(4)
  r = ref.nvfp4_quantize(x)
  v = np.clip(r["scaled"], -6, 6)
  codes = _codes_for_keys(x, 32, seed=5)
  values = ref.e2m1_value(codes)  # [512, 32, 64]
  mean = values.mean(axis=0)
  lo, hi = ref.e2m1_neighbours(v)
  step = hi - lo
  p = np.where(step > 0, (np.abs(v) - lo) / np.where(step > 0, step, 1), 0.0)
  se = step * np.sqrt(p * (1 - p) / NUM_KEYS)
  # Per element: the normal approximation fails for p ~ 1/512, so floor the variance at one flip in 512 draws.
  se_floor = step / NUM_KEYS
  assert np.all(np.abs(mean - v) <= 5 * np.maximum(se, se_floor) + 1e-12)
  # Over the whole tensor: the summed deviation is within 5 standard errors too (a strict bias test).
  z = np.sum(mean - v) / np.sqrt(np.sum(se**2))
  assert abs(z) < 5, z
  # The key-averaged SR result is far closer to the exact value than round-to-nearest.
  rne = ref.e2m1_value(r["codes"])
  err_sr = np.sqrt(np.mean((mean - v)**2))
  err_rne = np.sqrt(np.mean((rne - v)**2))
  assert err_sr < 0.25 * err_rne, (err_sr, err_rne)  # measured: ~0.02 vs ~0.25 in scaled units


def test_dequantized_mean_matches_input():
  """In x's units: E[dequantize(SR)] == x up to float32 rounding of the scales, for values inside +-6 * scale."""
  x = _x(6)
  keys = jax.random.split(jax.random.key(7), NUM_KEYS)
  deq = jax.jit(jax.vmap(lambda k: fp4jax.dequantize(fp4jax.quantize(jnp.asarray(x), FMT, rounding="stochastic",
                                                                       key=k))))(keys)
  mean = np.asarray(deq, np.float64).mean(axis=0)
  r = ref.nvfp4_quantize(x)
  unit = np.repeat(r["scales"], 16, axis=-1) * r["amax"] / 2688  # value of one scaled unit, per element
  inside = np.abs(r["scaled"]) <= 6
  assert np.all(np.abs(mean - x)[inside] <= 5 * 2 * unit[inside] * np.sqrt(0.25 / NUM_KEYS) + 1e-6 * np.abs(x[inside]))


# ---------------------------------------------------------------- 8-bit mode


def test_eight_bit_mode_quantizes_probabilities():
  """p = 1/512: floor(p * 256) = 0, so with 8 random bits the value never rounds up; 32 bits round up ~1/512."""
  x = _exact_fraction_tensor(4.0 + 2.0 / 512)  # between grid points 4 and 6, p = 1/512
  r = ref.nvfp4_quantize(x)
  target = np.abs(r["scaled"]) == 4.0 + 2.0 / 512
  assert target.sum() == 31 * 15
  up8 = ref.E2M1_GRID[_codes_for_keys(x, 8) & 7][:, target] == 6.0
  up32 = ref.E2M1_GRID[_codes_for_keys(x, 32) & 7][:, target] == 6.0
  n = up32.size  # 512 keys * 465 elements
  assert up8.sum() == 0
  assert abs(up32.sum() - n / 512) < 5 * np.sqrt(n / 512), up32.sum()  # measured ~465


def test_eight_bit_mode_rounds_probability_down_to_multiple_of_1_256():
  """p = 3/512 = 1.5/256: 8-bit probability is floor(1.5)/256 = 1/256, full width keeps 3/512."""
  x = _exact_fraction_tensor(4.0 + 2.0 * 3 / 512)
  target = np.abs(ref.nvfp4_quantize(x)["scaled"]) == 4.0 + 6.0 / 512
  up8 = ref.E2M1_GRID[_codes_for_keys(x, 8, seed=1) & 7][:, target] == 6.0
  up32 = ref.E2M1_GRID[_codes_for_keys(x, 32, seed=1) & 7][:, target] == 6.0
  n = up8.size
  for ups, p in ((up8.sum(), 1 / 256), (up32.sum(), 3 / 512)):
    assert abs(ups - n * p) < 5 * np.sqrt(n * p * (1 - p)), (ups, n * p)


def test_values_on_the_grid_never_move():
  x = _exact_fraction_tensor(3.0)
  r = ref.nvfp4_quantize(x)
  lo, hi = ref.e2m1_neighbours(r["scaled"])
  on_grid = lo == hi
  assert on_grid.sum() >= 31 * 16
  for bits in (8, 32):
    codes = _codes_for_keys(x, bits)
    assert np.all(codes[:, on_grid] == r["codes"][on_grid])


def test_saturated_values_stay_at_six():
  """Elements scaled beyond 6 (block scale rounded down) are saturated to 6 before SR, so they never move."""
  x = np.zeros((8, 64), np.float32)
  x[0, 0] = 2688.0
  x[1, :16] = np.float32(1.06 * 6) * np.linspace(1, 0.99, 16, dtype=np.float32)  # s_b = 1, scaled > 6
  v = ref.nvfp4_quantize(x)["scaled"]
  assert np.all(np.abs(v[1, :16]) > 6)
  codes = _codes_for_keys(x, 32)
  assert np.all(codes[:, 1, :16] == 7)


# ---------------------------------------------------------------- sharding


_SHARDING_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import functools
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import fp4jax

    assert jax.device_count() == 8, jax.devices()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    checked = 0
    for axis, bits, gen in ((-1, 32, "hash"), (0, 8, "hash"), (-1, 32, "threefry")):
      q = jax.jit(functools.partial(fp4jax.quantize, fmt=fp4jax.NVFP4(), axis=axis, rounding="stochastic",
                                    key=jax.random.key(42), random_bits=bits, sr_bits=gen))
      base = q(x)
      for spec in (P("d", None), P(None, "d")):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        assert len(xs.sharding.device_set) == 8
        out = q(xs)
        for name in ("codes", "scales", "amax"):
          a, b = np.asarray(getattr(base, name)), np.asarray(getattr(out, name))
          assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
          bits_of = lambda v: v.view(np.uint8 if v.dtype.itemsize == 1 else np.uint32)
          assert np.array_equal(bits_of(a), bits_of(b)), (name, axis, bits, spec)
        checked += 1
    print("SHARDING_OK", checked)
""")


def test_stochastic_rounding_is_independent_of_sharding():
  """Row- and column-sharded [64, 256] over 8 CPU devices give the unsharded codes, scales and amax bit for bit.

  For both generators: the hash's element index is the global one, threefry is JAX's partitionable threefry.
  """
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  res = subprocess.run([sys.executable, "-c", _SHARDING_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  assert "SHARDING_OK 6" in res.stdout


# ---------------------------------------------------------------- generators


@pytest.mark.parametrize("sr_bits", ["hash", "threefry"])
def test_unbiased_over_sixteen_million_elements(sr_bits):
  """sum(SR(y) - y) over 2^24 values spread over [-6, 6] is within 5 sigma (sigma^2 = sum gap^2 p (1 - p))."""
  n = 1 << 24
  y = np.random.default_rng(8).uniform(-6, 6, n).astype(np.float32)
  r = jax.jit(lambda y, k: fp4jax.rounding.round_e2m1_stochastic(y, k, 32, sr_bits))(jnp.asarray(y),
                                                                                     jax.random.key(9))
  r = np.asarray(r, np.float64)
  a = np.abs(y.astype(np.float64))
  lo, hi = ref.e2m1_neighbours(a)
  assert np.all((np.abs(r) == lo) | (np.abs(r) == hi))
  gap = hi - lo
  p = np.where(gap > 0, (a - lo) / np.where(gap > 0, gap, 1), 0.0)
  sigma = np.sqrt(np.sum(gap**2 * p * (1 - p)))
  z = np.sum(np.abs(r) - a) / sigma
  assert abs(z) < 5, z
  # The rounding goes up with probability p in every part of the grid (steps 0.5, 1 and 2).
  for lo_edge, hi_edge in ((0, 2), (2, 4), (4, 6)):
    sel = (a >= lo_edge) & (a < hi_edge) & (gap > 0)
    up = np.abs(r[sel]) == hi[sel]
    z = (up.sum() - p[sel].sum()) / np.sqrt(np.sum(p[sel] * (1 - p[sel])))
    assert abs(z) < 5, (lo_edge, z)


def test_threefry_option_draws_jax_random_bits():
  """sr_bits="threefry" rounds up exactly where jax.random.bits(key)'s uniform is below p (the previous bits)."""
  x = jnp.asarray(np.random.default_rng(10).uniform(-6, 6, (64, 128)).astype(np.float32))
  key = jax.random.key(12)
  u = fp4jax.rounding.uniform_from_bits(jax.random.bits(key, x.shape, jnp.uint32), 32)
  a = np.abs(np.asarray(x, np.float64))
  lo, hi = ref.e2m1_neighbours(a)
  want = np.where(np.asarray(u) < (a - lo) / np.where(hi > lo, hi - lo, 1), hi, lo)
  got = np.abs(np.asarray(fp4jax.rounding.round_e2m1_stochastic(x, key, 32, "threefry"), np.float64))
  np.testing.assert_array_equal(got, want)
  hashed = np.abs(np.asarray(fp4jax.rounding.round_e2m1_stochastic(x, key, 32, "hash"), np.float64))
  assert np.mean(hashed != got) > 0.1  # a different generator: different draws


@pytest.mark.parametrize("sr_bits", ["hash", "threefry"])
def test_quantize_and_fake_quant_draw_the_same_bits(sr_bits):
  x = jnp.asarray(_x(11, (48, 64)))
  kw = dict(rounding="stochastic", key=jax.random.key(13), sr_bits=sr_bits)
  q = fp4jax.quantize(x, FMT, **kw)
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q)), np.asarray(fp4jax.fake_quant(x, FMT, **kw)))


def test_unknown_sr_bits_raises():
  with pytest.raises(ValueError, match="sr_bits"):
    fp4jax.quantize(jnp.ones((4, 16)), FMT, rounding="stochastic", key=jax.random.key(0), sr_bits="philox")
