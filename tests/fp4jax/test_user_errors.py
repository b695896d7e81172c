"""Clear errors for user mistakes: a seed int where a PRNG key belongs, hand-edited QArrays, float16 in the RHT."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes

X_MxK = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)), jnp.float32)
W_KxN = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)), jnp.float32)
DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("bad", [1, 1.5, "key", np.zeros(2, np.float32), jax.random.split(jax.random.key(0), 2)])
@pytest.mark.parametrize("call", ["quantize", "fake_quant", "dot_general", "dot_general_bf16", "fixed_key"])
def test_a_non_key_is_a_value_error_naming_the_argument(call, bad):
  name = "fixed_key_every_call" if call == "fixed_key" else "key"
  with pytest.raises(ValueError, match=f"{name} must be one JAX PRNG key"):
    if call == "quantize":
      fp4jax.quantize(X_MxK, "nvfp4", rounding="stochastic", key=bad)
    elif call == "fake_quant":
      fp4jax.fake_quant(X_MxK, "nvfp4", rounding="stochastic", key=bad)
    elif call == "dot_general":
      fp4jax.dot_general(X_MxK, W_KxN, DN, recipe="nvfp4", key=bad)
    elif call == "dot_general_bf16":  # even where the key would go unused
      fp4jax.dot_general(X_MxK, W_KxN, DN, recipe="bf16", key=bad)
    else:
      fp4jax.quantized_dot_general("nvfp4", fixed_key_every_call=bad)


def test_keys_of_both_kinds_are_accepted():
  for key in (jax.random.key(0), jax.random.PRNGKey(0)):
    a = fp4jax.quantize(X_MxK, "nvfp4", rounding="stochastic", key=key)
    assert fp4jax.dequantize(a).shape == X_MxK.shape
  with pytest.raises(ValueError, match="signs"):
    fp4jax.random_hadamard(X_MxK, signs=1)


def test_random_hadamard_names_a_bad_dtype_or_axis_itself():
  """float64 (under jax_enable_x64) was refused by an internal helper's message, and axis=True ran as axis 1."""
  with jax.enable_x64(True):
    with pytest.raises(ValueError, match="random_hadamard takes .* got dtype float64"):
      fp4jax.random_hadamard(jnp.ones((4, 32), jnp.float64))
  for axis in (True, 1.0):
    with pytest.raises(ValueError, match="axis must be an int"):
      fp4jax.random_hadamard(X_MxK, axis=axis)


def test_quantized_dot_general_refuses_sr_without_a_key_per_call():
  fn = fp4jax.quantized_dot_general(recipes.nvfp4())
  with pytest.raises(ValueError, match="fresh key on every call"):
    fn(X_MxK, W_KxN, DN)
  with pytest.raises(ValueError, match="no longer closes over a key"):
    fp4jax.quantized_dot_general(recipes.nvfp4(), jax.random.key(0))
  key = jax.random.key(7)
  np.testing.assert_array_equal(fn(X_MxK, W_KxN, DN, key=key),
                                fp4jax.dot_general(X_MxK, W_KxN, DN, recipe=recipes.nvfp4(), key=key))
  # Round-to-nearest recipes need no key.
  rn = recipes.nvfp4(stochastic_rounding=False)
  np.testing.assert_array_equal(fp4jax.quantized_dot_general(rn)(X_MxK, W_KxN, DN),
                                fp4jax.dot_general(X_MxK, W_KxN, DN, recipe=rn))


def _edits(q):
  """(description, edited QArray, expected message fragment) for one well-formed QArray."""
  codes, scales = q.codes, q.scales
  yield "float codes", dataclasses.replace(q, codes=codes.astype(jnp.float32)), "codes must be"
  yield "codes shape", dataclasses.replace(q, codes=codes[:, :-1]), "codes must be"
  yield "scales dtype", dataclasses.replace(q, scales=scales.astype(jnp.bfloat16)), "scales must be"
  yield "scales shape", dataclasses.replace(q, scales=scales.reshape(-1)), "scales must be"
  yield "amax shape", dataclasses.replace(q, amax=jnp.ones((2,), jnp.float32)), "amax must be"
  yield "orig_shape", dataclasses.replace(q, orig_shape=(64, 64)), "orig_shape"
  yield "shape", dataclasses.replace(q, shape=(q.shape[0], q.shape[1] + 8)), "block size"
  yield "axis", dataclasses.replace(q, axis=2), "axis must be"
  yield "dtype", dataclasses.replace(q, dtype=jnp.dtype(jnp.int32)), "dtype must be"
  yield "fmt", dataclasses.replace(q, fmt="nvfp4"), "fmt must be"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "fp8_tensor"])
