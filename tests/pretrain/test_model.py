"""Tests for fp4jax.pretrain.model: shapes, causality, GQA, RoPE, config validation, quantized fwd+grad, determinism."""

import collections
import dataclasses
import functools
import importlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax.nn
import fp4jax.recipes
from fp4jax.pretrain import model as model_lib

TINY = model_lib.get_model_config("tiny")
ONE_LAYER = dataclasses.replace(TINY, n_layers=1)  # quantized GEMMs compile slowly on CPU: keep them few
F32 = dict(dtype="float32")  # exact comparisons between two models need float32 compute


def _tokens(shape=(2, 32), seed=0, vocab=256):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def _model(config=TINY, recipe=None, seed=0):
  return model_lib.Transformer(config, recipe=recipe, rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, tokens_BxT, key=None):
  return model(tokens_BxT, key=key)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, params, rest, tokens_BxT, key):
  def loss_fn(params):
    logits_BxTxV = nnx.merge(graphdef, params, rest)(tokens_BxT[:, :-1], key=key)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1))
    return loss, logits_BxTxV
  (loss, logits_BxTxV), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, logits_BxTxV, grads


def _loss_and_grads(model, tokens_BxT, key):
  """Next-token loss, logits and parameter gradients, jitted through nnx.split/merge (cached per graphdef)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return _step(graphdef, params, rest, tokens_BxT, key)


def test_forward_shapes_and_dtypes():
  model = _model()
  logits = _forward(model, _tokens())
  assert logits.shape == (2, 32, TINY.vocab_size)
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  # Fresh init: logits near zero, so the initial loss is near log(vocab).
  assert float(jnp.abs(logits).max()) < 10.0


def test_params_are_float32_and_shaped():
  model = _model()
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(params)
  assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)
  for name, layer in model.linear_layers().items():
    sub = name.split(".", 2)[2]
    assert layer.kernel[...].shape == TINY.linear_shapes[sub], name
  assert model.embed.embedding[...].shape == (TINY.vocab_size, TINY.d_model)
  assert model.lm_head.kernel[...].shape == (TINY.d_model, TINY.vocab_size)


def test_linear_layer_names():
  model = _model(dataclasses.replace(TINY, n_layers=3))
  layers = model.linear_layers()
  expected = [f"blocks.{i}.{s}" for i in range(3) for s in model_lib.SUBLAYERS]
  assert list(layers) == expected
  assert all(isinstance(layer, fp4jax.nn.Linear) for layer in layers.values())
  assert layers["blocks.2.mlp.down"] is model.blocks[2].mlp.down
  relu_model = _model(dataclasses.replace(TINY, mlp="squared_relu"))
  assert "blocks.0.mlp.gate" not in relu_model.linear_layers()
  assert len(relu_model.linear_layers()) == 2 * 6


def test_layer_ids_are_distinct_and_stable():
  names = [f"blocks.{i}.{s}" for i in range(40) for s in model_lib.SUBLAYERS]
  ids = [model_lib.layer_id(n) for n in names]
  assert ids == list(range(len(names)))
  assert model_lib.layer_id("blocks.1.attn.q") == 7
  with pytest.raises(ValueError, match="Not a linear layer name"):
    model_lib.layer_id("blocks.1.attn.softmax")


def test_causal():
  model = _model()
  tokens = _tokens((1, 32))
  changed = tokens.at[0, 20].set((tokens[0, 20] + 1) % TINY.vocab_size)
  a, b = _forward(model, tokens), _forward(model, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :20]), np.asarray(b[:, :20]))
  assert not np.allclose(np.asarray(a[:, 20:]), np.asarray(b[:, 20:]))


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa_cfg = dataclasses.replace(TINY, **F32)
  mha_cfg = dataclasses.replace(gqa_cfg, n_kv_heads=gqa_cfg.n_heads)
  gqa, mha = _model(gqa_cfg), _model(mha_cfg, seed=1)
  group, h = gqa_cfg.n_heads // gqa_cfg.n_kv_heads, gqa_cfg.head_dim
  mha_params = nnx.state(mha, nnx.Param)
  gqa_params = nnx.state(gqa, nnx.Param)

  def expand(kernel_DxKH):  # kv head j serves query heads j*group .. j*group+group-1
    d = kernel_DxKH.shape[0]
    return jnp.repeat(kernel_DxKH.reshape(d, -1, h), group, axis=1).reshape(d, -1)

  flat_mha = dict(nnx.to_flat_state(mha_params))
  for path, var in nnx.to_flat_state(gqa_params):
    value = var[...]
    if path[-2] in ("k", "v") and path[-3] == "attn":
      value = expand(value)
    flat_mha[path][...] = value
  nnx.update(mha, nnx.from_flat_state(flat_mha))
  tokens = _tokens()
  np.testing.assert_allclose(np.asarray(_forward(gqa, tokens)), np.asarray(_forward(mha, tokens)), rtol=1e-5, atol=1e-5)


def test_rope_is_relative_and_norm_preserving():
  q = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(2), (1, 1, 1, 16))
  rot = lambda x, p: model_lib.rope(x, jnp.array([p]), 10000.0)[0, 0, 0]
  np.testing.assert_allclose(jnp.dot(rot(q, 7), rot(k, 3)), jnp.dot(rot(q, 14), rot(k, 10)), rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(rot(q, 9)), jnp.linalg.norm(q), rtol=1e-5)
  np.testing.assert_array_equal(rot(q, 0), q[0, 0, 0])
  assert not np.allclose(jnp.dot(rot(q, 7), rot(k, 3)), jnp.dot(rot(q, 8), rot(k, 3)))


@pytest.mark.parametrize("overrides, field", [
    (dict(n_heads=4, n_kv_heads=3), "n_heads"),
    (dict(d_model=72), "d_model"),
    (dict(d_ff=200), "d_ff"),
    (dict(head_dim=3, n_heads=16, n_kv_heads=16), "head_dim"),
    (dict(head_dim=12, n_heads=2, n_kv_heads=1), "n_heads \\* head_dim"),
    (dict(head_dim=24, n_heads=2, n_kv_heads=1), "n_kv_heads \\* head_dim"),
    (dict(mlp="gelu"), "mlp"),
    (dict(n_layers=0), "n_layers"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(dtype="int8"), "dtype"),
    (dict(param_dtype="nonsense"), "param_dtype"),
    (dict(dtype="float64"), "dtype='float64' needs 64-bit JAX"),  # JAX would silently run it as float32
    (dict(param_dtype="float8_e4m3fn"), "param_dtype='float8_e4m3fn': an 8-bit float"),
    (dict(norm_eps=0.0), "norm_eps"),
])
def test_bad_config_raises_naming_field(overrides, field):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    model_lib.get_model_config("tiny", **overrides)


def test_presets_and_overrides():
  for name in model_lib.MODEL_PRESETS:
    assert isinstance(model_lib.get_model_config(name), model_lib.ModelConfig)
  paper = model_lib.get_model_config("paper_1b")
  assert (paper.n_layers, paper.d_model, paper.d_ff, paper.n_heads, paper.n_kv_heads) == (20, 2048, 6144, 16, 8)
  assert model_lib.get_model_config("tiny", n_layers=3).n_layers == 3
  with pytest.raises(ValueError, match=r"Unknown model preset 'huge'; choose from"):
    model_lib.get_model_config("huge")
  with pytest.raises(ValueError, match=r"Unknown model preset 'smal' \(did you mean 'small'\?\); choose from"):
    model_lib.get_model_config("smal")
  with pytest.raises(ValueError, match="Unknown ModelConfig field"):
    model_lib.get_model_config("tiny", n_layer=3)


def test_bad_tokens_raise():
  model = _model()
  with pytest.raises(ValueError, match="max_seq_len"):
    model(_tokens((1, TINY.max_seq_len + 1)))
  with pytest.raises(ValueError, match="integer array"):
    model(jnp.zeros((1, 8), jnp.float32))


def test_recipe_string_is_accepted():
  model = _model(recipe="nvfp4:stochastic_rounding=false")
  assert all(layer.recipe == fp4jax.recipes.nvfp4(stochastic_rounding=False)
             for layer in model.linear_layers().values())


def test_nvfp4_grad_under_jit_is_finite_float32():
  model = _model(ONE_LAYER, recipe=fp4jax.recipes.nvfp4())
  tokens = _tokens((2, 33))
  loss, logits, grads = _loss_and_grads(model, tokens, jax.random.key(0))
  assert np.isfinite(float(loss))
  flat = dict(nnx.to_flat_state(grads))
  assert flat
  for path, g in flat.items():
    g = g[...]
    assert g.dtype == jnp.float32, path
    assert np.isfinite(np.asarray(g)).all(), path
  for name in model.linear_layers():
    path = tuple(int(p) if p.isdigit() else p for p in name.split(".")) + ("kernel",)
    assert float(jnp.abs(flat[path][...]).max()) > 0, name
  # Same weights, only GEMM precision differs: NVFP4 (~15% error per GEMM) moves the logits, but not wildly.
  reference = _forward(_model(ONE_LAYER), tokens[:, :-1])
  rel_err = float(jnp.linalg.norm(logits - reference) / jnp.linalg.norm(reference))
  assert 0.02 < rel_err < 1.0


def test_stochastic_rounding_needs_a_key():
  model = _model(ONE_LAYER, recipe=fp4jax.recipes.nvfp4())
  with pytest.raises(ValueError, match="need randomness"):
    _forward(model, _tokens((1, 16)))
  # Deterministic recipes run without a key.
  _forward(_model(ONE_LAYER, recipe="nvfp4:stochastic_rounding=false"), _tokens((1, 16)))


def test_key_check_reads_a_recipe_assigned_by_name():
  """fp4jax.nn.Linear takes a recipe name assigned after construction; the model's key check reads it too."""
  model = _model(ONE_LAYER)
  layer = next(iter(model.linear_layers().values()))
  layer.recipe = "bf16"
  assert _forward(model, _tokens((1, 16))).shape[:2] == (1, 16)
  layer.recipe = "nvfp4"
  with pytest.raises(ValueError, match="recipe 'nvfp4'.*need randomness"):
    _forward(model, _tokens((1, 16)))


