"""Inputs sharded over Explicit mesh axes (`jax.make_mesh`'s default): the same bits as over Auto axes, and the
sharding JAX's own operation would give; plus the guard against silent second derivatives through the rule."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp4jax
from fp4jax import explicit_axes
from fp4jax import outcontrol

quantize_module = sys.modules["fp4jax.quantize"]  # `fp4jax.quantize` is the function
DN = (((1,), (0,)), ((), ()))


def _meshes():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set by tests/conftest.py)")
  return tuple(jax.make_mesh((2, 4), ("data", "model"), axis_types=(t, t)) for t in (AxisType.Explicit,
                                                                                     AxisType.Auto))


def _put(mesh, a, spec):
  return jax.device_put(np.asarray(a), NamedSharding(mesh, spec))


def _operands():
  x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (128, 64), jnp.float32)
  return x, w


def test_make_mesh_default_is_explicit_here():
  """Why this module exists: on the JAX this project runs, make_mesh's default axes are Explicit."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  assert jax.make_mesh((2, 4), ("data", "model")).axis_types == (AxisType.Explicit,) * 2


def test_explicit_axes_finds_only_explicit_sharded_axes():
  explicit, auto = _meshes()
  x, w = _operands()
  assert explicit_axes.explicit_axes(_put(explicit, x, P("data", None))) == ("data",)
  assert explicit_axes.explicit_axes(_put(explicit, x, P())) == ()
  assert explicit_axes.explicit_axes(_put(auto, x, P("data", "model"))) == ()
  assert explicit_axes.explicit_axes(x, np.ones(3), 1.0, None, jax.random.key(0)) == ()
  assert explicit_axes.like((64, 6), NamedSharding(explicit, P("data", "model"))).spec == P("data", None)
  assert explicit_axes.like((), NamedSharding(explicit, P("data", "model"))).spec == P()


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "fp8", "nvfp4:stochastic_rounding=false,rht=false"])
def test_dot_general_and_its_gradients_equal_the_auto_mesh_bits(recipe):
  explicit, auto = _meshes()
  x, w = _operands()
  key = jax.random.key(2)

  def loss(x, w):
    return jnp.sum(jnp.sin(fp4jax.dot_general(x, w, DN, recipe=recipe, key=key)))

  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  (le, ge), (la, ga) = [run(_put(m, x, P("data", None)), _put(m, w, P(None, "model"))) for m in (explicit, auto)]
  assert float(le) == float(la)
  for e, a in zip(ge, ga):
    np.testing.assert_array_equal(np.asarray(e), np.asarray(a))
  assert [g.sharding.spec for g in ge] == [P("data", None), P(None, "model")]  # the operands' own
  y = fp4jax.dot_general(_put(explicit, x, P("data", None)), _put(explicit, w, P(None, "model")), DN,
                         recipe=recipe, key=key)  # eager too: lax.dot_general's output sharding
  assert y.sharding.spec == P("data", "model")


def test_ambiguous_output_sharding_is_jax_error_until_out_sharding_is_given():
  """Both operands sharded along the contraction: lax.dot_general asks for out_sharding, and so do we."""
  explicit, _ = _meshes()
  x, w = _operands()
  xs, ws = _put(explicit, x, P(None, "model")), _put(explicit, w, P("model", None))
  with pytest.raises(Exception, match="out_sharding"):
    fp4jax.dot_general(xs, ws, DN, recipe="nvfp4", key=jax.random.key(2))
  y = fp4jax.dot_general(xs, ws, DN, recipe="nvfp4", key=jax.random.key(2), out_sharding=P("data", None))
  ref = fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(2))
  assert y.sharding.spec == P("data", None)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-4)  # a psum's summation order


@pytest.mark.parametrize("name", ["fake_quant_2d", "fake_quant_sr", "quantize_dequantize", "quantize_elements",
                                  "rht", "rht_signs_key"])
