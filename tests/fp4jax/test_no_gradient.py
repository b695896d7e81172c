"""fp4jax.no_gradient: the quantizers refuse reverse-mode gradients (a TypeError naming the function) instead of
silently giving zeros, while paths without a cotangent (has_aux statistics, stop_gradient inputs) run unchanged."""

import importlib
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax

quantize_lib = importlib.import_module("fp4jax.quantize")  # the attribute fp4jax.quantize is the function

CASES = {
    "nvfp4": dict(fmt="nvfp4"),
    "nvfp4 2d": dict(fmt="nvfp4", block_2d=True),
    "nvfp4 sr": dict(fmt="nvfp4", rounding="stochastic", key=jax.random.key(3)),
    "mxfp4": dict(fmt="mxfp4"),
    "fp8": dict(fmt="fp8", pad=True),
}

# Each public quantizer, reduced to the float outputs a caller would differentiate through.
QUANTIZERS = {
    "fp4jax.quantize": lambda x, kw: fp4jax.dequantize(fp4jax.quantize(x, **kw)),
    "fp4jax.quantize_with_clip_mask": lambda x, kw: fp4jax.dequantize(fp4jax.quantize_with_clip_mask(x, **kw)[0]),
    "fp4jax.quantize.quantize_elements": lambda x, kw: quantize_lib.quantize_elements(x, **kw)[0],
    "amax of fp4jax.quantize": lambda x, kw: fp4jax.quantize(x, **kw).amax,
}


def _x(shape=(32, 64), seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_grad_through_a_quantizer_raises_naming_it(name, case):
  fn, kw = QUANTIZERS[name], CASES[case]
  loss = lambda x: jnp.sum(fn(x, kw))
  expected = re.escape(name.split()[-1])
  with pytest.raises(TypeError, match=f"^{expected} has no gradient.*fake_quant"):
    jax.grad(loss)(_x())


def test_under_jit_vmap_and_value_and_grad_too():
  loss = lambda x: jnp.sum(fp4jax.dequantize(fp4jax.quantize(x, "nvfp4")))
  for transform in (lambda f: jax.jit(jax.grad(f)), lambda f: jax.vmap(jax.grad(f)), jax.value_and_grad):
    with pytest.raises(TypeError, match="fp4jax.quantize has no gradient"):
      transform(loss)(_x((4, 32, 16)))
  with jax.disable_jit(), pytest.raises(TypeError, match="fp4jax.quantize has no gradient"):
    jax.grad(loss)(_x((32, 16)))  # op by op: x is still a tracer of the differentiation


def test_statistics_returned_as_aux_and_stop_gradient_inputs_run_as_before():
  """No cotangent reaches the quantizer: the gradient is the rest of the loss's, the statistics their own values."""
  x = _x()
  quadratic = lambda x: jnp.sum(x * x)

  def with_stats(x):
    q = fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(1))
    return quadratic(x), (q.amax, fp4jax.quantization_error(x, "nvfp4"))

  grads, (amax, err) = jax.jit(jax.grad(with_stats, has_aux=True))(x)
  np.testing.assert_array_equal(np.asarray(grads), np.asarray(jax.grad(quadratic)(x)))
  assert float(amax) == float(jnp.max(jnp.abs(x)))
  assert float(err) == float(fp4jax.quantization_error(x, "nvfp4"))
  stopped = jax.grad(lambda x: jnp.sum(fp4jax.dequantize(fp4jax.quantize(jax.lax.stop_gradient(x), "nvfp4"))))(x)
  np.testing.assert_array_equal(np.asarray(stopped), 0.0)


def _instructions(compiled_text):
  """The compiled HLO's instructions without their source metadata (file and line tables, op names)."""
  text = compiled_text.split("FileNames")[0]
  return re.sub(r", metadata=\{[^}]*\}", "", text)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_forward_is_the_body_itself(fmt):
  """The wrappers add no computation: quantize compiles to the jitted body's program, instruction for instruction,
  and dequantize to the program without the tie to amax; the bits agree under jit and eagerly."""
  x, key = _x(), jax.random.key(7)
  settings = dict(fmt=fp4jax.get_format(fmt), axis=1, block_2d=False, rounding="stochastic", random_bits=32,
                  pad=False, sr_bits="hash", clip_mask=False)
  body = lambda x: quantize_lib._quantize_jit(x, key, **settings)[0]  # pylint: disable=protected-access
  public = lambda x: fp4jax.quantize(x, fmt, rounding="stochastic", key=key)
  compiled = lambda f, *args: _instructions(jax.jit(f).lower(*args).compile().as_text())
  assert compiled(public, x) == compiled(body, x)
  for q in (public(x), jax.jit(public)(x)):
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(body(x))):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

  q = public(x)
  tied = compiled(fp4jax.dequantize, q)
  jax.clear_caches()
  with mock.patch.object(quantize_lib, "_tied_to", lambda values, amax: values):
    untied = compiled(fp4jax.dequantize, q)
  jax.clear_caches()
  assert tied == untied


def test_forward_mode_is_refused_by_jax():
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda x: fp4jax.quantize(x, "nvfp4").amax, (_x(),), (_x(seed=1),))


def test_the_quantized_gemm_and_fake_quant_still_differentiate():
  """The library's differentiable forms are untouched: the GEMM's custom_vjp quantizes inside its rule, fake_quant
  passes the cotangent straight through."""
  x, w = _x((32, 64)), _x((64, 32), seed=1)
  recipe = fp4jax.recipes.nvfp4()
  dims = (((1,), (0,)), ((), ()))
  gx, gw = jax.grad(lambda x, w: jnp.sum(fp4jax.dot_general(x, w, dims, recipe=recipe, key=jax.random.key(0))),
                    argnums=(0, 1))(x, w)
  assert np.all(np.isfinite(np.asarray(gx))) and float(jnp.abs(gw).sum()) > 0
  np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: jnp.sum(fp4jax.fake_quant(x, "nvfp4")))(x)), 1.0)
