"""The quantized GEMM as a researcher's own layers use it: general layouts, dimension numbers, Flax layers' dtypes
and sharding annotations (regressions found by an audit of fp4jax.dot_general, contraction, nn and linen)."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp4jax
from fp4jax import contraction

RNE = "nvfp4:stochastic_rounding=false,rht=false"  # no key needed, no RHT: NVFP4-exact inputs stay exact
DN = (((1,), (0,)), ((), ()))


def _grid(shape, seed):
  """Elements 0 or +-6: every NVFP4 block of them holds its maximum 6 exactly, in any blocking, so the quantized
  GEMM of such operands is the exact GEMM up to float32 rounding (and a wrong layout shows as a large error)."""
  return jnp.asarray(np.random.default_rng(seed).choice([-6.0, 0.0, 6.0], size=shape), jnp.float32)


@pytest.mark.parametrize("equation, x_shape, w_shape", [
    ("kbt,kn->tbn", (32, 2, 8), (32, 16)),  # contracted axis first, output permuted
    ("btdh,hdn->nbt", (2, 8, 8, 4), (4, 8, 16)),  # two contracted axes, paired in the other order
    ("btk,hkd->bdth", (2, 8, 32), (4, 32, 4)),  # kernel contracted on a middle axis, its free axes split
])
def test_linear_einsum_layouts_and_gradients_are_the_exact_einsum_on_representable_inputs(equation, x_shape,
                                                                                          w_shape):
  x, w = _grid(x_shape, 0), _grid(w_shape, 1)
  exact = lambda a, b: jnp.einsum(equation, a, b, precision="highest")
  quant = lambda a, b: contraction.linear_einsum(equation, a, b, recipe=RNE)
  y, vjp = jax.vjp(quant, x, w)
  y_ref, vjp_ref = jax.vjp(exact, x, w)
  dy = _grid(y_ref.shape, 2)
  for got, want in zip((y, *vjp(dy)), (y_ref, *vjp_ref(dy))):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-3)


def test_out_of_range_dimension_numbers_are_refused_not_taken_modulo_the_rank():
  # A square weight: rc=(3,) was taken as 3 % 2 = 1, i.e. silently the transposed weight; lax.dot_general refuses.
  x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
  with pytest.raises(ValueError, match=r"fp4jax.dot_general: rhs axes \[3\] are out of range for rank 2"):
    fp4jax.dot_general(x, w, (((1,), (3,)), ((), ())), recipe=RNE)
  with pytest.raises(ValueError, match=r"lhs axes \[3\] are out of range for rank 2"):
    fp4jax.dot_general(x, w, (((3,), (0,)), ((), ())), recipe=RNE)
  # quantized_dot_general took lhs axis 2 of a square [64, 64] input as axis 0: a silent x^T W.
  qdg = fp4jax.quantized_dot_general(RNE)
  with pytest.raises(ValueError, match=r"quantized_dot_general: lhs contracting axes \[2\] are out of range"):
    qdg(w, w, (((2,), (0,)), ((), ())))
  with pytest.raises(ValueError, match=r"rhs contracting axes \[-3\] are out of range"):
    qdg(w, w, (((1,), (-3,)), ((), ())))
  # Negative axes within range still count from the end.
  np.testing.assert_array_equal(np.asarray(fp4jax.dot_general(x, w, (((-1,), (0,)), ((), ())), recipe=RNE)),
                                np.asarray(fp4jax.dot_general(x, w, DN, recipe=RNE)))


def test_quantized_einsum_layer_keeps_the_out_sharding_it_is_called_with():
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (tests/conftest.py simulates 8)")
  x = jax.random.normal(jax.random.key(0), (8, 64))
  plain = nnx.Einsum("bd,dn->bn", (64, 32), rngs=nnx.Rngs(0))
  quantized = nnx.Einsum("bd,dn->bn", (64, 32), rngs=nnx.Rngs(0))
  fp4jax.quantize_model(quantized, [(".*", RNE)])
  explicit = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(explicit):
    xs = jax.device_put(x, NamedSharding(explicit, P("data", None)))
    want = plain(xs, out_sharding=P("data", "model")).sharding.spec
    y = quantized(xs, out_sharding=P("data", "model"))  # was dropped: P('data', None)
  assert want == P("data", "model") and y.sharding.spec == want
  np.testing.assert_array_equal(np.asarray(y), np.asarray(quantized(x)))
  # Auto axes: the annotation becomes a sharding constraint, as linear_dot_general's does.
  auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  out = NamedSharding(auto, P(None, "model"))
  y = jax.jit(lambda a, b: contraction.linear_einsum("bd,dn->bn", a, b, recipe=RNE, out_sharding=out))(
      x, quantized.kernel[...])
  assert y.sharding.spec == P(None, "model")


def test_dtype_none_infers_the_compute_dtype_as_flax_does():
  # dtype=None is Flax's "promote input and parameters"; x.astype(None) made every such layer compute in float32.
  x = jnp.ones((4, 64), jnp.bfloat16)
  layer = fp4jax.nn.Linear(64, 32, recipe=RNE, dtype=None, param_dtype=jnp.bfloat16, use_bias=True,
                           rngs=nnx.Rngs(0))
  want = nnx.Linear(64, 32, dtype=None, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x).dtype
  assert want == jnp.bfloat16 and layer(x).dtype == want
  assert fp4jax.nn.Linear(64, 32, recipe="bf16", dtype=None, rngs=nnx.Rngs(0))(x).dtype == jnp.float32
  dense = fp4jax.linen.Dense(32, recipe="bf16", dtype=None, param_dtype=jnp.bfloat16)
  params = dense.init(jax.random.key(0), x)
  assert dense.apply(params, x).dtype == linen.Dense(32, dtype=None, param_dtype=jnp.bfloat16,
                                                     use_bias=False).apply(params, x).dtype == jnp.bfloat16
  assert fp4jax.nn.Linear(64, 32, rngs=nnx.Rngs(0))(x.astype(jnp.float32)).dtype == jnp.bfloat16  # default kept


def test_the_layout_refusal_of_dot_general_names_the_entry_point_that_takes_it():
  with pytest.raises(ValueError, match=r"last axis.*quantized_dot_general\(recipe\) takes any linear layer's layout"):
    fp4jax.dot_general(jnp.ones((64, 32)), jnp.ones((64, 16)), (((0,), (0,)), ((), ())), recipe=RNE)


def test_a_compiled_regex_rule_is_refused_saying_to_pass_the_string():
  import re  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"rule 0: pass the regex as a string.*'attn\.\*'"):
    fp4jax.model_quantize.compile_rules([(re.compile(r"attn.*"), "nvfp4")])


def test_linear_takes_out_sharding_as_nnx_linear_does_outcontrol_too():
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (tests/conftest.py simulates 8)")
  x = jax.random.normal(jax.random.key(0), (8, 64))
  layer = fp4jax.nn.Linear(64, 32, recipe=RNE, dtype=jnp.float32, rngs=nnx.Rngs(0))
  explicit = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  want = np.asarray(layer(x))
  for outliers in (None, jnp.asarray([3, 17])):
    layer.outliers = outliers
    with jax.set_mesh(explicit):
      xs = jax.device_put(x, NamedSharding(explicit, P("data", None)))
      y = layer(xs, out_sharding=P("data", "model"))
    assert y.sharding.spec == P("data", "model"), outliers
    if outliers is None:
      np.testing.assert_array_equal(np.asarray(y), want)