def test_elementwise_entry_points_equal_the_auto_mesh_bits_and_keep_the_input_sharding(name):
  explicit, auto = _meshes()
  _, w = _operands()
  key = jax.random.key(3)
  fn = {
      "fake_quant_2d": lambda w: fp4jax.fake_quant(w, "nvfp4", block_2d=True),
      "fake_quant_sr": lambda w: fp4jax.fake_quant(w, "nvfp4", rounding="stochastic", key=key),
      "quantize_dequantize": lambda w: fp4jax.dequantize(fp4jax.quantize(w, "nvfp4", axis=0)),
      "quantize_elements": lambda w: quantize_module.quantize_elements(w, "mxfp4", axis=0)[0],
      "rht": lambda w: fp4jax.random_hadamard(w, size=16, axis=0),
      "rht_signs_key": lambda w: fp4jax.random_hadamard(w, size=16, axis=1, signs=key),
  }[name]
  for call in (fn, jax.jit(fn)):
    e, a = call(_put(explicit, w, P(None, "model"))), call(_put(auto, w, P(None, "model")))
    np.testing.assert_array_equal(np.asarray(e), np.asarray(a))
    assert e.sharding.spec == P(None, "model")


def test_qarray_leaves_keep_the_sharding_that_divides_them():
  explicit, _ = _meshes()
  _, w = _operands()
  q = jax.jit(lambda w: fp4jax.quantize(w, "nvfp4", axis=0))(_put(explicit, w, P("data", "model")))
  assert (q.codes.sharding.spec, q.scales.sharding.spec, q.amax.sharding.spec) == (
      P("data", "model"), P("data", "model"), P())
  q = jax.jit(lambda w: fp4jax.quantize(w, "nvfp4", axis=0))(_put(explicit, w[:16, :8], P("data", "model")))
  assert (q.codes.sharding.spec, q.scales.sharding.spec) == (P("data", "model"), P(None, "model"))  # 1 x 8 scales
  np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q)), np.asarray(fp4jax.fake_quant(w[:16, :8], "nvfp4",
                                                                                               axis=0)))


def test_fake_quant_gradient_under_explicit_axes():
  explicit, _ = _meshes()
  _, w = _operands()
  g = jax.jit(jax.grad(lambda w: jnp.sum(fp4jax.fake_quant(w, "nvfp4") ** 2)))(_put(explicit, w, P(None, "model")))
  np.testing.assert_array_equal(np.asarray(g), 2 * np.asarray(fp4jax.fake_quant(w, "nvfp4")))
  assert g.sharding.spec == P(None, "model")


def test_flax_linear_with_injected_dot_general_under_explicit_axes():
  explicit, _ = _meshes()
  x, _ = _operands()
  layer = nnx.Linear(128, 64, rngs=nnx.Rngs(0),
                     dot_general=fp4jax.quantized_dot_general("nvfp4:stochastic_rounding=false,rht=false"))
  ref = layer(x)
  with jax.set_mesh(explicit):
    xs = _put(explicit, x, P("data", None))
    y = nnx.jit(lambda m, x: m(x))(layer, xs)
    y_out = layer(xs, out_sharding=P("data", "model"))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  assert y.sharding.spec == P("data", None) and y_out.sharding.spec == P("data", "model")


# --- second derivatives ---------------------------------------------------------------------------------------------

