"""Tests for fp4jax.pretrain.policy: layer selection, the late switch, apply(), serialization and CLI parsing."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import fp4jax.recipes
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain.policy import PrecisionPolicy, policy_from_strings

N_LAYERS = 4
CONFIG = model_lib.get_model_config("tiny", n_layers=N_LAYERS)
NAMES = [f"blocks.{i}.{s}" for i in range(N_LAYERS) for s in CONFIG.linear_shapes]
NVFP4 = fp4jax.recipes.nvfp4()
BF16 = fp4jax.recipes.bf16()


@nnx.jit
def _forward(model, tokens_BxT, key=None):
  return model(tokens_BxT, key=key)


def _bf16_names(policy, step=0, total_steps=None):
  recipes = policy.layer_recipes(NAMES, N_LAYERS, step, total_steps)
  assert set(recipes) == set(NAMES)
  assert all(r in (BF16, NVFP4) for r in recipes.values())
  return {name for name, r in recipes.items() if r == BF16}


def _in_blocks(*blocks):
  return {n for n in NAMES if int(n.split(".")[1]) in blocks}


def test_default_policy_quantizes_everything():
  assert _bf16_names(PrecisionPolicy(recipe=NVFP4)) == set()


@pytest.mark.parametrize("kwargs, blocks", [
    (dict(first=2), (0, 1)),
    (dict(last=2), (2, 3)),
    (dict(first=1, last=2), (0, 2, 3)),
    (dict(blocks=(3, 1)), (1, 3)),
    (dict(first=1, blocks=(1, 2), last=1), (0, 1, 2, 3)),
    (dict(first=1, blocks=(2,)), (0, 2)),
    (dict(first=N_LAYERS, last=N_LAYERS), tuple(range(N_LAYERS))),
])
def test_block_selection(kwargs, blocks):
  policy = PrecisionPolicy(recipe="nvfp4", **kwargs)
  assert policy.bf16_blocks(N_LAYERS) == blocks
  assert _bf16_names(policy) == _in_blocks(*blocks)


def test_quantized_layers_are_the_rest_in_order_and_none_under_bf16():
  policy = PrecisionPolicy(recipe="nvfp4", first=1, pattern=r".*mlp\.down")
  bf16 = _bf16_names(policy)
  assert policy.quantized_layers(NAMES, N_LAYERS) == tuple(n for n in NAMES if n not in bf16)
  assert len(policy.quantized_layers(NAMES, N_LAYERS)) == len(NAMES) - len(bf16) > 0
  assert PrecisionPolicy(recipe="nvfp4", first=N_LAYERS).quantized_layers(NAMES, N_LAYERS) == ()
  assert PrecisionPolicy(recipe="bf16").quantized_layers(NAMES, N_LAYERS) == ()


def test_pattern_selection_fullmatch():
  assert _bf16_names(PrecisionPolicy(pattern=r".*mlp\.down")) == {f"blocks.{i}.mlp.down" for i in range(N_LAYERS)}
  assert _bf16_names(PrecisionPolicy(pattern=r"blocks\.(0|1)\..*")) == _in_blocks(0, 1)
  assert _bf16_names(PrecisionPolicy(pattern=r"blocks\.3\.attn\..*", first=1)) == (
      _in_blocks(0) | {f"blocks.3.attn.{s}" for s in "qkvo"})
  # Whole-name matching: a bare "mlp.down" matches nothing, which is an error rather than a silent no-op.
  with pytest.raises(ValueError, match="matches none"):
    PrecisionPolicy(pattern="mlp.down").layer_recipes(NAMES, N_LAYERS)


@pytest.mark.parametrize("switch_at, total, switch_step", [(0.5, 10, 5), (0.82, 1000, 820), (0.29, 100, 29),
                                                          (7, 10, 7), (7, None, 7), (0, 10, 0)])
def test_switch_all_happens_at_requested_step(switch_at, total, switch_step):
  policy = PrecisionPolicy(recipe=NVFP4, last=1, switch_at=switch_at, switch="all")
  assert policy.switch_step(total) == switch_step
  if switch_step > 0:
    assert policy.phase(switch_step - 1, total) == 0
    assert _bf16_names(policy, switch_step - 1, total) == _in_blocks(N_LAYERS - 1)
  assert policy.phase(switch_step, total) == 1
  assert policy.phase(switch_step + 100, total) == 1
  assert _bf16_names(policy, switch_step, total) == set(NAMES)


def test_switch_forward_only():
  policy = PrecisionPolicy(recipe=NVFP4, first=1, switch_at=4, switch="forward")
  before = policy.layer_recipes(NAMES, N_LAYERS, step=3)
  after = policy.layer_recipes(NAMES, N_LAYERS, step=4)
  switched = NVFP4.with_bf16(forward=True, backward=False)
  for name in NAMES:
    if name in _in_blocks(0):
      assert before[name] == after[name] == BF16
    else:
      assert before[name] == NVFP4
      assert after[name] == switched
  assert not switched.fprop.quantized and switched.dgrad.quantized and switched.wgrad.quantized


def test_no_switch_is_phase_zero_forever():
  policy = PrecisionPolicy()
  assert policy.switch_step(100) is None
  assert policy.phase(10**9, 100) == 0


def test_switch_errors():
  with pytest.raises(ValueError, match="total_steps is required"):
    PrecisionPolicy(switch_at=0.8).phase(0)
  with pytest.raises(ValueError, match="never reaches"):
    PrecisionPolicy(switch_at=100).phase(0, 100)
  # A fraction that rounds to step 0 made the whole run BF16 (bit-identical to --recipe bf16), logged as a switch
  # "at 5% of the run"; an int step 0 still says so explicitly.
  with pytest.raises(ValueError, match="rounds to step 0"):
    PrecisionPolicy(switch_at=0.05).switch_step(10)
  assert PrecisionPolicy(switch_at=0.05).switch_step(20) == 1
  # --switch forward without --switch-at was accepted and did nothing.
  with pytest.raises(ValueError, match="set switch_at"):
    PrecisionPolicy(switch="forward")


@pytest.mark.parametrize("kwargs, match", [
    (dict(first=-1), "first"),
    (dict(last=1.5), "last"),
    (dict(blocks=(1, -2)), "blocks"),
    (dict(blocks="1,2"), "blocks"),
    (dict(pattern="blocks.(0"), "not a valid regex"),
    (dict(switch_at=1.0), r"switch_at as a fraction must lie in \(0, 1\); got 1.0. For step 1, write the int 1."),
    (dict(switch_at=100.0), "For step 100, write the int 100"),  # --switch-at 1e2 parses to a float
    (dict(switch_at=2.5), r"got 2.5.$"),
    (dict(switch_at=0.0), "switch_at"),
    (dict(switch_at=-3), "switch_at"),
    (dict(switch_at=True), "switch_at"),
    (dict(switch="backward"), "switch"),
    (dict(recipe="nvfp5"), "Unknown recipe"),
    (dict(recipe=3), "recipe"),
])
def test_bad_policy_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    PrecisionPolicy(**kwargs)


def test_out_of_range_blocks_raise():
  for kwargs in (dict(first=N_LAYERS + 1), dict(last=N_LAYERS + 1), dict(blocks=(N_LAYERS,))):
    with pytest.raises(ValueError, match=f"{N_LAYERS} blocks"):
      PrecisionPolicy(**kwargs).layer_recipes(NAMES, N_LAYERS)


def test_apply_sets_each_layer_recipe():
  model = model_lib.Transformer(CONFIG, recipe=BF16, rngs=nnx.Rngs(0))
  policy = PrecisionPolicy(recipe=NVFP4, first=1, last=1, pattern=r".*attn\.o", switch_at=0.5, switch="forward")
  applied = policy.apply(model, step=0, total_steps=10)
  layers = model.linear_layers()
  assert set(applied) == set(layers)
  bf16_expected = _in_blocks(0, N_LAYERS - 1) | {f"blocks.{i}.attn.o" for i in range(N_LAYERS)}
  for name, layer in layers.items():
    assert layer.recipe == (BF16 if name in bf16_expected else NVFP4), name
  policy.apply(model, step=5, total_steps=10)
  for name, layer in model.linear_layers().items():
    want = BF16 if name in bf16_expected else NVFP4.with_bf16(forward=True, backward=False)
    assert layer.recipe == want, name
  # After a forward-only switch every forward GEMM is BF16: the logits equal the unquantized model's.
  tokens = jax.random.randint(jax.random.key(0), (1, 16), 0, 256)
  reference = model_lib.Transformer(CONFIG, recipe=BF16, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(_forward(model, tokens, jax.random.key(1))),
                                np.asarray(_forward(reference, tokens)))


def test_to_dict_roundtrip_through_json():
  for recipe in ("nvfp4:rht_size=4", fp4jax.recipes.nvfp4(rht_size=4, stochastic_rounding=False),
                 fp4jax.recipes.mxfp4(), fp4jax.recipes.fp8()):
    policy = PrecisionPolicy(recipe=recipe, first=2, last=8, blocks=(5,), pattern=r".*mlp\.down", switch_at=0.82,
                             switch="forward")
    restored = PrecisionPolicy.from_dict(json.loads(json.dumps(policy.to_dict())))
    assert restored == policy
    assert restored.recipe == policy.recipe
  with pytest.raises(ValueError, match="Unknown PrecisionPolicy field"):
    PrecisionPolicy.from_dict({"recipe": "nvfp4", "frist": 2})


def test_policy_from_strings():
  policy = policy_from_strings("nvfp4:stochastic_rounding=false", first="2", last="2", blocks="5, 7-9",
                               pattern=r".*mlp\.down", switch_at="0.82", switch="forward")
  assert policy == PrecisionPolicy(recipe="nvfp4:stochastic_rounding=false", first=2, last=2, blocks=(5, 7, 8, 9),
                                   pattern=r".*mlp\.down", switch_at=0.82, switch="forward")
  assert policy_from_strings("nvfp4", switch_at="8200").switch_at == 8200
  assert policy_from_strings("nvfp4", switch_at="", pattern="").switch_at is None
  assert policy_from_strings("nvfp4", pattern="").pattern is None
  for bad in (dict(blocks="3-1"), dict(blocks="a"), dict(first="x"), dict(switch_at="soon")):
    with pytest.raises(ValueError):
      policy_from_strings("nvfp4", **bad)
  # A huge range was expanded before anything checked it: 3 GB and a 290 MB error message for 0-30000000.
  with pytest.raises(ValueError, match="holds 30000001 indices"):
    policy_from_strings("nvfp4", blocks="0-30000000")
  with pytest.raises(ValueError, match=r"blocks \[2, 3, 4, 5, \.\.\., 999\] \(998 indices\) out of range"):
    policy_from_strings("nvfp4", blocks="2-999").bf16_blocks(2)


def test_describe_mentions_blocks_switch_and_recipe():
  policy = PrecisionPolicy(recipe=NVFP4, first=2, last=8, switch_at=0.82, switch="all")
  text = policy.describe(62, [f"blocks.{i}.{s}" for i in range(62) for s in model_lib.SUBLAYERS])
  assert "[0, 1, 54, 55, 56, 57, 58, 59, 60, 61]" in text
  assert "10 of 62 blocks" in text and "70 of 434" in text
  assert "82%" in text and "all GEMMs" in text and "(step" not in text
  assert NVFP4.table() in text
  assert "Switch: at 82% of the run (step 820 of 1000), all GEMMs" in policy.describe(62, total_steps=1000)
  for at, said in ((0.825, "82.5% of the run (step 165 of 200)"), (0.004, "0.4% of the run (step 1 of 200)"),
                   (0.996, "99.6% of the run (step 199 of 200)")):  # were "82%", "0%" and "100%"
    assert f"Switch: at {said}" in PrecisionPolicy(switch_at=at).describe(4, total_steps=200)


def test_a_switch_on_an_unquantized_recipe_is_described_as_having_no_effect():
  """--recipe bf16 --switch-at 0.5 is accepted (one switch may be set across a sweep's recipes) but said to do nothing."""
  idle = "all GEMMs to BF16 (no effect: the recipe is unquantized)"
  assert idle in PrecisionPolicy(recipe=fp4jax.recipes.bf16(), switch_at=0.5).describe(4, total_steps=10)
  assert "no effect" not in PrecisionPolicy(recipe=NVFP4, switch_at=0.5).describe(4, total_steps=10)


def test_recipe_stored_before_sr_bits_existed_resumes_with_threefry():
  from fp4jax.pretrain import policy as policy_lib  # pylint: disable=g-import-not-at-top
  stored = policy_lib.recipe_to_json(fp4jax.recipes.nvfp4(sr_bits="hash"))
  if isinstance(stored, str):  # presets store their canonical string; rebuild the field-by-field form
    stored = policy_lib._tree_to_json(fp4jax.recipes.nvfp4())  # pylint: disable=protected-access
  old = {k: v for k, v in stored.items() if k != "sr_bits"}
  assert policy_lib.recipe_from_json(old).sr_bits == "threefry"
  assert policy_lib.recipe_from_json(stored).sr_bits == "hash"
  assert policy_lib.recipe_from_json("nvfp4").sr_bits == "hash"
