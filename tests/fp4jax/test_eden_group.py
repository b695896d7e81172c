"""MS-EDEN's correction group as a parameter: Quartet II corrects over each Hadamard tile, so NVFP4(eden_group=g)
matches the NumPy reference with g-element groups, and a recipe whose RHT size differs from the group is refused.
The correction's products are rounded under jit as eagerly (no fused multiply-adds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import eden
from fp4jax import gemm
import compiled_hlo
import recipes_beyond_helpers as helpers
import reference as ref
import reference_recipes as rref


@pytest.mark.parametrize("group, axis", [(32, 1), (64, 0), (128, 1)])
def test_eden_group_matches_reference(group, axis):
  x = helpers.inputs("heavy", seed=23, shape=(96, 160))  # 10 blocks: the last group is partial for 32 and 64
  fmt = fp4jax.NVFP4(scale_rule="eden", eden_group=group)
  r = rref.nvfp4_eden(x, axis=axis, group=group // 16)
  helpers.check(x, fmt, r, axis=axis)
  if group != 128:  # the group really changes the scales
    other = rref.nvfp4_eden(x, axis=axis, group=8)
    assert np.any(other["scales"] != r["scales"])


def test_quartet2_group_follows_its_rht_size():
  assert fp4jax.recipes.quartet2().dgrad.lhs.fmt == fp4jax.NVFP4(scale_rule="eden")  # 128, the paper's
  r = fp4jax.recipes.get_recipe("quartet2:rht_size=32")
  assert {op.fmt.eden_group for g in ("dgrad", "wgrad") for op in (r.gemm(g).lhs, r.gemm(g).rhs)} == {32}
  assert "nvfp4(eden,group32)" in str(r)
  with pytest.raises(ValueError, match="rht_size must be >= 16"):
    fp4jax.recipes.quartet2(rht_size=8)


def test_eden_group_differing_from_the_rht_size_is_refused():
  r = fp4jax.recipes.quartet2()
  with pytest.raises(ValueError, match="eden_group=128 elements but the RHT size is 32"):
    r.replace(rht_size=32)
  no_rht = fp4jax.recipes.OperandConfig(fmt=fp4jax.NVFP4(scale_rule="eden", eden_group=32))
  fp4jax.Recipe(name="eden_no_rht", dgrad=fp4jax.recipes.GemmConfig(no_rht, no_rht), rht_size=128)  # no RHT: any


@pytest.mark.parametrize("changes, match", [
    (dict(scale_rule="eden", eden_group=24), "16 times a power of two"),
    (dict(scale_rule="eden", eden_group=0), "16 times a power of two"),
    # Multiples of 16 whose block count is no power of two: accepted before, then quantize failed inside the
    # pairwise sum ("block of 3 elements").
    (dict(scale_rule="eden", eden_group=48), "16 times a power of two"),
    (dict(scale_rule="eden", eden_group=96), "16 times a power of two"),
    (dict(scale_rule="nearest", eden_group=64), "scale_rule='eden' only"),
])
def test_bad_eden_group_raises(changes, match):
  with pytest.raises(ValueError, match=match):
    fp4jax.NVFP4(**changes)


def test_numpy_integer_groups_and_rht_sizes_are_plain_ints():
  """np.int64(128) was refused as an eden_group ("must be a positive multiple of 16; got np.int64(128)"), which
  quartet2(rht_size=np.int64(128)) passed on; a float size is refused as an RHT size, not as a group."""
  assert fp4jax.NVFP4(scale_rule="eden", eden_group=np.int64(64)) == fp4jax.NVFP4(scale_rule="eden", eden_group=64)
  assert fp4jax.recipes.quartet2(rht_size=np.int64(128)) == fp4jax.recipes.quartet2()
  with pytest.raises(ValueError, match="RHT size must be a power of two"):
    fp4jax.recipes.quartet2(rht_size=128.0)


def test_eden_group_survives_the_recipe_json_round_trip():
  from fp4jax.pretrain import policy  # pylint: disable=g-import-not-at-top
  r = fp4jax.recipes.quartet2(rht_size=64)
  assert policy.recipe_from_json(policy.recipe_to_json(r)) == r


def _reference_correction(y, v, axis, group_blocks):
  """sum(y^2) / sum(y v) per group of `group_blocks` 16-element blocks, each product and partial sum rounded to
  float32 in the pairwise order (reference_recipes.nvfp4_eden's arithmetic), repeated per block."""
  per_block = lambda t: np.moveaxis(rref.pairwise(rref.blocks_last(t, 16, axis, False), np.add), -1, axis)

  def group_sum(a):
    a = np.moveaxis(a, axis, -1)
    n = a.shape[-1]
    padded = np.concatenate([a, np.zeros(a.shape[:-1] + (-n % group_blocks,))], axis=-1)
    s = rref.pairwise(padded.reshape(*a.shape[:-1], -1, group_blocks), np.add)
    return np.moveaxis(np.repeat(s, group_blocks, axis=-1)[..., :n], -1, axis)

  num, den = group_sum(per_block(ref.f32(y * y))), group_sum(per_block(ref.f32(y * v)))
  return np.where(den == 0, 1.0, ref.f32(num / np.where(den == 0, 1.0, den)))


@pytest.mark.parametrize("axis", [0, 1])
def test_eden_correction_is_the_same_under_jit(axis):
  """Under jit XLA fused y*y and y*v into FMAs with their sums (an ulp off for ~10% of groups on this data);
  eden.correction rounds the products, so jit, eager and the float32 reference agree bit for bit."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((128, 256)) * np.exp(2 * rng.standard_normal((128, 256)))
  y = (x / np.max(np.abs(x)) * 6 * 1.0001).astype(np.float32)  # element-scale values in [-6.0006, 6.0006]
  v = ref.e2m1_value(ref.e2m1_rne(y)).astype(np.float32)
  block = (1, 16) if axis == 1 else (16, 1)
  want = _reference_correction(np.asarray(y, np.float64), np.asarray(v, np.float64), axis, 4)
  eager = eden.correction(jnp.asarray(y), jnp.asarray(v), block, 4)
  jitted = jax.jit(lambda y, v: eden.correction(y, v, block, 4))(jnp.asarray(y), jnp.asarray(v))
  np.testing.assert_array_equal(np.asarray(eager, np.float64), want)
  np.testing.assert_array_equal(np.asarray(jitted, np.float64), want)


def _per_element_computations(fn, x):
  """The computations of fn's compiled program that hold an array of x's size (the per-element loops)."""
  hlo = compiled_hlo.compiled_text(fn, x)
  return [c for c in compiled_hlo.computations(hlo) if x.size in compiled_hlo.sizes(c.text)]


@pytest.mark.parametrize("unit", ["unit_values", "f32_unit"])
def test_eden_block_scales_are_rounded_once_per_block(unit):
  """The stochastic E4M3 rounding of the corrected block scales (neighbours through float8, the hash) is computed
  per block: XLA:CPU fused it into every element's loop (16x the work, most of the `small` quartet2 backward)."""
  x = jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)
  fmt = fp4jax.NVFP4(scale_rule="eden", eden_group=64)
  fn = lambda x: getattr(gemm, unit)(x, fmt, axis=0, rounding="stochastic", key=jax.random.key(2))
  computations = _per_element_computations(fn, x)
  assert computations
  assert not [c.name for c in computations if "f8e4m3fn" in c.text]


