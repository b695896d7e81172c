"""The rule's randomness derived at once (fp4jax.dot_general.LayerKeys): the same bits as one fold_in per operand.

Each fold_in and each hash seed is a threefry evaluation that XLA compiles into a small kernel of its own; the rule
derives all of a layer call's in one batched evaluation, and a model all of its layers' (fp4jax.pretrain.model).
"""

import collections
import functools
import importlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
dg = importlib.import_module("fp4jax.dot_general")  # the module (fp4jax.dot_general is the function)
from fp4jax import prng
from fp4jax import recipes
from fp4jax import rht

DN = (((1,), (0,)), ((), ()))
# SR of dY (nvfp4), SR of every backward operand (TetraJet-v2), per-call RHT signs, the threefry generator.
RECIPES = ("nvfp4", "tetrajet_v2", "nvfp4:random_signs=per_call", "nvfp4:sr_bits=threefry",
           "quartet2:rht_size=16")


def _inputs():
  k0, k1, k2 = jax.random.split(jax.random.key(1), 3)
  return (jax.random.normal(k0, (64, 64), jnp.float32), jax.random.normal(k1, (64, 48), jnp.float32) * 0.1,
          jax.random.normal(k2, (64, 48), jnp.float32))


def _bits(a):
  """Floats as their bit patterns (so -0 and NaN payloads count); codes and scales as they are."""
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]) if np.issubdtype(a.dtype, np.floating) else a


@jax.jit
def _derive(key):
  return dg.derive_layer_keys(key)


@pytest.mark.parametrize("name", RECIPES)
def test_the_pieces_draw_the_same_bits_from_layer_keys_as_from_the_key(name):
  recipe = recipes.get_recipe(name)
  x, w, dy = _inputs()
  key = jax.random.key(5)

  @jax.jit
  def pieces(key):
    ops = dg.layer_operands(x, w, recipe, key)
    dx, dyq = dg.dgrad(dy, ops.w_dgrad, recipe, key, x.dtype, ops.x_mask)
    dw, dyq_t = dg.wgrad(dy, ops.x_wgrad, recipe, key, x.dtype, ops.w_mask)
    return dg.fprop(ops, recipe), dx, dw, dyq, dyq_t, ops.w_dgrad, ops.x_wgrad

  for got, want in zip(jax.tree.leaves(pieces(_derive(key))), jax.tree.leaves(pieces(key))):
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("name", ["nvfp4", "tetrajet_v2"])
def test_dot_general_takes_layer_keys_with_the_same_result(name):
  x, w, dy = _inputs()
  key = jax.random.key(6)

  @jax.jit
  def run(key):
    y, vjp = jax.vjp(lambda a, b: fp4jax.dot_general(a, b, DN, recipe=name, key=key), x, w)
    return (y, *vjp(dy))

  for got, want in zip(run(_derive(key)), run(key)):
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _random_primitives(jaxpr, counts=None):
  """{primitive name: count} of the PRNG primitives in `jaxpr` and the jaxprs nested in it."""
  counts = collections.Counter() if counts is None else counts
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("random_fold_in", "random_bits", "random_split", "threefry2x32"):
      counts[eqn.primitive.name] += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _random_primitives(sub.jaxpr, counts)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _random_primitives(sub, counts)
  return counts


@pytest.mark.parametrize("name", ["nvfp4", "tetrajet_v2"])
def test_the_rule_derives_its_randomness_in_one_batched_draw(name):
  """One fold_in (all tags) and one seed draw per layer call, however many operands round stochastically (before:
  a fold_in and a seed per operand: 2 + 2 for nvfp4, 4 + 4 for TetraJet-v2); none with the LayerKeys given."""
  x, w, dy = _inputs()
  loss = lambda x, w, key: jnp.sum(fp4jax.dot_general(x, w, DN, recipe=name, key=key) * dy)
  counts = _random_primitives(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w, jax.random.key(0)).jaxpr)
  assert counts["random_fold_in"] == 1 and counts["random_split"] == 0, counts
  # TetraJet-v2's per-call RHT signs are drawn from their key with jax.random (one draw per use of the signs).
  assert counts["random_bits"] == 1 or name == "tetrajet_v2", counts
  given = _random_primitives(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w, _derive(jax.random.key(0))).jaxpr)
  assert given["random_fold_in"] == 0 and (given["random_bits"] == 0 or name == "tetrajet_v2"), given


