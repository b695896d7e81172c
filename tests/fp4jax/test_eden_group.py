"""MS-EDEN's correction group as a parameter: Quartet II corrects over each Hadamard tile, so NVFP4(eden_group=g)
matches the NumPy reference with g-element groups, and a recipe whose RHT size differs from the group is refused."""

import numpy as np
import pytest

import fp4jax
import recipes_beyond_helpers as helpers
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
    (dict(scale_rule="eden", eden_group=24), "multiple of 16"),
    (dict(scale_rule="eden", eden_group=0), "multiple of 16"),
    (dict(scale_rule="nearest", eden_group=64), "scale_rule='eden' only"),
])
def test_bad_eden_group_raises(changes, match):
  with pytest.raises(ValueError, match=match):
    fp4jax.NVFP4(**changes)


def test_eden_group_survives_the_recipe_json_round_trip():
  from fp4jax.pretrain import policy  # pylint: disable=g-import-not-at-top
  r = fp4jax.recipes.quartet2(rht_size=64)
  assert policy.recipe_from_json(policy.recipe_to_json(r)) == r