def _hvp(recipe, x, w, v):
  f = lambda a: 0.5 * jnp.sum(fp4jax.dot_general(a, w, DN, recipe=recipe, key=jax.random.key(2)) ** 2)
  return jax.grad(lambda a: jnp.sum(jax.grad(f)(a) * v))(x)


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4:stochastic_rounding=false,rht=false", "mxfp4", "fp8"])
def test_second_derivatives_through_a_quantized_gemm_are_refused_not_zero(recipe):
  x, w = _operands()
  v = jax.random.normal(jax.random.key(4), x.shape)
  with pytest.raises(NotImplementedError, match="second derivative"):
    _hvp(recipe, x, w, v)
  with pytest.raises(NotImplementedError, match="second derivative"):  # forward over reverse
    jax.jvp(jax.grad(lambda a: jnp.sum(fp4jax.dot_general(a, w, DN, recipe=recipe, key=jax.random.key(2)) ** 2)),
            (x,), (v,))
  with pytest.raises(NotImplementedError, match="second derivative"):  # a linear loss: dY is a constant
    jax.grad(lambda w: jnp.sum(jax.grad(
        lambda a: jnp.sum(fp4jax.dot_general(a, w, DN, recipe=recipe, key=jax.random.key(2))))(x) * v))(w)


def test_second_derivatives_of_bf16_and_first_derivatives_of_quantized_gemms_still_work():
  x, w = _operands()
  v = jax.random.normal(jax.random.key(4), x.shape)
  np.testing.assert_allclose(np.asarray(_hvp("bf16", x, w, v)), np.asarray(v @ w @ w.T), rtol=1e-4, atol=1e-3)
  f = jax.checkpoint(lambda x, w: jnp.sum(fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(2)) ** 2))
  assert np.isfinite(float(jnp.sum(jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)[1])))
  g = jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None))(jnp.stack([x, x]), w)
  np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(g[1]))


def test_outcontrol_refuses_second_derivatives_and_bad_known_indices():
  x, w = _operands()
  idx = jnp.asarray([3, 70])
  f = lambda a: jnp.sum(outcontrol.dot_general(a, w, DN, recipe="nvfp4", key=jax.random.key(2), outliers=idx) ** 2)
  assert np.isfinite(float(jnp.sum(jax.grad(f)(x))))
  with pytest.raises(NotImplementedError, match="second derivative"):
    jax.grad(lambda a: jnp.sum(jax.grad(f)(a)))(x)
  for bad, why in (([5, 5], "distinct"), ([-1, 4], r"\[0, K"), ([3, 128], r"\[0, K")):
    with pytest.raises(ValueError, match=why):
      outcontrol.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(2), outliers=jnp.asarray(bad))
  traced = jax.jit(lambda i: outcontrol.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(2), outliers=i))
  np.testing.assert_array_equal(np.asarray(traced(idx)), np.asarray(
      outcontrol.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(2), outliers=idx)))


def test_outcontrol_under_explicit_axes_equals_the_auto_mesh_bits():
  explicit, auto = _meshes()
  x, w = _operands()
  idx = jnp.asarray([3, 70])

  def loss(x, w):
    return jnp.sum(jnp.sin(outcontrol.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(2), outliers=idx)))

  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  (le, ge), (la, ga) = [run(_put(m, x, P("data", None)), _put(m, w, P(None, "model"))) for m in (explicit, auto)]
  assert float(le) == float(la)
  for e, a in zip(ge, ga):
    np.testing.assert_array_equal(np.asarray(e), np.asarray(a))
  assert [g.sharding.spec for g in ge] == [P("data", None), P(None, "model")]


# --- inside jax.shard_map ------------------------------------------------------------------------------------------

