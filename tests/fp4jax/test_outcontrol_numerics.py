"""OutControl (fp4jax.outcontrol) and MXFP8 against NumPy float64 references built from tests/reference.py.

Layer y = x W with x [M, K], W [K, N] and a linear loss sum(y * G), so dY = G. With outlier channels I and the rest
R (x_R, W_R: x and W with the outlier channels zeroed), for NVIDIA's recipe with SR and RHT off:
  y        = Q4(x_R, 1x16 along K) @ Q4(W_R, 16x16)       + Q8(x[:, I], along K) @ Q8(W[I], along K)
  dx[:, R] = Q4(G, 1x16 along N)   @ Q4(W_R, 16x16)^T      dx[:, I] = Q8(G, along N) @ Q8(deq Q8(W[I]), along N)^T
  dW[R]    = Q4(x_R, along M)^T    @ Q4(G, along M)        dW[I]    = Q8(deq Q8(x[:, I]), along M)^T @ Q8(G, along M)
Q8 is MXFP8 (E4M3, E8M0 scale per 32, blocks zero-padded). Operands must match bit for bit; the GEMM outputs, which
sum in a different order, to 1e-6 relative.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import outcontrol, recipes
import reference as ref

DN = (((1,), (0,)), ((), ()))
M, K, N = 48, 64, 48
RNE = recipes.nvfp4(stochastic_rounding=False, rht=False, gemm_mode="f32")
# k = 3 (first and last channel, unsorted), k = 33 (gathered channels span two MXFP8 blocks).
IDX = {"k3": [63, 0, 17], "k33": list(range(63, 31, -1)) + [0]}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  x[:, [0, 17, 63]] *= 40.0  # outlier channels, as in real activations
  w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
  g = (rng.standard_normal((M, N)) * 1e-5).astype(np.float32)
  return x, w, g


@functools.partial(jax.jit, static_argnames="recipe")
def _fwd_and_grads(x, w, g, idx, key, recipe):
  y, vjp = jax.vjp(lambda x, w: outcontrol.dot_general(x, w, DN, recipe=recipe, key=key, outliers=idx), x, w)
  return (y,) + vjp(g)


@functools.partial(jax.jit, static_argnames="recipe")
def _split_operand_values(x, w, idx, key, recipe):
  ops = outcontrol.split_operands(x, w, idx, recipe, key)
  got = dict(x_fprop=ops.rest.x_fprop, w_fprop=ops.rest.w_fprop, x_wgrad=ops.rest.x_wgrad, x8=ops.x8, w8=ops.w8,
             w8_dgrad=ops.w8_dgrad, x8_wgrad=ops.x8_wgrad)
  return {name: fp4jax.dequantize(q, jnp.float32) for name, q in got.items()}


def _deq4(t, axis, block_2d=False):
  q = ref.nvfp4_quantize(t, axis=axis, block_2d=block_2d)
  return ref.nvfp4_dequantize(q["codes"], q["scales"], q["amax"], axis=axis, block_2d=block_2d)


def _deq8(t, axis):
  return ref.mxfp8_quantize(t, axis=axis)["values"]


def _reference(x, w, g, idx):
  """The operands and outputs of the split GEMMs, float64 (operands hold float32 values)."""
  keep = np.ones(K, bool)
  keep[idx] = False
  xr, wr = np.where(keep[None], x, 0.0), np.where(keep[:, None], w, 0.0)
  ops = dict(x_fprop=_deq4(xr, 1), w_fprop=_deq4(wr, 0, block_2d=True), x_wgrad=_deq4(xr, 0),
             x8=_deq8(x[:, idx], 1), w8=_deq8(w[idx], 0))
  ops["w8_dgrad"], ops["x8_wgrad"] = _deq8(ops["w8"], 1), _deq8(ops["x8"], 0)
  y = ops["x_fprop"] @ ops["w_fprop"] + ops["x8"] @ ops["w8"]
  dx = _deq4(g, 1) @ ops["w_fprop"].T
  dx[:, idx] = _deq8(g, 1) @ ops["w8_dgrad"].T
  dw = ops["x_wgrad"].T @ _deq4(g, 0)
  dw[idx] = ops["x8_wgrad"].T @ _deq8(g, 0)
  return ops, (y, dx, dw)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


def _values(q):
  return np.asarray(fp4jax.dequantize(q, jnp.float32), np.float64)


@pytest.mark.parametrize("shape,axis", [((8, 96), 1), ((70, 5), 0), ((3, 45), 1)])
def test_mxfp8_matches_reference(shape, axis):
  rng = np.random.default_rng(1)
  x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
  x[0] = 0.0  # an all-zero block (exponent -127)
  x.flat[5] = 448.0 * 2.0 ** -3  # a block max exactly on a power-of-two boundary: no round-up
  q = fp4jax.quantize(x, "mxfp8", axis=axis, pad=True)
  r = ref.mxfp8_quantize(x, axis=axis)
  np.testing.assert_array_equal(_values(q), r["values"])
  np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8).astype(np.int64) - 127, r["exponents"])
  np.testing.assert_array_equal(np.asarray(fp4jax.fake_quant(x, "mxfp8", axis=axis, pad=True)), r["values"])
  # It rounds (3 mantissa bits: relative error <= 2^-4 for normal E4M3 values) and never saturates a block max.
  big = np.abs(x) >= np.abs(x).max() / 64
  assert np.all(np.abs(r["values"] - x)[big] <= np.abs(x)[big] * 2.0 ** -4) and _rel(r["values"], x) > 1e-4


@pytest.mark.parametrize("case", sorted(IDX))
def test_split_gemms_match_reference(case):
  x, w, g = _inputs()
  idx = np.array(IDX[case], np.int32)
  got = _split_operand_values(x, w, jnp.asarray(idx), jax.random.key(0), RNE)
  r_ops, (y_ref, dx_ref, dw_ref) = _reference(x, w, g, idx)
  for name, values in got.items():
    np.testing.assert_array_equal(np.asarray(values, np.float64), r_ops[name], err_msg=name)
  y, dx, dw = _fwd_and_grads(x, w, g, jnp.asarray(idx), jax.random.key(0), RNE)
  assert _rel(y, y_ref) < 1e-6 and _rel(dx, dx_ref) < 1e-6 and _rel(dw, dw_ref) < 1e-6
  # The outlier channels really changed precision: an all-FP4 layer is measurably further from these outputs.
  y4, dx4, dw4 = _fwd_and_grads(x, w, g, None, jax.random.key(0), RNE)
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  assert _rel(y4[:, :], y_ref) > 1e-3 and _rel(dx4[:, idx], dx_ref[:, idx]) > 1e-3
  assert _rel(dw4[idx], dw_ref[idx]) > 1e-3
  assert _rel(y_ref, x64 @ w64) < _rel(y4, x64 @ w64)  # with the outliers in MXFP8, y is closer to exact


def test_rest_is_the_plain_recipe_with_sr_and_rht():
  """With the paper's recipe (SR, RHT-16 on Wgrad), the rest channels are exactly fp4jax.dot_general of the zeroed
  operands with the same key: the split changes nothing but the outlier channels."""
  recipe = recipes.nvfp4(gemm_mode="f32")
  x, w, g = _inputs(2)
  idx = np.array([3, 60, 31], np.int32)
  keep = np.ones(K, bool)
  keep[idx] = False
  key = jax.random.key(7)
  y, dx, dw = _fwd_and_grads(x, w, g, jnp.asarray(idx), key, recipe)
  xr, wr = np.where(keep[None], x, 0.0).astype(np.float32), np.where(keep[:, None], w, 0.0).astype(np.float32)
  y4, dx4, dw4 = _fwd_and_grads(xr, wr, g, None, key, recipe)
  ops = _split_operand_values(x, w, jnp.asarray(idx), key, recipe)
  y8 = np.asarray(ops["x8"], np.float64) @ np.asarray(ops["w8"], np.float64)
  assert _rel(np.asarray(y, np.float64) - y8, y4) < 1e-6
  np.testing.assert_array_equal(np.asarray(dx)[:, keep], np.asarray(dx4)[:, keep])
  np.testing.assert_array_equal(np.asarray(dw)[keep], np.asarray(dw4)[keep])
  assert not np.array_equal(np.asarray(dx)[:, idx], np.asarray(dx4)[:, idx])


@jax.jit
def _plain(x, w, g, key):
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=RNE, key=key), x, w)
  return (y,) + vjp(g)


def test_no_outliers_is_the_plain_recipe_and_bf16_inputs_work():
  x, w, g = _inputs(3)
  key = jax.random.key(1)
  for got, want in zip(_fwd_and_grads(x, w, g, None, key, RNE), _plain(x, w, g, key)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  xb = jnp.asarray(x, jnp.bfloat16).reshape(2, M // 2, K)
  yb = jax.jit(lambda xb, w: outcontrol.dot_general(xb, w, (((2,), (0,)), ((), ())), recipe=RNE,
                                                    outliers=jnp.array([1, 2])))(xb, jnp.asarray(w))
  assert yb.shape == (2, M // 2, N) and yb.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(yb)))


def test_a_layer_in_bf16_ignores_its_outlier_channels():
  """After the late BF16 switch a layer keeps its indices; it ran them through OutControl's dot_general with a
  float32 output, where the other BF16 layers take gemm.unquantized_output_dtype's (bf16 on a GPU): a float32 (TF32)
  backward. Now the program is the one without indices."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax import nn  # pylint: disable=g-import-not-at-top
  layer = nn.Linear(64, 32, recipe="bf16:gemm_mode=bf16", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 64), jnp.bfloat16)

  def program():
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p, rest)(x).astype(jnp.float32)))
    return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))

  plain = program()
  assert "preferred_element_type=bfloat16" in plain
  layer.outliers = nnx.data(jnp.asarray([3, 7], jnp.int32))
  assert program() == plain


