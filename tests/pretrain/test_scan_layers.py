"""ModelConfig.scan_layers: runs of identical blocks as one lax.scan match the loop, group by recipe, fall back to
the loop for layers that write state, keep the parameter tree, and trace a program whose size does not grow with
depth."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax.recipes
from fp4jax.analysis import taps as taps_lib
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain.config import TrainConfig

TINY = model_lib.get_model_config("tiny", max_seq_len=32)


def _model(config, recipe=None, seed=0):
  return model_lib.Transformer(config, recipe=recipe, rngs=nnx.Rngs(seed))


def _tokens(shape=(2, 17)):
  return jax.random.randint(jax.random.key(0), shape, 0, TINY.vocab_size, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, params, rest, tokens_BxT, key):
  def loss_fn(params):
    logits_BxTxV = nnx.merge(graphdef, params, rest)(tokens_BxT, key=key)
    return jnp.mean(jax.nn.logsumexp(logits_BxTxV, axis=-1) - logits_BxTxV[..., 0]), logits_BxTxV

  (loss, logits_BxTxV), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, logits_BxTxV, grads


def _loss_and_grads(model, tokens_BxT, key):
  """A loss, the logits and the parameter gradients, compiled once per graphdef."""
  return _step(*nnx.split(model, nnx.Param, ...), tokens_BxT, key)


def _assert_same_bits(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _count_primitive(jaxpr, name: str) -> int:
  """Equations of primitive `name` in `jaxpr` and its sub-jaxprs (a scan body counts once, as it compiles once)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _count_primitive(sub.jaxpr, name)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _count_primitive(sub, name)
  return count


def _mixed_recipes(config):
  """Block 0 in BF16 (the paper's high-precision first block), the rest in the full NVFP4 recipe."""
  return {name: fp4jax.recipes.get_recipe("bf16" if name.startswith("blocks.0.") else "nvfp4")
          for name in model_lib.layer_names(config)}


def test_scan_matches_the_loop_with_sr_rht_and_a_bf16_first_block():
  """The scan runs the loop's arithmetic with each layer's own keys. XLA may fuse a reduction (an RMSNorm scale's
  gradient) differently in the two programs, so gradients are held to a bound, not to their bits: each leaf's
  distance to the loop's is under 1e-3 of the distance that another key's SR draws make (0 on the CPU measured);
  the final norm and LM head, which no draw reaches, agree to float32 rounding."""
  config = dataclasses.replace(TINY, n_layers=3)
  recipes = _mixed_recipes(config)
  loop = _model(config, recipes)
  scan = _model(dataclasses.replace(config, scan_layers=True), recipes)
  assert model_lib.block_runs(scan.blocks) == [(0, 1), (1, 3)]
  tokens, key = _tokens(), jax.random.key(5)
  loss_l, logits_l, grads_l = _loss_and_grads(loop, tokens, key)
  loss_s, logits_s, grads_s = _loss_and_grads(scan, tokens, key)
  _, _, grads_k = _loss_and_grads(scan, tokens, jax.random.key(6))
  np.testing.assert_allclose(float(loss_s), float(loss_l), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_l), rtol=1e-5, atol=1e-6)
  flat_l, flat_s, flat_k = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (grads_l, grads_s, grads_k))
  for (path, g_l), (_, g_s), (_, g_k) in zip(flat_l, flat_s, flat_k):
    by_key = float(jnp.linalg.norm(g_k - g_l))
    if path[0].key in ("final_norm", "lm_head"):  # above every quantized GEMM: no SR draw reaches them
      assert by_key == 0
      np.testing.assert_allclose(np.asarray(g_s), np.asarray(g_l), rtol=1e-5, atol=1e-7)
    else:
      assert by_key > 0, jax.tree_util.keystr(path)  # the quantized blocks' SR draws reach every block
      assert float(jnp.linalg.norm(g_s - g_l)) <= 1e-3 * by_key, jax.tree_util.keystr(path)