def test_dequantize_names_the_bad_field(fmt):
  q = fp4jax.quantize(X_MxK, fmt, axis=-1, pad=True)
  fp4jax.dequantize(q)  # the untouched QArray is fine
  for what, bad, match in _edits(q):
    if fmt == "fp8_tensor" and what in ("scales shape", "shape"):
      continue  # one () scale: nothing to reshape; no blocks to divide
    with pytest.raises(ValueError, match=match):
      fp4jax.dequantize(bad)
      pytest.fail(what)


def test_float16_rht_does_not_overflow():
  """Mixing 16 values near float16's max grows some by up to 4x: the result comes back float32, exact."""
  signs = np.asarray(fp4jax.rht.default_signs(16), np.float32)
  x16 = jnp.asarray(np.stack([30000 * signs, -20000 * signs, np.full(16, 1000.0)]), jnp.float16)  # row 0 -> 120000
  y = fp4jax.random_hadamard(x16)
  assert y.dtype == jnp.float32
  h = np.asarray(fp4jax.hadamard_matrix(16), np.float64)
  np.testing.assert_allclose(np.asarray(y), np.asarray(x16, np.float64) @ h, rtol=1e-6)
  assert np.abs(np.asarray(y)).max() > np.finfo(np.float16).max  # it would have overflowed in float16
  back = fp4jax.random_hadamard(y, inverse=True)
  np.testing.assert_allclose(np.asarray(back), np.asarray(x16, np.float32), rtol=1e-6)


def test_float16_linear_layer_gradients_stay_finite():
  """A float16 layer under NVFP4 whose activations line up with the RHT signs along tokens: Wgrad's RHT grows them
  4x past float16's range (inf, then NaN gradients before the fix), although dW itself is small."""
  signs = np.asarray(fp4jax.rht.default_signs(16), np.float32)
  noise = 1 + 0.05 * np.random.default_rng(2).random((32, 64))
  x16 = jnp.asarray(20000 * np.tile(signs, 2)[:, None] * noise, jnp.float16)
  w16 = (W_KxN * 1e-3).astype(jnp.float16)
  f = lambda x, w: fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(0))
  dy = jnp.full((x16.shape[0], w16.shape[1]), 1e-2, jnp.float16)

  @jax.jit  # one compilation, not op-by-op eager dispatch
  def fwd_and_grads(x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  y, dx, dw = fwd_and_grads(x16, w16, dy)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float16
  dw_exact = np.asarray(x16, np.float64).T @ np.asarray(dy, np.float64)
  assert np.abs(dw_exact).max() < 2000
  rel = np.linalg.norm(np.asarray(dw, np.float64) - dw_exact) / np.linalg.norm(dw_exact)
  assert rel < 0.2, rel  # NVFP4 error, not inf/NaN


def test_recipe_strings_refuse_a_repeated_option_and_take_0_and_1_for_switches():
  with pytest.raises(ValueError, match="'rht_size' is given twice"):
    fp4jax.recipes.get_recipe("nvfp4:rht_size=4,rht_size=8")
  assert fp4jax.recipes.get_recipe("nvfp4:stochastic_rounding=0") == fp4jax.recipes.nvfp4(stochastic_rounding=False)
  assert fp4jax.recipes.get_recipe("nvfp4:rht=1") == fp4jax.recipes.nvfp4()
  with pytest.raises(ValueError, match="RHT size"):  # integers stay integers where the option is not a switch
    fp4jax.recipes.get_recipe("nvfp4:rht_size=1")


def test_quartet2_names_a_non_default_rht_size():
  assert fp4jax.recipes.get_recipe("quartet2").name == "quartet2"
  assert fp4jax.recipes.get_recipe("quartet2:rht_size=32").name == "quartet2-rht32"
  assert fp4jax.recipes.get_recipe("quartet2:rht_size=32,four_over_six=true").name == "quartet2+4over6-rht32"


def test_a_recipe_name_assigned_to_a_built_layer_is_resolved():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  layer = fp4jax.nn.Linear(32, 32, recipe="nvfp4:stochastic_rounding=false", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (16, 32))
  layer.recipe = "bf16"
  built_bf16 = fp4jax.nn.Linear(32, 32, recipe="bf16", rngs=nnx.Rngs(0))  # the same kernel
  np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(built_bf16(x)))