def test_channel_statistics_and_selection_match_numpy():
  """Summed per-step L2 norms rank a planted outlier channel first; the selection is NumPy's stable argsort."""
  rng = np.random.default_rng(4)
  scores = np.zeros(K)
  got = jnp.zeros(K)
  for _ in range(3):
    x = rng.standard_normal((2, 16, K)).astype(np.float32)
    x[..., 41] *= 30.0
    x[..., 7] *= 5.0
    sq = outcontrol.channel_sq_norms(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(sq), np.sum(np.square(np.asarray(
        jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)), axis=(0, 1)), rtol=1e-6)
    scores += np.sqrt(np.asarray(sq, np.float64))
    got = got + jnp.sqrt(sq)
  k = outcontrol.outlier_count(K, 0.05)
  assert k == 4
  sel = np.asarray(outcontrol.select_channels(got, k))
  np.testing.assert_array_equal(sel, np.argsort(-np.asarray(got, np.float64), kind="stable")[:k])
  assert sel[0] == 41 and sel[1] == 7
  np.testing.assert_array_equal(sel[:2], np.argsort(-scores, kind="stable")[:2])
  tie = np.asarray(outcontrol.select_channels(jnp.array([1.0, 3.0, 3.0, 0.0]), 2))
  np.testing.assert_array_equal(tie, [1, 2])