def test_deterministic_per_key_with_stochastic_rounding():
  model = _model(ONE_LAYER, recipe=fp4jax.recipes.nvfp4())
  tokens = _tokens((2, 33))
  loss_a, _, grads_a = _loss_and_grads(model, tokens, jax.random.key(3))
  loss_b, _, grads_b = _loss_and_grads(model, tokens, jax.random.key(3))
  _, _, grads_c = _loss_and_grads(model, tokens, jax.random.key(4))
  assert float(loss_a) == float(loss_b)
  leaves_a, leaves_b, leaves_c = (jax.tree.leaves(g) for g in (grads_a, grads_b, grads_c))
  for a, b in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # SR draws depend on the key: some gradient must change.
  assert any(not np.array_equal(np.asarray(a), np.asarray(c)) for a, c in zip(leaves_a, leaves_c))


def test_remat_matches_plain():
  cfg = dataclasses.replace(TINY, n_layers=1, **F32)
  plain, remat = _model(cfg), _model(dataclasses.replace(cfg, remat=True))
  tokens = _tokens((2, 17))
  loss_p, _, grads_p = _loss_and_grads(plain, tokens, None)
  loss_r, _, grads_r = _loss_and_grads(remat, tokens, None)
  np.testing.assert_allclose(float(loss_p), float(loss_r), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_r)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_block_layer_keys_are_each_layers_own():
  """Row i, column j derives from layer_key(key, "blocks.<i>.<SUBLAYERS[j]>"): the keys the layers always had."""
  dg = importlib.import_module("fp4jax.dot_general")
  for key in (jax.random.key(9), jax.random.PRNGKey(9)):
    lk = model_lib.block_layer_keys(key, 3)
    assert lk.keys.shape == (3, len(model_lib.SUBLAYERS), 5)
    for i in range(3):
      for j, sub in enumerate(model_lib.SUBLAYERS):
        one = dg.derive_layer_keys(model_lib.layer_key(key, f"blocks.{i}.{sub}"))
        np.testing.assert_array_equal(jax.random.key_data(lk.keys[i, j]), jax.random.key_data(one.keys))
        np.testing.assert_array_equal(lk.seeds[i, j], one.seeds)
  assert model_lib.block_layer_keys(None, 3) is None