def test_scan_with_remat_matches_the_loop():
  config = dataclasses.replace(TINY, n_layers=2, remat=True, dtype="float32")
  loop, scan = _model(config), _model(dataclasses.replace(config, scan_layers=True))
  tokens = _tokens()
  loss_l, _, grads_l = _loss_and_grads(loop, tokens, None)
  loss_s, _, grads_s = _loss_and_grads(scan, tokens, None)
  np.testing.assert_allclose(float(loss_s), float(loss_l), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_l), jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_traced_program_does_not_grow_with_depth(recipe):
  """One block body per run of identical blocks: the quantized GEMMs traced are those of one block, at any depth
  (XLA compiles what is traced, so this is the compile time's depth dependence, without timing anything)."""
  counts = {}
  for scan in (False, True):
    for n_layers in (2, 4):
      model = _model(dataclasses.replace(TINY, n_layers=n_layers, scan_layers=scan), recipe)
      graphdef, state = nnx.split(model)
      jaxpr = jax.make_jaxpr(lambda s, t, k: nnx.merge(graphdef, s)(t, key=k))(state, _tokens(), jax.random.key(1))
      counts[scan, n_layers] = _count_primitive(jaxpr.jaxpr, "dot_general")
      assert _count_primitive(jaxpr.jaxpr, "scan") == (1 if scan else 0)
  per_block = (counts[False, 4] - counts[False, 2]) // 2
  assert per_block > 0 and counts[True, 2] == counts[True, 4] == counts[False, 2] - per_block  # the body once


def test_blocks_group_by_graphdef():
  config = dataclasses.replace(TINY, n_layers=5, scan_layers=True)
  assert model_lib.block_runs(_model(config).blocks) == [(0, 5)]
  recipes = {name: "nvfp4" if name.startswith(("blocks.1.", "blocks.2.")) else "bf16"
             for name in model_lib.layer_names(config)}
  assert model_lib.block_runs(_model(config, recipes).blocks) == [(0, 1), (1, 3), (3, 5)]
  # A single sub-layer's recipe is enough to split a run (e.g. the policy's pattern on mlp.down).
  recipes = {name: "nvfp4" if name == "blocks.3.mlp.down" else "bf16" for name in model_lib.layer_names(config)}
  assert model_lib.block_runs(_model(config, recipes).blocks) == [(0, 3), (3, 4), (4, 5)]
  # OutControl's outlier channels: the same count stacks, another count cannot.
  model = _model(config)
  for i, k in enumerate((4, 4, 4, 8, 4)):
    model.blocks[i].mlp.down.outliers = nnx.data(jnp.arange(k, dtype=jnp.int32))
  assert model_lib.block_runs(model.blocks) == [(0, 3), (3, 4), (4, 5)]


def test_layers_that_write_state_run_in_the_loop():
  """A scan body's writes would be lost: blocks with recording, RNG-drawing or wrapped layers are not scanned."""
  config = dataclasses.replace(TINY, n_layers=3, scan_layers=True)
  model = _model(config)
  model.blocks[1].mlp.up.record_inputs = True  # OutControl's record phase
  assert model_lib.block_runs(model.blocks) == [(0, 1), (1, 2), (2, 3)]
  model = _model(config)
  for block in model.blocks:  # all alike: the graphdefs agree, so only the recording itself keeps them apart
    block.mlp.up.record_inputs = True
  assert model_lib.block_runs(model.blocks) == [(0, 1), (1, 2), (2, 3)]
  model = _model(config)
  taps_lib.tap_linear_layers(model, (2, 17))
  assert model_lib.block_runs(model.blocks) == [(0, 1), (1, 2), (2, 3)]


def test_taps_capture_the_same_inputs_from_a_scan_layers_model():
  config = dataclasses.replace(TINY, n_layers=2)
  tokens = _tokens()
  loop = taps_lib.capture_inputs(_model(config), tokens, None)
  scan = taps_lib.capture_inputs(_model(dataclasses.replace(config, scan_layers=True)), tokens, None)
  assert list(loop) == list(scan) == list(model_lib.layer_names(config))
  _assert_same_bits(loop, scan)


def test_scan_layers_keeps_the_parameter_tree():
  """Checkpoints, sharding rules and policies address parameters by path: scanning must not stack them."""
  config = dataclasses.replace(TINY, n_layers=3)
  loop, scan = (nnx.state(_model(c), nnx.Param) for c in (config, dataclasses.replace(config, scan_layers=True)))
  assert jax.tree.structure(loop) == jax.tree.structure(scan)
  _assert_same_bits(loop, scan)


def test_scan_layers_option():
  config = TrainConfig.from_options(model="tiny", **{"model.scan_layers": True})
  assert config.model.scan_layers
  assert not TrainConfig.from_options(model="tiny").model.scan_layers
  with pytest.raises(ValueError, match="scan_layers must be a bool"):
    model_lib.get_model_config("tiny", scan_layers="yes")