@pytest.mark.parametrize("fraction", [1.0, -0.1, True])
def test_bad_fraction_raises(fraction):
  with pytest.raises(ValueError, match="fraction"):
    outcontrol.outlier_count(K, fraction)


def test_bad_outliers_raise():
  x, w, _ = _inputs()
  for idx in (jnp.zeros((0,), jnp.int32), jnp.arange(K), jnp.zeros((2, 2), jnp.int32), jnp.array([1.0, 2.0])):
    with pytest.raises(ValueError, match="outlier indices"):
      outcontrol.dot_general(x, w, DN, recipe=RNE, outliers=idx)


def test_traced_outliers_that_repeat_or_leave_the_axis_give_nan():
  """Eager, [1, 1] is refused; under jit it ran, counting channel 1 twice in the forward (and once in the
  backward). [1, -1] wrapped to channel K - 1. Now both give NaN output and gradients; valid ones are unchanged."""
  x, w, g = (jnp.asarray(a) for a in _inputs(3))

  def run(idx):
    f = lambda x, w, idx: outcontrol.dot_general(x, w, DN, recipe=RNE, outliers=idx)
    y, vjp = jax.vjp(functools.partial(jax.jit(f), idx=idx), x, w)
    return (y, *vjp(g))

  for bad in ([1, 1], [1, -1], [3, K]):
    assert all(np.isnan(np.asarray(a)).any() for a in run(jnp.asarray(bad))), bad
  good = jnp.asarray([1, 2])
  for traced, eager in zip(run(good), (outcontrol.dot_general(x, w, DN, recipe=RNE, outliers=good),
                                      *jax.vjp(lambda x, w: outcontrol.dot_general(x, w, DN, recipe=RNE,
                                                                                   outliers=good), x, w)[1](g))):
    np.testing.assert_array_equal(traced, eager)


