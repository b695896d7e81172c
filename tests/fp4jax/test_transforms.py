"""The quantizers under JAX transformations: jax.vmap gives every item its own result bit for bit, and fake_quant's
gradient is the straight-through estimator (the identity)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import grids
from fp4jax import prng

B = 6
# Items of very different magnitudes, so that each has its own per-tensor and block scales.
X_BxMxK = (jax.random.normal(jax.random.key(0), (B, 16, 128))
           * jnp.asarray([1.0, 37.0, 1e-3, 0.3, 5e4, 2.0])[:, None, None])
KEYS = jax.random.split(jax.random.key(1), B)

CASES = {
    "nvfp4": dict(fmt="nvfp4"),
    "nvfp4 axis=0": dict(fmt="nvfp4", axis=0),
    "nvfp4 2d": dict(fmt="nvfp4", block_2d=True),
    "nvfp4 sr": dict(fmt="nvfp4", rounding="stochastic"),
    "nvfp4 4over6": dict(fmt=fp4jax.NVFP4(scale_rule="4over6")),
    "mxfp4 sr": dict(fmt="mxfp4", rounding="stochastic"),
    "fp8": dict(fmt="fp8"),
    "mxfp8": dict(fmt="mxfp8"),
}


def _bits(a):
  a = np.atleast_1d(np.asarray(a))
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _with_key(kw, key):
  return dict(kw, key=key) if kw.get("rounding") == "stochastic" else kw


def test_divide_by_constant_is_correctly_rounded_under_vmap():
  # XLA turns a division by a broadcast scalar into a multiplication by the rounded reciprocal; under vmap a divisor
  # built per item is such a broadcast. Half of these quotients would be an ulp off.
  a = np.array(jax.random.uniform(jax.random.key(2), (8, 512), minval=1e-3, maxval=1e4), np.float32)
  a[0, :4] = [0.0, -0.0, np.inf, np.nan]
  want = (a.astype(np.float64) / 2688.0).astype(np.float32)
  for f in (jax.jit(jax.vmap(lambda v: grids.divide_by_constant(v, 2688.0))),
            jax.jit(jax.vmap(lambda v: grids.divide_by_constant(v[0], 2688.0)[None])),  # per-item scalars, as amax
            jax.jit(lambda v: grids.divide_by_constant(v, 2688.0))):
    got = np.asarray(f(jnp.asarray(a)))
    np.testing.assert_array_equal(_bits(got), _bits(want[:, :got.shape[1]]))


@pytest.mark.parametrize("case", CASES)
def test_vmap_quantizes_each_item_as_alone(case):
  kw = CASES[case]
  quantize = lambda x, k: fp4jax.quantize(x, **_with_key(kw, k))
  fake_quant = lambda x, k: fp4jax.fake_quant(x, **_with_key(kw, k))
  q_B = jax.vmap(quantize)(X_BxMxK, KEYS)
  x_hat_B = jax.vmap(fp4jax.dequantize)(q_B)
  fq_B = jax.vmap(fake_quant)(X_BxMxK, KEYS)
  for i in range(B):
    q = quantize(X_BxMxK[i], KEYS[i])
    for field in ("codes", "scales", "amax"):
      np.testing.assert_array_equal(_bits(getattr(q_B, field)[i]), _bits(getattr(q, field)), err_msg=f"{field}[{i}]")
    x_hat = fp4jax.dequantize(q)
    np.testing.assert_array_equal(_bits(x_hat_B[i]), _bits(x_hat), err_msg=f"dequantize[{i}]")
    np.testing.assert_array_equal(_bits(fq_B[i]), _bits(x_hat), err_msg=f"fake_quant[{i}]")


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8", "tetrajet_v2"])
def test_vmap_of_the_quantized_gemm_and_its_gradients_is_each_items(recipe):
  """y and the backward's dx, dW (for a fixed cotangent) of each item, bit for bit. Compared without a loss: XLA sums
  a batched reduction such as sum(y**2) in another order than the item's own (the last bits of the loss differ
  although every y is the same)."""
  w_BxKxN = jax.random.normal(jax.random.key(3), (B, 128, 32))
  ct_BxMxN = jax.random.normal(jax.random.key(4), (B, 16, 32))
  dims = (((1,), (0,)), ((), ()))

  def forward_and_backward(x, w, k, ct):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, dims, recipe=recipe, key=k), x, w)
    return (y,) + vjp(ct)

  got_B = jax.jit(jax.vmap(forward_and_backward))(X_BxMxK[:, :, :128], w_BxKxN, KEYS, ct_BxMxN)
  one = jax.jit(forward_and_backward)
  for i in range(B):
    want = one(X_BxMxK[i, :, :128], w_BxKxN[i], KEYS[i], ct_BxMxN[i])
    for name, got_B_, want_ in zip(("y", "dx", "dw"), got_B, want):
      np.testing.assert_array_equal(_bits(got_B_[i]), _bits(want_), err_msg=f"{recipe} {name}[{i}]")


def test_a_vmapped_qarray_used_outside_vmap_is_refused_with_the_reason():
  q_B = jax.vmap(lambda x: fp4jax.quantize(x, "nvfp4"))(X_BxMxK)
  with pytest.raises(ValueError, match="dequantize it under jax.vmap too"):
    fp4jax.dequantize(q_B)
  assert "codes=(6, 16, 64)" in repr(jax.tree.map(jnp.shape, q_B))  # repr of a tree-mapped QArray works


@pytest.mark.parametrize("case", ["nvfp4", "nvfp4 2d", "nvfp4 sr", "mxfp4 sr", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fake_quant_gradient_is_straight_through(case, dtype):
  kw = _with_key(CASES[case], KEYS[0])
  x = X_BxMxK[0].astype(dtype)
  cot = jax.random.normal(jax.random.key(4), x.shape, dtype)
  f = lambda v: fp4jax.fake_quant(v, **kw)
  y, vjp = jax.vjp(f, x)
  (dx,) = vjp(cot)
  assert dx.dtype == x.dtype
  np.testing.assert_array_equal(_bits(dx), _bits(cot))
  np.testing.assert_array_equal(_bits(y), _bits(f(x)))  # the forward values are the quantizer's
  _, tangent = jax.jvp(f, (x,), (cot,))
  np.testing.assert_array_equal(_bits(tangent), _bits(cot))
  # Under jit, composed: d/dx sum(fake_quant(x) * c) = c.
  g = jax.jit(jax.grad(lambda v: jnp.sum(f(v).astype(jnp.float32) * cot.astype(jnp.float32))))(x)
  np.testing.assert_array_equal(_bits(g), _bits(cot))


def test_fake_quant_with_a_hash_seed_has_the_same_gradient():
  seed = prng.HashSeed(prng.seed_from_key(KEYS[0]))
  x = X_BxMxK[0]
  g = jax.grad(lambda v: jnp.sum(fp4jax.fake_quant(v, "nvfp4", rounding="stochastic", key=seed) * 3.0))(x)
  np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))