def test_derive_layer_keys_keeps_leading_axes():
  keys_3x2 = jax.random.split(jax.random.key(2), 6).reshape(3, 2)
  lk = dg.derive_layer_keys(keys_3x2)
  assert lk.keys.shape == (3, 2, 5) and lk.seeds.shape == (3, 2, 5, 2)
  one = dg.derive_layer_keys(keys_3x2[2, 1])
  np.testing.assert_array_equal(jax.random.key_data(lk.keys[2, 1]), jax.random.key_data(one.keys))
  np.testing.assert_array_equal(lk.seeds[2, 1], one.seeds)
  np.testing.assert_array_equal(one.seeds[0], prng.seed_from_key(jax.random.fold_in(keys_3x2[2, 1], 1)))


def test_malformed_layer_keys_are_refused_naming_the_argument():
  x, w, _ = _inputs()
  lk = dg.derive_layer_keys(jax.random.key(0))
  bad = [dg.LayerKeys(lk.keys[:4], lk.seeds[:4]), dg.LayerKeys(lk.keys, lk.seeds.astype(jnp.int32)),
         dg.derive_layer_keys(jax.random.split(jax.random.key(0), 2))]
  for b in bad:
    with pytest.raises(ValueError, match="key: the LayerKeys of one layer call hold keys"):
      fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=b)
  with pytest.raises(ValueError, match="key must be one JAX PRNG key"):
    dg.derive_layer_keys(3)


def test_unsafe_rbg_keys_are_refused_for_layer_streams():
  """unsafe_rbg's fold_in is a XOR (order-free, and folding a value twice cancels), so the chain of fold_ins over
  (step, layer, GEMM tag) gave two layers the same SR bits at every step; its keys are refused for layers."""
  k = jax.random.key(0, impl="unsafe_rbg")
  fold = lambda k, *d: jax.random.key_data(functools.reduce(jax.random.fold_in, d, k))
  np.testing.assert_array_equal(fold(k, 3, 5), fold(k, 5, 3))  # why: not a hash of the order
  x, w, _ = _inputs()
  with pytest.raises(ValueError, match="unsafe_rbg PRNG cannot derive"):
    fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=k)
  with pytest.raises(ValueError, match="unsafe_rbg PRNG cannot derive"):
    dg.derive_layer_keys(k)
  with jax.default_prng_impl("unsafe_rbg"):  # raw key data follows the configured implementation
    with pytest.raises(ValueError, match="unsafe_rbg PRNG cannot derive"):
      dg.derive_layer_keys(jax.random.PRNGKey(0))
  rbg = jax.random.key(0, impl="rbg")
  assert np.all(np.isfinite(np.asarray(fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=rbg))))


def test_raw_rbg_keys_draw_the_signs_their_typed_keys_draw():
  """Raw rbg key data is uint32[4]: it was taken for a sign vector at rht_size=4 (|dW| inf) and refused at 16."""
  with jax.default_prng_impl("rbg"):
    raw = jax.random.PRNGKey(0)
    assert raw.shape == (4,)
    for size in (4, 16):
      np.testing.assert_array_equal(rht.resolve_signs(size, raw),
                                    rht.resolve_signs(size, jax.random.wrap_key_data(raw)))


def test_layer_keys_of_a_raw_rbg_key_are_accepted():
  # check_layer_key took raw key data to be 2 words (threefry's): the LayerKeys of a raw rbg key (4 words) were
  # refused ("got keys (5, 4)") though the raw key itself was taken.
  x = jax.random.normal(jax.random.key(1), (32, 64))
  w = jax.random.normal(jax.random.key(2), (64, 32))
  with jax.default_prng_impl("rbg"):
    raw = jax.random.PRNGKey(0)
    np.testing.assert_array_equal(fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=dg.derive_layer_keys(raw)),
                                  fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=raw))


def test_every_gemm_operand_gets_its_own_random_stream():
  """Dgrad's dY, Wgrad's dY, the RHT signs and the backward weight / activation SR fold distinct tags into the
  layer key: reusing one (a single-digit slip) correlates the rounding of two GEMMs of the same dY."""
  assert len(set(dg._TAGS)) == len(dg._TAGS) == 5
  layer = dg.derive_layer_keys(jax.random.key(0))
  data = np.asarray(jax.random.key_data(layer.keys)).reshape(len(dg._TAGS), -1)
  assert len({row.tobytes() for row in data}) == len(dg._TAGS)
  assert len({row.tobytes() for row in np.asarray(layer.seeds).reshape(len(dg._TAGS), -1)}) == len(dg._TAGS)
