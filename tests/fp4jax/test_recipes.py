"""Recipes: presets match the paper's table (docs/numerics.md, "Recipe"), ablation switches, the CLI string form,
with_bf16, validation, and that a recipe is a hashable static argument (one compilation per distinct recipe)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes
from fp4jax.recipes import GemmConfig, OperandConfig, Recipe

NVFP4 = fp4jax.NVFP4()


def _rows(recipe):
  """{gemm: row text} from str(recipe)."""
  lines = str(recipe).splitlines()
  return {g: next(l for l in lines if l.strip().startswith(g + " ")) for g in recipes.GEMMS}


def test_nvfp4_preset_is_the_paper_recipe():
  r = recipes.nvfp4()
  assert r.fprop == GemmConfig(OperandConfig(NVFP4), OperandConfig(NVFP4, block_2d=True))
  assert r.dgrad == GemmConfig(OperandConfig(NVFP4, rounding="stochastic"), OperandConfig(NVFP4, block_2d=True))
  assert r.wgrad == GemmConfig(OperandConfig(NVFP4, rounding="stochastic", rht=True), OperandConfig(NVFP4, rht=True))
  assert (r.rht_size, r.rht_signs, r.random_bits, r.backend) == (16, "fixed", 32, "xla")
  assert r.is_quantized and r.needs_key and r.dgrad_reuses_weight


def test_str_shows_each_gemm():
  rows = _rows(recipes.nvfp4())
  assert "x: nvfp4 1x16 RNE" in rows["fprop"] and "W: nvfp4 16x16 RNE" in rows["fprop"]
  assert "dY: nvfp4 1x16 SR" in rows["dgrad"] and "(Fprop W^T reused)" in rows["dgrad"]
  assert "dY: nvfp4 1x16 SR RHT" in rows["wgrad"] and "x: nvfp4 1x16 RNE RHT" in rows["wgrad"]
  assert "rht_size=16" in str(recipes.nvfp4())
  rows = _rows(recipes.mxfp4())
  assert "mxfp4(ceil) 1x32" in rows["fprop"] and "32x32" in rows["fprop"] and "SR RHT" in rows["wgrad"]
  assert "rht_size=32" in str(recipes.mxfp4())
  rows = _rows(recipes.fp8())
  assert "1x128 RNE" in rows["wgrad"] and "128x128" in rows["fprop"] and "SR" not in str(recipes.fp8())
  assert all(row.count("bf16") == 2 for row in _rows(recipes.bf16()).values())
  assert "reused" not in _rows(recipes.nvfp4(weight_2d=False))["dgrad"]


def test_ablation_switches():
  assert not any(recipes.nvfp4(rht=False).gemm(g).rht for g in recipes.GEMMS)
  no_sr = recipes.nvfp4(stochastic_rounding=False)
  assert {op.rounding for g in recipes.GEMMS for op in (no_sr.gemm(g).lhs, no_sr.gemm(g).rhs)} == {"nearest"}
  assert not no_sr.needs_key
  one_d = recipes.nvfp4(weight_2d=False)
  assert not one_d.fprop.rhs.block_2d and not one_d.dgrad_reuses_weight
  assert recipes.nvfp4(random_signs=False).rht_signs == "none"
  per_call = recipes.nvfp4(stochastic_rounding=False, random_signs="per_call")
  assert per_call.rht_signs == "per_call" and per_call.needs_key  # fresh signs need a key even without SR
  # (the preset refuses per-call signs without an RHT: they would change nothing)
  assert not recipes.nvfp4(rht=False, stochastic_rounding=False).replace(rht_signs="per_call").needs_key
  everywhere = recipes.nvfp4(rht_on=("fprop", "dgrad", "wgrad"))
  assert all(everywhere.gemm(g).rht for g in recipes.GEMMS) and not everywhere.dgrad_reuses_weight
  assert recipes.nvfp4(random_bits=8).random_bits == 8
  assert recipes.mxfp4(scale_rule="floor").fprop.lhs.fmt == fp4jax.MXFP4(scale_rule="floor")
  assert not recipes.fp8().needs_key and not recipes.bf16().is_quantized


def test_get_recipe_parses_cli_form():
  r = recipes.get_recipe("nvfp4:rht_size=4,stochastic_rounding=false")
  assert r == recipes.nvfp4(rht_size=4, stochastic_rounding=False)
  assert r.rht_size == 4 and r.dgrad.lhs.rounding == "nearest" and not r.needs_key
  r = recipes.get_recipe("nvfp4:rht_on=wgrad+dgrad")
  assert r == recipes.nvfp4(rht_on=("wgrad", "dgrad"))
  assert r.wgrad.rht and r.dgrad.rht and not r.fprop.rht
  assert recipes.get_recipe("nvfp4:rht_on=dgrad").dgrad.rht  # a single entry is a one-element tuple
  assert recipes.get_recipe("nvfp4:random_signs=per_call").rht_signs == "per_call"
  assert recipes.get_recipe("nvfp4:rht_on=none") == recipes.nvfp4(rht_on=()) == recipes.nvfp4(rht=False)
  assert recipes.get_recipe("NVFP4:RHT_Size=4") == recipes.nvfp4(rht_size=4)  # names and options: any case
  assert recipes.nvfp4(rht_on="dgrad") == recipes.nvfp4(rht_on=("dgrad",))
  assert recipes.get_recipe(" NVFP4 ") == recipes.nvfp4()
  assert recipes.get_recipe("mxfp4:scale_rule=floor,rht_size=16") == recipes.mxfp4(scale_rule="floor", rht_size=16)
  assert recipes.get_recipe("fp8:block_size=32") == recipes.fp8(block_size=32)
  r = recipes.nvfp4()
  assert recipes.get_recipe(r) is r
  assert {recipes.get_recipe(n).name for n in recipes.RECIPE_NAMES} == set(recipes.RECIPE_NAMES)


def test_replacing_the_gemm_mode_renames_a_switched_recipe():
  switched = recipes.nvfp4(gemm_mode="f32").with_bf16(backward=False)
  assert switched.name == "nvfp4-gemm:f32+bf16fwd"
  assert switched.replace(gemm_mode="auto").name == "nvfp4+bf16fwd"
  assert switched.replace(gemm_mode="bf16").name == "nvfp4+bf16fwd-gemm:bf16"
  assert recipes.nvfp4(gemm_mode="f32").replace(gemm_mode="bf16").name == recipes.nvfp4(gemm_mode="bf16").name


def test_every_sign_mode_has_a_cli_spelling():
  # "none" parses as None elsewhere; here it is the mode the name "nvfp4-signs:none" shows.
  for mode in recipes.RHT_SIGNS:
    r = recipes.get_recipe(f"nvfp4:random_signs={mode}")
    assert r == recipes.nvfp4(random_signs=mode) and r.rht_signs == mode
  assert recipes.get_recipe("nvfp4:random_signs=false") == recipes.nvfp4(random_signs="none")


@pytest.mark.parametrize("spec, match", [
    ("nvfp5", r"Unknown recipe 'nvfp5'.*'bf16', 'nvfp4', 'mxfp4', 'fp8'"),
    ("nvfp4:rht_sz=4", r"Unknown option\(s\) \['rht_sz'\].*rht_size"),
    ("bf16:rht=true", r"Unknown option\(s\) \['rht'\]"),
    ("nvfp4:rht_size", "key=value"),
    ("nvfp4:rht_size=3", "power of two"),
    ("nvfp4:rht_on=wgrad+attention", "rht_on"),
    ("nvfp4:random_signs=sometimes", "random_signs"),
    ("nvfp4:random_bits=16", "random_bits"),
    ("nvfp4:backend=cuda", "backend"),
    ("mxfp4:scale_rule=round", "scale_rule"),
    ("nvfp4:stochastic_rounding=flase", "stochastic_rounding must be True or False"),  # not a truthy string
    ("nvfp4:rht=2", "rht must be True or False"),
    ("mxfp4:weight_2d=yes please", "weight_2d must be True or False"),
])
def test_get_recipe_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    recipes.get_recipe(spec)


def test_recipe_validation():
  with pytest.raises(ValueError, match="RHT must apply to both operands"):
    Recipe(wgrad=GemmConfig(OperandConfig(NVFP4, rht=True), OperandConfig(NVFP4)))
  with pytest.raises(ValueError, match="rht_signs"):
    Recipe(rht_signs="random")
  with pytest.raises(ValueError, match="power of two"):
    Recipe(rht_size=512)


def test_with_bf16():
  r = recipes.nvfp4()
  fwd = r.with_bf16(forward=True, backward=False)
  assert not fwd.fprop.quantized and fwd.dgrad == r.dgrad and fwd.wgrad == r.wgrad and fwd.name == "nvfp4+bf16fwd"
  assert fwd.is_quantized and not fwd.dgrad_reuses_weight  # Dgrad re-quantizes W itself from high precision
  bwd = r.with_bf16(forward=False, backward=True)
  assert bwd.fprop == r.fprop and not bwd.dgrad.quantized and not bwd.wgrad.quantized and bwd.name == "nvfp4+bf16bwd"
  assert not bwd.needs_key
  both = r.with_bf16()
  assert not both.is_quantized and not both.needs_key and both.name == "nvfp4+bf16"
  assert r.with_bf16(forward=False, backward=False) is r
  assert recipes.bf16().with_bf16() == recipes.bf16()
  assert "x: bf16" in _rows(fwd)["fprop"] and "SR RHT" in _rows(fwd)["wgrad"]


def test_recipes_are_hashable_values():
  assert recipes.nvfp4() == recipes.nvfp4() and hash(recipes.nvfp4()) == hash(recipes.nvfp4())
  assert recipes.nvfp4() != recipes.nvfp4(rht_size=4)
  assert len({recipes.get_recipe(s) for s in ("nvfp4", "nvfp4:rht_size=16", "nvfp4:rht=false")}) == 2
  with pytest.raises(Exception):
    recipes.nvfp4().rht_size = 4  # frozen


def test_switching_recipes_compiles_once_per_recipe():
  traces = []

  @functools.partial(jax.jit, static_argnames="recipe")
  def forward(x, w, recipe):
    traces.append(recipe.name)
    return fp4jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe)

  x, w = jnp.ones((32, 32)), jnp.ones((32, 32))
  for _ in range(4):
    for spec in ("fp8", "nvfp4:stochastic_rounding=false"):
      forward(x, w, recipes.get_recipe(spec))  # a fresh, equal recipe object each time
  assert sorted(traces) == ["fp8", "nvfp4-sr"]


def test_names_tell_apart_recipes_that_differ():
  """Logs and reports label runs by recipe name: two different recipes never share one."""
  named = [recipes.mxfp4(), recipes.mxfp4(scale_rule="floor"), recipes.fp8(), recipes.fp8(scaling="tensor"),
           recipes.fp8(block_size=32), recipes.nvfp4(), recipes.nvfp4().replace(rht_size=4),
           recipes.nvfp4().replace(gemm_mode="f32"), recipes.nvfp4().replace(random_bits=8),
           recipes.bf16(), recipes.bf16(gemm_mode="f32"), recipes.bf16(gemm_mode="bf16")]
  assert len({r.name for r in named}) == len({r for r in named}) == len(named)
  assert recipes.mxfp4(scale_rule="floor").name == "mxfp4+floor"
  assert recipes.fp8(scaling="tensor").name == "fp8-tensor" and recipes.fp8(block_size=32).name == "fp8-b32"
  assert recipes.nvfp4().replace(rht_size=4).name == "nvfp4+rht_size=4"
  # A GEMM mode is tagged as the presets tag it, replacing the old tag; an explicit name wins; no change, no tag.
  assert recipes.nvfp4().replace(gemm_mode="f32") == recipes.nvfp4(gemm_mode="f32")
  assert recipes.nvfp4(gemm_mode="bf16").replace(gemm_mode="f32").name == "nvfp4-gemm:f32"
  # bf16's mode picks its backward's operand dtype (bf16 or float32 dY): named like the others' (was plain "bf16").
  assert recipes.get_recipe("bf16:gemm_mode=f32") == recipes.bf16().replace(gemm_mode="f32")
  assert recipes.bf16(gemm_mode="f32").name == "bf16-gemm:f32" and recipes.bf16(sr_bits="threefry").name == "bf16"
  assert recipes.nvfp4().replace(rht_size=4, name="mine").name == "mine"
  assert recipes.nvfp4().replace(rht_size=16) == recipes.nvfp4()


@pytest.mark.parametrize("kwargs,match", [
    ({"select": "msee"}, "select must be one of"),  # a typo
    ({"select": "mae"}, "four_over_six=True"),  # 4/6's choice without 4/6
    ({"stochastic_rounding": False, "unbiased_sr": "headroom"}, "stochastic_rounding=False"),
    ({"rht": False, "rht_on": ("fprop", "wgrad")}, "no effect"),
    ({"rht": False, "rht_size": 4}, "no effect"),
    ({"rht": False, "random_signs": "per_call"}, "rht=False turns the RHT off; random_signs='per_call'"),
    ({"rht_on": (), "rht_size": 4}, r"rht_on=\(\) turns the RHT off; rht_size=4"),
    ({"rht_on": (), "random_signs": False}, "random_signs=False would have no effect"),
    ({"stochastic_rounding": False, "random_bits": 8}, "stochastic_rounding=False"),
])
def test_options_that_would_change_nothing_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    recipes.nvfp4(**kwargs)


@pytest.mark.parametrize("spec, match", [
    ("fp8:block_size=64.0", r"FP8 block_size must be a positive int; got 64\.0"),  # not a TypeError in reshape later
    ("fp8:block_size=true", r"FP8 block_size must be a positive int; got True"),  # not 1-element blocks
    ("nvfp4:random_bits=8.0", r"random_bits must be 8 or 32; got 8\.0"),  # not a recipe named "nvfp4-sr8.0bit"
])
def test_float_spellings_of_int_options_are_refused(spec, match):
  with pytest.raises(ValueError, match=match):
    recipes.get_recipe(spec)
  for fmt in (lambda: fp4jax.NVFP4(block_size=16.0), lambda: fp4jax.MXFP4(block_size=32.0),
              lambda: fp4jax.MXFP8(block_size=32.0)):
    with pytest.raises(ValueError, match="-element blocks; got block_size="):
      fmt()
  assert recipes.fp8(block_size=np.int64(64)).fprop.lhs.fmt.block_size == 64  # numpy ints are ints


@pytest.mark.parametrize("spec, match", [
    (recipes.nvfp4, r"got the preset function fp4jax\.recipes\.nvfp4; .*: fp4jax\.recipes\.nvfp4\(\)\.$"),
    (fp4jax.NVFP4(), r"expected a Recipe .* or its name, .*; got NVFP4 \"NVFP4\(block_size=16"),  # a format
    (16, r"got int '16'\.$"),
])
def test_a_recipe_that_is_not_a_recipe_or_a_string_is_named(spec, match):
  with pytest.raises(ValueError, match=match):
    recipes.get_recipe(spec)


def test_rht_on_order_and_repeats_do_not_change_the_recipe():
  """The same GEMMs in another order are the same recipe: one name (runs, reports) and one compile (jit's static key)."""
  a, b = recipes.get_recipe("nvfp4:rht_on=wgrad+dgrad"), recipes.get_recipe("nvfp4:rht_on=dgrad+wgrad+wgrad")
  assert a == b and hash(a) == hash(b) and a.name == "nvfp4-rht@dgrad+wgrad"
  assert recipes.nvfp4(rht_on=("wgrad",)) == recipes.nvfp4()


@pytest.mark.parametrize("side", ["lhs", "rhs"])
def test_stochastic_rounding_on_an_fprop_operand_is_refused(side):
  # It passed validation, then could not run: dot_general's rule draws keys for the backward's operands only, so
  # the forward raised "rounding='stochastic' needs a PRNG key: pass key=" with a key passed.
  import dataclasses  # pylint: disable=g-import-not-at-top
  r = recipes.nvfp4()
  op = dataclasses.replace(getattr(r.fprop, side), rounding="stochastic")
  with pytest.raises(ValueError, match=f"fprop.{side}: stochastic rounding applies to the backward's operands"):
    r.replace(fprop=dataclasses.replace(r.fprop, **{side: op}))


def test_fp8_preset_is_the_paper_baseline():
  """The FP8 baseline's table, operand by operand: E4M3 in 1x128 blocks for the activations and gradients (x, dY;
  Wgrad's x is an activation too, blocked 1x128 along the tokens), 128x128 tiles for the weight only, RNE, padded.
  str(fp8()) shows only Wgrad's lhs as "1x128", so a 2D-blocked Wgrad x would go unnoticed without this."""
  r = recipes.fp8()
  act = OperandConfig(fp4jax.FP8(), pad=True)
  weight = OperandConfig(fp4jax.FP8(), block_2d=True, pad=True)
  assert r.fprop == GemmConfig(act, weight) and r.dgrad == GemmConfig(act, weight)
  assert r.wgrad == GemmConfig(act, act)
  assert not r.needs_key and r.dgrad_reuses_weight  # Dgrad reuses the 128x128 Fprop weight, transposed


def test_each_ablation_switch_has_its_own_name_tag():
  """recipe_names.ablation_name gives a preset one tag per switched component; logs and result tables label runs by
  that name, so no switch may be left untagged (8-bit SR printed as plain "nvfp4" would pass for the paper's
  32-bit recipe)."""
  named = {"nvfp4": {}, "nvfp4-sr8bit": dict(random_bits=8), "nvfp4-threefry": dict(sr_bits="threefry"),
           "nvfp4-sr": dict(stochastic_rounding=False), "nvfp4-2d": dict(weight_2d=False),
           "nvfp4-rht": dict(rht=False), "nvfp4-rht4": dict(rht_size=4),
           "nvfp4-signs:per_call": dict(random_signs="per_call"),
           "nvfp4-rht@dgrad+wgrad": dict(rht_on=("dgrad", "wgrad"))}
  for name, kwargs in named.items():
    assert recipes.nvfp4(**kwargs).name == name, kwargs
  assert recipes.mxfp4(random_bits=8).name == "mxfp4-sr8bit"