def test_an_empty_batch_gives_lax_empty_result_and_gradients():
  x = jnp.zeros((0, 64), jnp.float32)
  y = fp4jax.dot_general(x, W_KxN, DN, recipe="nvfp4", key=jax.random.key(0))
  assert y.shape == (0, 32) and y.dtype == jnp.float32
  gx, gw = jax.grad(lambda x, w: jnp.sum(fp4jax.dot_general(x, w, DN, recipe="nvfp4", key=jax.random.key(0))),
                    argnums=(0, 1))(x, W_KxN)
  assert gx.shape == (0, 64) and not np.any(np.asarray(gw))


def test_a_misspelt_keyword_of_a_dot_general_stand_in_is_a_type_error():
  """As lax.dot_general / jnp.einsum raise: a swallowed `preferred_elment_type=` would silently keep float32."""
  from fp4jax import nn as fp4_nn  # pylint: disable=g-import-not-at-top
  bf16 = {"preferred_elment_type": jnp.bfloat16}
  with pytest.raises(TypeError, match="preferred_elment_type"):
    fp4jax.quantized_dot_general("nvfp4")(X_MxK, W_KxN, DN, key=jax.random.key(0), **bf16)
  with pytest.raises(TypeError, match="preferred_elment_type"):
    fp4_nn.QuantizedDotGeneral(recipes.nvfp4(rht=False, stochastic_rounding=False), "layer")(X_MxK, W_KxN, DN, **bf16)
  with pytest.raises(TypeError, match="optimize"):
    fp4_nn.QuantizedEinsum(recipes.nvfp4(rht=False, stochastic_rounding=False), "layer")("mk,kn->mn", X_MxK, W_KxN, optimize=False)
  right = fp4_nn.QuantizedDotGeneral(recipes.nvfp4(rht=False, stochastic_rounding=False), "layer")(X_MxK, W_KxN, DN,
                                                                               preferred_element_type=jnp.bfloat16)
  assert right.dtype == jnp.bfloat16


@pytest.mark.parametrize("field", ["block_2d", "rht", "pad", "requantize", "clip_mask"])
def test_operand_flags_refuse_strings(field):
  """dataclasses.replace(op, rht="false") switched the RHT on (a truthy string), under a name that said it was off."""
  op = recipes.nvfp4(rht=False).wgrad.lhs
  with pytest.raises(ValueError, match=f"{field} must be True or False; got 'false'"):
    dataclasses.replace(op, **{field: "false"})
  with pytest.raises(ValueError, match="rounding must be one of"):
    dataclasses.replace(op, rounding="sr")
  with pytest.raises(ValueError, match="fmt must be a fp4jax Format"):
    dataclasses.replace(op, fmt="nvfp4")


def test_recipe_flags_refuse_strings():
  with pytest.raises(ValueError, match="reuse_fprop_weight must be True or False"):
    recipes.nvfp4().replace(reuse_fprop_weight="false")
  numpy_false = recipes.nvfp4().replace(reuse_fprop_weight=np.bool_(False))
  assert numpy_false.reuse_fprop_weight is False and numpy_false.name == "nvfp4+reuse_fprop_weight=False"
  assert dataclasses.replace(recipes.nvfp4().wgrad.lhs, rht=np.bool_(True)).rht is True  # stored as a plain bool


def test_random_hadamard_refuses_a_string_inverse():
  with pytest.raises(ValueError, match="inverse must be True or False; got 'False'"):
    fp4jax.random_hadamard(X_MxK, inverse="False")
  np.testing.assert_array_equal(fp4jax.random_hadamard(fp4jax.random_hadamard(X_MxK), inverse=np.bool_(True)),
                                fp4jax.random_hadamard(fp4jax.random_hadamard(X_MxK), inverse=True))