def _data_parallel(fn):
  """fn(x, w) under shard_map on an 8-way 'data' mesh: x's rows split, w replicated (plain data parallelism)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((8,), ("data",))
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
  return mesh, mapped


# jaxlib 0.11.2's XLA:CPU segfaults compiling this gradient (the forward compiles; so does the gradient of a BF16
# recipe); a segfault would take the whole test run with it. jaxlib 0.10.x compiles and runs it.
_JAXLIB_0_11_CPU = jax.__version_info__[:2] == (0, 11) and jax.default_backend() == "cpu"


@pytest.mark.skipif(_JAXLIB_0_11_CPU, reason="jaxlib 0.11's XLA:CPU segfaults compiling this gradient")
@pytest.mark.parametrize("gemm", ["dot_general", "outcontrol"])
def test_data_parallel_shard_map_gradients_equal_the_per_shard_ones(gemm):
  # The weight's cotangent varies over 'data' (each shard's dW) while the weight does not: the custom_vjp rule
  # refused it ("Custom VJP bwd rule must produce an output with the same type"), and before that the forward
  # failed in a platform_dependent whose branches varied differently. lax.dot_general widens its operands to vary
  # alike and sums the replicated one's cotangent; so does fp4jax now.
  recipe, key = "nvfp4:stochastic_rounding=false", jax.random.key(3)
  x, w = _operands()
  if gemm == "dot_general":
    fn = lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key)
  else:
    fn = lambda x, w: outcontrol.dot_general(x, w, DN, recipe=recipe, key=key, outliers=jnp.asarray([5, 70]))
  mesh, mapped = _data_parallel(fn)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
  with jax.set_mesh(mesh):
    y = jax.jit(mapped)(_put(mesh, x, P("data")), _put(mesh, w, P()))
    grads = jax.jit(jax.grad(loss(mapped), (0, 1)))(_put(mesh, x, P("data")), _put(mesh, w, P()))
  shards = [slice(8 * i, 8 * (i + 1)) for i in range(8)]
  per_shard = jax.jit(jax.grad(lambda x, w: sum(loss(fn)(x[s], w) for s in shards), (0, 1)))(x, w)
  np.testing.assert_array_equal(y, jnp.concatenate([fn(x[s], w) for s in shards]))
  np.testing.assert_array_equal(grads[0], per_shard[0])  # each shard's dx is its own
  np.testing.assert_allclose(grads[1], per_shard[1], rtol=1e-5, atol=1e-5)  # dW: the sum over shards, reordered
  assert float(jnp.max(jnp.abs(grads[1]))) > 0


def test_partial_manual_shard_map_with_an_explicit_model_axis():
  # auto_axes made every mesh axis Auto, the Manual 'data' one too: "Going from Manual AxisType to Auto or
  # Explicit AxisType is not allowed". Only the Explicit axes are made Auto now.
  explicit, _ = _meshes()
  x, w = _operands()
  recipe = "nvfp4:stochastic_rounding=false"
  fn = lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe)
  mapped = jax.shard_map(fn, mesh=explicit, in_specs=(P("data"), P()), out_specs=P("data"), axis_names={"data"})
  with jax.set_mesh(explicit):
    y = jax.jit(mapped)(_put(explicit, x, P("data")), _put(explicit, w, P(None, "model")))
  assert y.sharding.spec == P("data", "model")
  np.testing.assert_array_equal(y, jnp.concatenate([fn(x[:32], w), fn(x[32:], w)]))


def test_pallas_backend_inside_shard_map_falls_back_to_the_xla_path_with_a_warning():
  x, w = _operands()
  key = jax.random.key(3)
  fn = lambda recipe: (lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key))
  mesh, pallas = _data_parallel(fn("nvfp4:backend=pallas,stochastic_rounding=false"))
  _, xla = _data_parallel(fn("nvfp4:stochastic_rounding=false"))
  with jax.set_mesh(mesh), pytest.warns(UserWarning, match="inside jax.shard_map.*using the XLA path"):
    got = jax.jit(pallas)(_put(mesh, x, P("data")), _put(mesh, w, P()))
  with jax.set_mesh(mesh):
    np.testing.assert_array_equal(got, jax.jit(xla)(_put(mesh, x, P("data")), _put(mesh, w, P())))


def test_like_keeps_a_multi_axis_entry_only_where_the_product_of_its_sizes_divides():
  explicit, _ = _meshes()
  both = NamedSharding(explicit, P(("data", "model"), None))  # 2 x 4 = 8 shards along axis 0
  assert explicit_axes.like((16, 3), both).spec == P(("data", "model"), None)
  assert explicit_axes.like((4, 3), both).spec == P(None, None)  # 4 rows: divisible by "data" alone, not by 8