def test_a_forward_switched_to_bf16_runs_the_outlier_channels_forward_in_bf16_too():
  """`switch="forward"` (the late switch of Fprop only): the outlier channels' Fprop ran in MXFP8 while the rest's
  ran in BF16 (5 % off the BF16 layer's output). Now all of Fprop is high precision, and the backward keeps the
  outlier channels in MXFP8, re-quantized from the weights themselves."""
  x, w, g = (jnp.asarray(a) for a in _inputs(5))
  idx = jnp.asarray([0, 17, 20, 63])
  recipe = RNE.with_bf16(forward=True, backward=False)
  key = jax.random.key(1)
  y, vjp = jax.vjp(lambda x, w: outcontrol.dot_general(x, w, DN, recipe=recipe, key=key, outliers=idx), x, w)
  y_hp = jax.lax.dot_general(x, w, DN, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(y, y_hp, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(y_hp))))
  dx, dw = vjp(g)
  mx8 = lambda a, axis: fp4jax.dequantize(fp4jax.quantize(a, "mxfp8", axis=axis, pad=True), jnp.float32)
  dx8 = mx8(g, 1) @ mx8(w[idx], 1).T
  np.testing.assert_allclose(dx[:, idx], dx8, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dw[idx], mx8(x[:, idx], 0).T @ mx8(g, 0), rtol=1e-6, atol=1e-6)


def test_outcontrol_dgrad_blocks_the_output_gradient_along_n():
  """Dgrad contracts over N, so dY's MXFP8 blocks run along N. A row of dY 2^20 larger than the others would flush the
  other rows' elements to 0 in blocks along M; along N they keep their 3-bit mantissas."""
  M, K, N = 64, 64, 32
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = (rng.standard_normal((K, N)) / 8.0).astype(np.float32)
  g = rng.standard_normal((M, N)).astype(np.float32)
  g[5] *= np.float32(2.0**20)
  idx = np.array([3, 40], np.int32)
  recipe = recipes.nvfp4(stochastic_rounding=False, rht=False, gemm_mode="f32")
  ops = outcontrol.split_operands(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), recipe, jax.random.key(0))
  dx = np.asarray(outcontrol.split_dgrad(jnp.asarray(g), ops, jnp.asarray(idx), recipe, jax.random.key(0),
                                         jnp.float32), np.float64)
  w8 = ref.mxfp8_quantize(w[idx], axis=0)["values"]
  w8_dgrad = ref.mxfp8_quantize(w8.astype(np.float32), axis=1)["values"]
  dx_ref = ref.mxfp8_quantize(g, axis=1)["values"] @ w8_dgrad.T  # [M, k], float64
  rows = np.arange(M) != 5
  err = np.abs(dx[rows][:, idx] - dx_ref[rows]).max() / np.abs(dx_ref[rows]).max()
  assert err < 1e-5, err


def test_outlier_count_forgives_a_product_one_ulp_above_an_integer():
  """0.07 * 100 is 7.000000000000001 in floating point: k = ceil(f K) must still be 7, not 8."""
  assert 0.07 * 100 > 7
  assert outcontrol.outlier_count(100, 0.07) == 7 and outcontrol.outlier_count(1200, 0.07) == 84