def test_a_quantized_step_draws_its_randomness_in_three_batched_evaluations():
  """All layers' keys (one fold_in), their per-operand keys (one fold_in) and hash seeds (one draw), whatever the
  depth: each is a small kernel of its own, so one per layer and operand made hundreds per step."""
  model = _model(TINY, recipe=fp4jax.recipes.nvfp4())
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  jaxpr = jax.make_jaxpr(lambda p, t, k: _step.__wrapped__(graphdef, p, rest, t, k))(
      params, _tokens((2, 33)), jax.random.key(0)).jaxpr
  counts = collections.Counter()
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] += eqn.primitive.name.startswith("random_")
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
            walk(getattr(sub, "jaxpr", sub))
  walk(jaxpr)
  assert (counts["random_fold_in"], counts["random_bits"]) == (2, 1), counts


def test_the_rht_size_hint_is_given_only_where_it_suffices():
  """quartet at d_model 48 said "Use rht_size=16 ... Every layer of this model fits rht_size=16", and following it hit
  MXFP4's 32-blocks, which no RHT size fixes: the blocks are named first, without the hint."""
  config = model_lib.get_model_config("tiny", d_model=48)
  with pytest.raises(ValueError, match=r"^Linear layer 'blocks\.0\.attn\.q': fprop lhs: mxfp4 blocks of 32 need K "
                                       r"divisible by 32; got K=48 .* keep this layer in bf16\.$"):
    model_lib.check_layer_recipes(config, fp4jax.recipes.get_recipe("quartet"))
  # The hint's fit is checked against every layer: with 16-blocks it holds and is given.
  with pytest.raises(ValueError, match=r"RHT along K.*Every layer of this model fits rht_size=16\.$"):
    model_lib.check_layer_recipes(config, fp4jax.recipes.get_recipe("nvfp4:rht_on=fprop,rht_size=32"))
  model_lib.check_layer_recipes(config, fp4jax.recipes.get_recipe("nvfp4:rht_on=fprop,rht_size=16"))
  # A preset with options (as a run parses it) is rebuilt from its spec: quartet2's EDEN groups follow the size
  # ("quartet2-rht64" with rht_size replaced alone fails to build, and the hint was lost).
  from fp4jax.pretrain import policy as policy_lib  # pylint: disable=g-import-not-at-top
  for spec in ("quartet2", "quartet2:rht_size=64"):
    with pytest.raises(ValueError, match=r"Every layer of this model fits rht_size=16\.$"):
      model_lib.check_layer_recipes(config, policy_lib.parse_recipe(spec))


def test_transformer_refuses_a_layer_its_recipe_cannot_tile_before_building_anything():
  config = model_lib.get_model_config("tiny")
  recipe = fp4jax.recipes.get_recipe("nvfp4:rht_on=fprop,rht_size=128")
  with pytest.raises(ValueError, match=r"Linear layer 'blocks\.0\.attn\.q': fprop lhs: .*got K=64.*"
                                       r"Every layer of this model fits rht_size=64\."):
    model_lib.Transformer(config, recipe=recipe, rngs=nnx.Rngs(params=0))
  # A per-layer mapping is checked layer by layer: only the layers that get the RHT recipe must fit it.
  names = model_lib.layer_names(config)
  mapping = {name: recipe if name.endswith("mlp.down") else fp4jax.recipes.bf16() for name in names}
  with pytest.raises(ValueError, match=r"Linear layer 'blocks\.0\.mlp\.down': fprop lhs: .*got K=192"):
    model_lib.check_layer_recipes(config, mapping)
  fits = fp4jax.recipes.get_recipe("nvfp4:rht_on=fprop,rht_size=64")  # 64 divides mlp.down's K = d_ff = 192
  model_lib.check_layer_recipes(config, {name: fits if name.endswith("mlp.down") else r for name, r in mapping.items()})
