"""Edge cases found by a numerics audit of the public API: each test failed before its fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax


@pytest.mark.parametrize("fmt", ["fp8", "fp8_tensor"])
def test_fp8_tiny_blocks_are_not_nan(fmt):
  # Block amax below 448 / FLT_MAX (~1.3e-36): the encode factor 448 / amax overflowed to inf, and the block's zeros
  # (and flushed subnormals) became inf * 0 = NaN codes, so a finite tensor dequantized to NaN.
  x = np.zeros((2, 128), np.float32)
  x[0, :4] = [1e-37, -5e-38, 2e-38, 0.0]
  x[1, :4] = [1.0, -0.5, 0.0, 0.25] if fmt == "fp8" else [0.0] * 4
  q = fp4jax.quantize(jnp.asarray(x), fmt)
  assert not np.any(np.isnan(np.asarray(q.codes).astype(np.float32)))
  for x_hat in (fp4jax.dequantize(q), fp4jax.fake_quant(jnp.asarray(x), fmt)):
    x_hat = np.asarray(x_hat)
    assert np.all(np.isfinite(x_hat))
    np.testing.assert_array_equal(x_hat[x == 0], 0.0)
    if fmt == "fp8":  # the ordinary block keeps its exact values
      np.testing.assert_array_equal(x_hat[1], x[1])


@pytest.mark.parametrize("scale", [1e-25, 1e20, 1e30])
def test_quantization_error_of_tiny_and_huge_tensors(scale):
  # The float32 norms' squares underflowed to 0 (error reported as 0) or overflowed to inf (NaN); the relative error
  # does not depend on the tensor's magnitude (NVFP4's scales follow it), so it must match the unit-scale one.
  g = np.asarray(np.random.default_rng(0).standard_normal((4, 64)), np.float32)
  want = float(fp4jax.quantization_error(jnp.asarray(g), "nvfp4"))
  got = float(fp4jax.quantization_error(jnp.asarray(g * np.float32(scale)), "nvfp4"))
  assert 0.05 < want < 0.2
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_outcontrol_empty_batch_is_lax_result_as_plain_dot_general():
  # fp4jax.dot_general returns lax's empty result for an empty batch; with outliers it tried to quantize the empty
  # array and raised "cannot quantize an empty array".
  from fp4jax import outcontrol  # pylint: disable=g-import-not-at-top
  w = jnp.ones((64, 32), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  x = jnp.zeros((0, 64), jnp.bfloat16)
  y = outcontrol.dot_general(x, w, dims, recipe="nvfp4", key=jax.random.key(0), outliers=jnp.asarray([1, 2]))
  want = fp4jax.dot_general(x, w, dims, recipe="nvfp4", key=jax.random.key(0))
  assert y.shape == want.shape == (0, 32) and y.dtype == want.dtype


@pytest.mark.parametrize("k", [-70, 70])
def test_four_over_six_choice_does_not_depend_on_the_tensors_magnitude(k):
  # NVFP4 is exactly equivariant under power-of-two scaling of the tensor, so 4/6 should choose the same candidates.
  # The "mse" block errors' squares overflowed to inf (2^70 ~ 1e21) or flushed to 0 (2^-70): every block tied and
  # kept the "6" candidate, as if 4/6 were off.
  x = np.asarray(np.random.default_rng(1).standard_normal((8, 64)), np.float32)
  fmt = fp4jax.NVFP4(scale_rule="4over6")
  s = np.float32(2.0**k)
  want = np.asarray(fp4jax.fake_quant(jnp.asarray(x), fmt))
  got = np.asarray(fp4jax.fake_quant(jnp.asarray(x * s), fmt)) / s
  assert not np.array_equal(want, np.asarray(fp4jax.fake_quant(jnp.asarray(x), "nvfp4")))  # 4/6 does choose "4"
  np.testing.assert_array_equal(got, want)


def test_eden_keeps_the_sign_of_zero_in_zero_scale_blocks():
  # MS-EDEN set the elements of a block whose scale is 0 to +0 (to keep x * FLT_MAX out of the correction's sums), so
  # -0 there came back +0 (code 0), where NVFP4's other rules and every other format give -0 (code 8).
  x = np.zeros((2, 128), np.float32)
  x[0] = np.random.default_rng(0).standard_normal(128)
  x[0, 16:32] = -0.0  # an all -0 block beside ordinary ones
  x[1] = -0.0  # an all -0 row of zero-scale blocks
  for fmt in (fp4jax.NVFP4(), fp4jax.NVFP4(scale_rule="eden")):
    q = jax.jit(lambda t, fmt=fmt: fp4jax.quantize(t, fmt))(jnp.asarray(x))
    for name, got in (("dequantize", fp4jax.dequantize(q)), ("fake_quant", fp4jax.fake_quant(jnp.asarray(x), fmt))):
      got = np.asarray(got)
      np.testing.assert_array_equal(np.signbit(got[x == 0]), np.signbit(x[x == 0]), err_msg=f"{fmt.label} {name}")
    np.testing.assert_array_equal(np.asarray(q.unpacked_codes())[1], 8)
  z = np.full((1, 128), -0.0, np.float32)  # an all -0 tensor (amax 0)
  assert np.all(np.signbit(np.asarray(fp4jax.fake_quant(jnp.asarray(z), fp4jax.NVFP4(scale_rule="eden")))))