def test_eden_block_sums_read_the_elements_in_place():
  """The correction sums each block where its elements lie (blocks along axis 0, as in the backward GEMMs): moving
  them last put a transpose into the sums' per-element loops, which XLA:CPU then ran unvectorised."""
  x = jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)
  fmt = fp4jax.NVFP4(scale_rule="eden", eden_group=64)
  computations = _per_element_computations(lambda x: gemm.f32_unit(x, fmt, axis=0), x)
  assert computations
  assert not [c.name for c in computations if "transpose(" in c.text]


def test_eden_scales_with_8_random_bits_truncate_the_probability():
  """With 8 random bits the round-up probability is floor(p * 256) / 256 (as rounding.uniform_from_bits says): between
  the E4M3 neighbours 2 and 2.25, p = 0.5 / 256 never rounds up, p = 64.5 / 256 rounds up 64 / 256 of the time."""
  lo, hi = 2.0, 2.25
  n = 1 << 14
  for p256, expected in ((0.5, 0.0), (64.5, 64 / 256)):
    s = np.float32(lo + (hi - lo) * p256 / 256.0)
    got = np.asarray(eden.round_scales(jnp.full((n,), s), rounding="stochastic", key=jax.random.key(3),
                                       random_bits=8))
    assert set(np.unique(got).tolist()) <= {lo, hi}
    up = float(np.mean(got == hi))
    if expected == 0:
      assert up == 0, up
    else:
      assert abs(up - expected) <= 4.0 * np.sqrt(expected / n), (p256, up)


def test_numpy_integer_eden_group_is_stored_as_a_python_int():
  """NVFP4 stores eden_group as a plain int: np.int64(64) gives the same field type and repr (what recipe names,
  JSON and reports print) as 64, not "eden_group=np.int64(64)"."""
  a = fp4jax.NVFP4(scale_rule="eden", eden_group=np.int64(64))
  b = fp4jax.NVFP4(scale_rule="eden", eden_group=64)
  assert type(a.eden_group) is int and repr(a) == repr(b)
