"""fp4jax.dot_general: Fprop, Dgrad and Wgrad against references built by hand from the quantizers.

Layer y = x W with x [M tokens, K] and W [K, N]. The loss is linear, L = sum(y * G), so dY = G exactly and the
references below can quantize G directly (arXiv 2509.25149, Sec. 4; docs/numerics.md, "Recipe"):
  y  = Q(x, 1x16 along K)       @ Q(W, 16x16)
  dx = Q(G, 1x16 along N)       @ Q(W, 16x16)^T
  dW = Q(H x, 1x16 along M)^T   @ Q(H G, 1x16 along M)      H = RHT along M (identity when RHT is off)
Every jitted helper is module level with the recipe static, so tests sharing shapes share one compilation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes
from fp4jax.dot_general import dgrad_weight, fprop_operands, wgrad_activations
from fp4jax.quantize import dequantize, quantize

NVFP4 = fp4jax.NVFP4()
DN = (((1,), (0,)), ((), ()))  # x [M, K] . W [K, N]
M, K, N = 48, 32, 48
RNE = recipes.nvfp4(stochastic_rounding=False, rht=False)
RNE_RHT = recipes.nvfp4(stochastic_rounding=False)
SR_RHT = recipes.nvfp4()  # the paper's recipe


def _inputs(seed=0, m=M, k=K, n=N):
  """x, W and a gradient-sized G (1e-5: the per-tensor scale must keep its blocks in E4M3 range)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  g = (rng.standard_normal((m, n)) * 1e-5).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)


@functools.partial(jax.jit, static_argnames="recipe")
def _fwd_and_grads(x_MxK, w_KxN, g_MxN, key, recipe):
  """(y, dx, dW) of the linear loss sum(y * G) through fp4jax.dot_general."""
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key), x_MxK, w_KxN)
  dx, dw = vjp(g_MxN.astype(y.dtype))
  return y, dx, dw


def _deq(t, **kwargs):
  return dequantize(quantize(t, NVFP4, **kwargs), jnp.float32)


def _sr_mean(t, axis):
  """E[dequantize(Q_SR(t))]: SR is unbiased inside each block's range and saturates at +-6 * s_b * amax / 2688.

  Block scales are deterministic (the RNE quantization's), so the expectation is t clipped per block; clipping
  bites where E4M3 rounded a block scale down.
  """
  q = quantize(t, NVFP4, axis=axis)
  s_b = jnp.repeat(q.scales.astype(jnp.float32), 16, axis=axis)
  limit = 6.0 * s_b * (q.amax / 2688.0)
  return jnp.clip(t, -limit, limit)


@jax.jit
def _reference_operands(x_MxK, w_KxN, g_MxN):
  """The dequantized operands of the three GEMMs, quantized by hand, with and without RHT on Wgrad."""
  hx = fp4jax.random_hadamard(x_MxK, size=16, axis=0)
  hg = fp4jax.random_hadamard(g_MxN, size=16, axis=0)
  return dict(x_fprop=_deq(x_MxK, axis=1), w=_deq(w_KxN, axis=0, block_2d=True), g_dgrad=_deq(g_MxN, axis=1),
              x_wgrad=_deq(x_MxK, axis=0), g_wgrad=_deq(g_MxN, axis=0),
              hx_wgrad=_deq(hx, axis=0), hg_wgrad=_deq(hg, axis=0),
              g_dgrad_sr_mean=_sr_mean(g_MxN, axis=1), hg_wgrad_sr_mean=_sr_mean(hg, axis=0))


def _f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _rel(a, b):
  """max |a - b| / max |b|."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


def _fro(a, b):
  """||a - b|| / ||b|| (Frobenius)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _codes_equal(a, b):
  """Bit-identical QArrays: packed codes, block scales (as bytes) and amax."""
  return (np.array_equal(np.asarray(a.codes), np.asarray(b.codes))
          and np.array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(b.scales).view(np.uint8))
          and np.array_equal(np.asarray(a.amax), np.asarray(b.amax)))


# ---------------------------------------------------------------- module-level reference (SR off)


@pytest.mark.parametrize("recipe", [RNE, RNE_RHT], ids=["rht_off", "rht_on"])
def test_matches_hand_built_reference(recipe):
  x, w, g = _inputs()
  y, dx, dw = _fwd_and_grads(x, w, g, jax.random.key(0), recipe)
  r = _f64(_reference_operands(x, w, g))
  xw, gw = (r["hx_wgrad"], r["hg_wgrad"]) if recipe.wgrad.rht else (r["x_wgrad"], r["g_wgrad"])
  y_ref, dx_ref, dw_ref = r["x_fprop"] @ r["w"], r["g_dgrad"] @ r["w"].T, xw.T @ gw
  assert _rel(y, y_ref) < 1e-6
  assert _rel(dx, dx_ref) < 1e-6
  assert _rel(dw, dw_ref) < 1e-6
  # The references are really quantized: far from the exact products (a skipped quantizer would fail above).
  x64, w64, g64 = _f64((x, w, g))
  assert _rel(y_ref, x64 @ w64) > 1e-2 and _rel(dx_ref, g64 @ w64.T) > 1e-2 and _rel(dw_ref, x64.T @ g64) > 1e-2
  if recipe.wgrad.rht:  # RHT changes the quantized Wgrad operands, so it must show in dW
    assert _rel(dw_ref, r["x_wgrad"].T @ r["g_wgrad"]) > 1e-3


def test_leading_dims_nk_weight_and_unaligned_tokens():
  """x [2, 20, K] (40 tokens, not a multiple of 16) with W stored [N, K] equals the canonical call on zero-padded
  tokens: zero rows change no amax and Wgrad pads its token axis with zeros itself."""
  x, w, g = _inputs(1)
  x3, g3 = x[:40].reshape(2, 20, K), g[:40].reshape(2, 20, N)
  x_pad, g_pad = x.at[40:].set(0.0), g.at[40:].set(0.0)
  w_NxK = w.T

  @jax.jit
  def nk_call(x3, w_NxK, g3):
    y, vjp = jax.vjp(lambda a, b: fp4jax.dot_general(a, b, (((2,), (1,)), ((), ())), recipe=RNE_RHT), x3, w_NxK)
    return (y,) + vjp(g3)

  y3, dx3, dw_NxK = nk_call(x3, w_NxK, g3)
  y, dx, dw = _fwd_and_grads(x_pad, w, g_pad, jax.random.key(0), RNE_RHT)
  assert y3.shape == (2, 20, N) and dx3.shape == x3.shape and dw_NxK.shape == (N, K)
  np.testing.assert_array_equal(np.asarray(y3).reshape(40, N), np.asarray(y)[:40])
  np.testing.assert_array_equal(np.asarray(dx3).reshape(40, K), np.asarray(dx)[:40])
  np.testing.assert_allclose(np.asarray(dw_NxK).T, np.asarray(dw), rtol=1e-6, atol=1e-6 * np.abs(dw).max())


# ---------------------------------------------------------------- stochastic rounding

N_KEYS = 256


@functools.partial(jax.jit, static_argnames="recipe")
def _grads_over_keys(x, w, g, keys, recipe):
  return jax.vmap(lambda k: _fwd_and_grads(x, w, g, k, recipe)[1:])(keys)


def test_sr_gradients_are_unbiased():
  """The mean over 256 keys converges to E[grad]: Q_SR(G) averages to G (clipped per block, see _sr_mean), so
  E[dx] = clip(G) @ Q(W)^T and E[dW] = Q(H x)^T @ clip(H G). Tested per entry against the sample standard error."""
  x, w, g = _inputs(2)
  keys = jax.random.split(jax.random.key(7), N_KEYS)
  dxs, dws = _f64(_grads_over_keys(x, w, g, keys, SR_RHT))
  r = _f64(_reference_operands(x, w, g))
  expected = {"dx": r["g_dgrad_sr_mean"] @ r["w"].T, "dw": r["hx_wgrad"].T @ r["hg_wgrad_sr_mean"]}
  rne = {"dx": r["g_dgrad"] @ r["w"].T, "dw": r["hx_wgrad"].T @ r["hg_wgrad"]}
  for name, draws in (("dx", dxs), ("dw", dws)):
    mean, se = draws.mean(0), draws.std(0, ddof=1) / np.sqrt(N_KEYS)
    assert (se > 0).all(), f"{name}: some entries never vary across keys: SR is not applied"
    z = (mean - expected[name]) / se
    # z is ~N(0, 1) per entry when unbiased: mean square ~1, no entry beyond 5.5 sigma (~3000 entries).
    assert 0.7 < np.mean(z**2) < 1.4, (name, np.mean(z**2))
    assert np.abs(z).max() < 5.5, (name, np.abs(z).max())
    # Averaging shrinks the error like 1/sqrt(n), and leaves it far below RNE's bias.
    single = np.mean([_fro(d, expected[name]) for d in draws[:16]])
    assert _fro(mean, expected[name]) < 2.0 * single / np.sqrt(N_KEYS)
    assert _fro(mean, expected[name]) < 0.3 * _fro(rne[name], expected[name])


def test_jit_grad_value_and_grad_and_keys():
  """value_and_grad under jit: loss = sum(y * G) and grads equal the vjp's; one SR draw stays near the exact
  (unquantized) gradient; same key -> bit-identical, another key -> different gradients, same forward."""
  x, w, g = _inputs(3)

  @functools.partial(jax.jit, static_argnames="recipe")
  def loss_and_grads(x, w, key, recipe):
    loss = lambda x, w: jnp.sum(fp4jax.dot_general(x, w, DN, recipe=recipe, key=key) * g)
    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

  k0, k1 = jax.random.key(0), jax.random.key(1)
  loss, (dx, dw) = loss_and_grads(x, w, k0, SR_RHT)
  loss_again, (dx_again, dw_again) = loss_and_grads(x, w, k0, SR_RHT)
  loss_other, (dx_other, dw_other) = loss_and_grads(x, w, k1, SR_RHT)
  y, dx_vjp, dw_vjp = _fwd_and_grads(x, w, g, k0, SR_RHT)

  np.testing.assert_allclose(loss, jnp.sum(y * g), rtol=1e-5)
  # Same draws, but XLA may fuse the two programs differently: float32 summation order only.
  np.testing.assert_allclose(dx, dx_vjp, rtol=1e-5, atol=1e-5 * np.abs(dx_vjp).max())
  np.testing.assert_allclose(dw, dw_vjp, rtol=1e-5, atol=1e-5 * np.abs(dw_vjp).max())
  np.testing.assert_array_equal(dx, dx_again)
  np.testing.assert_array_equal(dw, dw_again)
  assert loss == loss_again == loss_other  # the forward is RNE: keys only drive the backward's SR
  assert not np.array_equal(dx, dx_other) and not np.array_equal(dw, dw_other)
  # One draw vs the exact gradient: NVFP4 on both operands costs ~10-20% relative error; 0.35 flags breakage.
  x64, w64, g64 = _f64((x, w, g))
  assert _fro(dx, g64 @ w64.T) < 0.35
  assert _fro(dw, x64.T @ g64) < 0.35


def test_missing_key_raises():
  x, w, _ = _inputs()
  with pytest.raises(ValueError, match="key"):
    fp4jax.dot_general(x, w, DN, recipe=SR_RHT)
  with pytest.raises(ValueError, match="key"):  # per-call RHT signs need randomness too, even without SR
    fp4jax.dot_general(x, w, DN, recipe=recipes.nvfp4(stochastic_rounding=False, random_signs="per_call"))


# ---------------------------------------------------------------- operands


@functools.partial(jax.jit, static_argnames="recipe")
def _weights(w_KxN, recipe):
  x = jnp.zeros((16, w_KxN.shape[0]), jnp.float32)
  _, wq = fprop_operands(x, w_KxN, recipe, jax.random.key(0))
  return wq, dgrad_weight(w_KxN, wq, recipe, jax.random.key(0), jnp.float32)


def test_dgrad_weight_is_fprop_weight_transposed():
  _, w, _ = _inputs(4)
  wq, wd = _weights(w, RNE)
  assert RNE.dgrad_reuses_weight and wq.block_2d and wd.block_2d
  assert _codes_equal(wq, wd)
  # ... and that is exactly the transpose: 2D-quantizing W^T [N, K] gives the same codes and scales, transposed.
  wt = jax.jit(lambda w: quantize(w.T, NVFP4, axis=1, block_2d=True))(w)
  np.testing.assert_array_equal(np.asarray(wd.unpacked_codes()).T, np.asarray(wt.unpacked_codes()))
  np.testing.assert_array_equal(np.asarray(wd.scales).T.view(np.uint8), np.asarray(wt.scales).view(np.uint8))


def test_1d_weights_are_requantized_along_n():
  _, w, _ = _inputs(4)
  recipe = recipes.nvfp4(stochastic_rounding=False, rht=False, weight_2d=False)
  wq, wd = _weights(w, recipe)
  assert not recipe.dgrad_reuses_weight
  assert (wq.axis, wq.block_2d, wd.axis, wd.block_2d) == (0, False, 1, False)
  assert not np.array_equal(np.asarray(wq.unpacked_codes()), np.asarray(wd.unpacked_codes()))
  assert _codes_equal(wd, jax.jit(lambda w: quantize(w, NVFP4, axis=1))(w))


def test_rht_without_quantization_leaves_wgrad_unchanged():
  """Wgrad operands high precision but RHT-transformed: H is orthonormal, so dW = x^T G to float32 accuracy."""
  quantized = recipes.OperandConfig(fmt=NVFP4)
  recipe = recipes.Recipe(
      name="rht-only-wgrad",
      fprop=recipes.GemmConfig(quantized, recipes.OperandConfig(fmt=NVFP4, block_2d=True)),  # keeps the custom_vjp
      wgrad=recipes.GemmConfig(recipes.OperandConfig(rht=True), recipes.OperandConfig(rht=True)))
  x, w, g = _inputs(5)
  _, dx, dw = _fwd_and_grads(x, w, g, jax.random.key(0), recipe)
  hx = jax.jit(wgrad_activations, static_argnames="recipe")(x, recipe=recipe, key=jax.random.key(0))
  assert _rel(hx, x) > 0.1  # the operand really is transformed
  x64, w64, g64 = _f64((x, w, g))
  assert _rel(dw, x64.T @ g64) < 1e-5
  assert _rel(dx, g64 @ w64.T) < 1e-5  # Dgrad is high precision in this recipe too


# ---------------------------------------------------------------- transformations


def test_vmap_matches_per_example_calls():
  x, w, g = _inputs(6)
  x2, g2 = jnp.stack([x, 2.0 * x[::-1]]), jnp.stack([g, -g])
  keys = jax.random.split(jax.random.key(3), 2)
  ys, dxs, dws = jax.jit(jax.vmap(_fwd_and_grads, in_axes=(0, None, 0, 0, None)), static_argnums=4)(
      x2, w, g2, keys, SR_RHT)
  for i in range(2):
    y, dx, dw = _fwd_and_grads(x2[i], w, g2[i], keys[i], SR_RHT)
    for batched, single in ((ys[i], y), (dxs[i], dx), (dws[i], dw)):
      np.testing.assert_allclose(batched, single, rtol=1e-5, atol=1e-6 * np.abs(single).max())


def _mlp_loss(ws_LxDxD, x_MxD, keys, *, use_scan):
  """A stack of L quantized tanh layers, as a lax.scan over stacked weights (with remat) or an unrolled loop."""
  layer = lambda h, w, k: jnp.tanh(fp4jax.dot_general(h, w, DN, recipe=SR_RHT, key=k))
  if use_scan:
    step = jax.checkpoint(lambda h, wk: (layer(h, *wk), None))
    h, _ = jax.lax.scan(step, x_MxD, (ws_LxDxD, keys))
  else:
    h = x_MxD
    for i in range(ws_LxDxD.shape[0]):
      h = layer(h, ws_LxDxD[i], keys[i])
  return jnp.sum(h**2)


def test_scan_over_layers_with_remat_matches_unrolled():
  rng = np.random.default_rng(7)
  ws = jnp.asarray(rng.standard_normal((2, K, K)) / np.sqrt(K), jnp.float32)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  keys = jax.random.split(jax.random.key(11), 2)
  scan_fn = jax.value_and_grad(functools.partial(_mlp_loss, use_scan=True), argnums=(0, 1))
  jaxpr = str(jax.make_jaxpr(scan_fn)(ws, x, keys))
  assert "scan" in jaxpr and ("checkpoint" in jaxpr or "remat" in jaxpr)
  loss_s, (dws_s, dx_s) = jax.jit(scan_fn)(ws, x, keys)
  loss_u, (dws_u, dx_u) = jax.jit(jax.value_and_grad(functools.partial(_mlp_loss, use_scan=False),
                                                     argnums=(0, 1)))(ws, x, keys)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  np.testing.assert_allclose(dws_s, dws_u, rtol=1e-5, atol=1e-6 * np.abs(dws_u).max())
  np.testing.assert_allclose(dx_s, dx_u, rtol=1e-5, atol=1e-6 * np.abs(dx_u).max())
  assert np.isfinite(dws_s).all() and np.abs(dws_s[0]).max() > 0 and dws_s.dtype == jnp.float32


def test_bf16_inputs():
  """bf16-representable x, W, G quantize to the same codes as their float32 copies: y and dx are the float32
  results rounded to bf16. Wgrad's RHT output is rounded to bf16 (as in the reference), so dW is only close."""
  x, w, g = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _inputs(8))
  y, dx, dw = _fwd_and_grads(x, w, g, jax.random.key(0), RNE_RHT)
  y32, dx32, dw32 = _fwd_and_grads(*jax.tree.map(lambda a: a.astype(jnp.float32), (x, w, g)), jax.random.key(0),
                                   RNE_RHT)
  assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y32.astype(jnp.bfloat16)))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx32.astype(jnp.bfloat16)))
  assert _fro(dw, dw32) < 0.05


# ---------------------------------------------------------------- jaxpr / HLO


def _jaxpr(recipe, grad=False):
  x, w, g = _inputs()

  def f(x, w):
    return fp4jax.dot_general(x, w, DN, recipe=recipe, key=jax.random.key(0) if recipe.needs_key else None)

  if grad:
    return str(jax.make_jaxpr(lambda x, w: jax.vjp(f, x, w)[1](g))(x, w))
  return str(jax.make_jaxpr(f)(x, w))


QUANT_OPS = ("round[", "float8_e4m3fn", "reduce_max")


def test_bf16_recipe_is_plain_dot_general():
  x, w, _ = _inputs()
  plain = str(jax.make_jaxpr(lambda x, w: jax.lax.dot_general(x, w, DN))(x, w))
  assert _jaxpr(recipes.bf16()) == plain
  assert str(jax.make_jaxpr(lambda x, w: fp4jax.dot_general(x, w, DN, recipe="bf16"))(x, w)) == plain


def test_quantized_jaxpr_and_hlo_contain_quantization():
  fwd = _jaxpr(SR_RHT)
  assert "custom_vjp_call" in fwd and all(op in fwd for op in QUANT_OPS)
  x, w, _ = _inputs()
  hlo = jax.jit(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=RNE)).lower(x, w).as_text()
  # The E4M3 block scales' saturation (448) and the E2M1 rounding. (The forward's bf16-mode operands never become
  # float8: they are decoded with the quantizer's float32 scales, fp4jax.quantize.decoded_values.)
  assert "4.480000e+02" in hlo and "round_nearest_even" in hlo


def test_bf16_forward_has_no_quantization_in_forward():
  recipe = SR_RHT.with_bf16(forward=True, backward=False)
  fwd = _jaxpr(recipe)
  assert "custom_vjp_call" in fwd  # the backward is still quantized, so the rule is in place ...
  assert not any(op in fwd for op in QUANT_OPS)  # ... but its forward quantizes nothing
  bwd = _jaxpr(recipe, grad=True)
  assert all(op in bwd for op in QUANT_OPS)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("x_shape, w_shape, dims, match", [
    ((M, K), (K + 16, N), DN, "contraction sizes differ"),
    ((M, 24), (24, N), DN, "K divisible by 16"),
    ((M, K), (K, 40), DN, "N divisible by 16"),
    ((2, M, K), (2, K, N), (((2,), (1,)), ((0,), (0,))), "batch dimensions"),
    ((M, K), (4, K, N), (((1,), (1,)), ((), ())), "weight"),
    ((K, M), (K, N), (((0,), (0,)), ((), ())), "last axis"),
])
def test_bad_input_raises(x_shape, w_shape, dims, match):
  with pytest.raises(ValueError, match=match):
    fp4jax.dot_general(jnp.ones(x_shape), jnp.ones(w_shape), dims, recipe=RNE)


@pytest.mark.parametrize("spec, x_shape, w_shape, match", [
    # Fprop's RHT runs along K on both operands: 128-point tiles do not fit K=64; 64 is the largest that does.
    ("nvfp4:rht_on=fprop,rht_size=128", (M, 64), (64, 128), r"fprop lhs: .*128-point RHT along K.* got K=64 .*"
     r"Use rht_size=64 or smaller"),
    # Dgrad's RHT runs along N; N=48 takes at most 16-point tiles. Quartet II's preset (128) names its string form.
    ("quartet2", (M, 128), (128, 48), r"dgrad lhs: recipe 'quartet2' runs a 128-point RHT along N.* got N=48 .*"
     r"rht_size=16 or smaller.*recipe 'quartet2:rht_size=16'"),
])
def test_an_rht_that_does_not_tile_k_or_n_raises_naming_the_size_that_fits(spec, x_shape, w_shape, match):
  with pytest.raises(ValueError, match=match):
    fp4jax.dot_general(jnp.ones(x_shape), jnp.ones(w_shape), DN, recipe=spec, key=jax.random.key(0))


def test_rht_size_limit_is_the_largest_power_of_two_tiling_both_feature_axes():
  from fp4jax.dot_general import check_layer_shape, rht_size_limit  # pylint: disable=g-import-not-at-top
  both = recipes.get_recipe("nvfp4:rht_on=fprop+dgrad+wgrad,rht_size=128")
  assert rht_size_limit(384, 96, both) == 32 and rht_size_limit(256, 512, both) == 128
  assert rht_size_limit(48, 64, recipes.get_recipe("nvfp4")) is None  # Wgrad's RHT runs along tokens (padded)
  check_layer_shape(256, 512, both)
  with pytest.raises(ValueError, match="got N=96"):
    check_layer_shape(256, 96, both)


def test_2d_blocks_are_checked_along_each_operands_own_feature_axis():
  """2D blocks on an activation (a hand-built recipe) were checked along the weight's two axes: x [M, K] was refused
  for N=40, which it lacks, while Wgrad's x, blocked along K too, passed the check and failed in the backward."""
  from fp4jax.dot_general import check_layer_shape  # pylint: disable=g-import-not-at-top
  G, O, nv = recipes.GemmConfig, recipes.OperandConfig, fp4jax.NVFP4()
  x_2d = recipes.Recipe(name="x-2d", fprop=G(O(nv, block_2d=True), O(nv)))
  check_layer_shape(64, 40, x_2d)
  x = jax.random.normal(jax.random.key(0), (32, 64))
  assert fp4jax.dot_general(x, jnp.ones((64, 40)), DN, recipe=x_2d).shape == (32, 40)
  with pytest.raises(ValueError, match=r"^fprop lhs: nvfp4 blocks of 16 need K divisible by 16; got K=40"):
    check_layer_shape(40, 64, x_2d)
  wgrad_x_2d = recipes.Recipe(name="wgrad-x-2d", wgrad=G(O(nv), O(nv, block_2d=True)))
  for k, n in ((40, 32), (40, 64)):
    with pytest.raises(ValueError, match=r"^wgrad rhs: nvfp4 blocks of 16 need K divisible by 16; got K=40"):
      fp4jax.dot_general(jnp.ones((32, k)), jnp.ones((k, n)), DN, recipe=wgrad_x_2d)
  with pytest.raises(ValueError, match=r"^wgrad lhs: nvfp4 blocks of 16 need N divisible by 16; got N=40"):
    check_layer_shape(64, 40, recipes.Recipe(name="wgrad-dy-2d", wgrad=G(O(nv, block_2d=True), O(nv))))
  check_layer_shape(40, 40, recipes.Recipe(name="wgrad-1d", wgrad=G(O(nv), O(nv))))  # along M, padded


def test_unknown_recipe_name_raises():
  with pytest.raises(ValueError, match="Unknown recipe"):
    fp4jax.dot_general(jnp.ones((M, K)), jnp.ones((K, N)), DN, recipe="nvfp5")


@pytest.mark.parametrize("dtypes", [(jnp.float16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                    (jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float32)])
def test_default_output_dtype_is_lax_dot_generals_for_every_recipe(dtypes):
  # float16 x bfloat16 gave float32 (jnp's promotion) under a quantized recipe and bfloat16 under "bf16" (lax's):
  # switching recipes changed the output dtype.
  from fp4jax import outcontrol  # pylint: disable=g-import-not-at-top
  x = jnp.ones((32, 64), dtypes[0])
  w = jnp.ones((64, 32), dtypes[1])
  want = jax.lax.dot_general(x, w, DN).dtype
  key = jax.random.key(0)
  for recipe in ("bf16", "nvfp4", "mxfp4", "fp8"):
    assert fp4jax.dot_general(x, w, DN, recipe=recipe, key=key).dtype == want, recipe
  assert outcontrol.dot_general(x, w, DN, recipe="nvfp4", key=key, outliers=jnp.asarray([3])).dtype == want


def test_linear_dot_general_pairs_contracted_axes_listed_out_of_order():
  """Contracting lhs axes (2, 1) with rhs axes (0, 1): K is flattened in the pairs' order on both sides, so the
  quantized result stays near the exact einsum (a flattening of one side in sorted order would pair h with d)."""
  from fp4jax.contraction import linear_dot_general
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (8, 16, 32), jnp.float32)  # [B, H, D]
  w = jax.random.normal(k2, (32, 16, 32), jnp.float32)  # [D, H, N]
  y = linear_dot_general(x, w, (((2, 1), (0, 1)), ((), ())), recipe="nvfp4", key=jax.random.key(1))
  want = jnp.einsum("bhd,dhn->bn", x, w, precision="highest")
  assert y.shape == want.shape
  assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.3


def test_mixed_dtype_gradients_take_each_inputs_dtype():
  """The rule's cotangents are cast back to their own input's dtype: a bfloat16 x with a float32 W gives a bfloat16
  dx and a float32 dW (not dW in x's dtype)."""
  x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
  dx, dw = jax.grad(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=RNE).astype(jnp.float32).sum(),
                    argnums=(0, 1))(x, w)
  assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)


def test_dgrad_weight_sr_uses_its_own_key_tag():
  """A re-quantized, stochastically rounded Dgrad weight (TetraJet-v2) draws its SR bits from fold_in(key, 4)
  (_DGRAD_W_SR), not from Wgrad's activation stream fold_in(key, 5); signs from fold_in(key, 3)."""
  from fp4jax.dot_general import quantize_operand  # pylint: disable=g-import-not-at-top
  recipe = fp4jax.recipes_beyond.tetrajet_v2(sr_bits="threefry")
  w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
  key = jax.random.key(7)
  wq = jax.jit(lambda w: fprop_operands(jnp.zeros((16, 64)), w, recipe, key)[1])(w)
  got = jax.jit(lambda w, wq: dgrad_weight(w, wq, recipe, key, jnp.float32))(w, wq)
  w_src = dequantize(wq).astype(jnp.float32)
  signs = jax.random.fold_in(key, 3)
  want, other = (jax.jit(lambda w, t=t: quantize_operand(w, recipe.dgrad.rhs, axis=1, recipe=recipe,
                                                         key=jax.random.fold_in(key, t), signs=signs))(w_src)
                 for t in (4, 5))
  assert not _codes_equal(want, other)  # the tag matters for these inputs
  assert _codes_equal(got, want)


def test_wgrad_pads_tokens_to_the_rht_size():
  """Wgrad's RHT runs along the tokens: a token count that is a multiple of the blocks (48 = 3 x 16) but not of a
  64-point RHT is zero-padded to 64 inside the rule, so dW equals that of the explicitly zero-padded call."""
  recipe = recipes.get_recipe("nvfp4:rht_size=64,stochastic_rounding=false")
  x = jax.random.normal(jax.random.key(0), (48, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (64, 64), jnp.float32)
  dy = jax.random.normal(jax.random.key(2), (48, 64), jnp.float32)
  key = jax.random.key(3)
  dw = lambda x, dy: jax.vjp(lambda w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key), w)[1](dy)[0]
  pad = lambda a: jnp.pad(a, ((0, 16), (0, 0)))
  np.testing.assert_array_equal(np.asarray(dw(x, dy)), np.asarray(dw(pad(x), pad(dy))))


def test_dgrad_dy_sr_uses_its_own_key_tag():
  """Dgrad's stochastically rounded dY draws its SR bits from fold_in(key, 1) (_DGRAD_SR), Wgrad's from
  fold_in(key, 2): the two GEMMs' rounding noise is independent."""
  from fp4jax.dot_general import dgrad_gradient, quantize_operand  # pylint: disable=g-import-not-at-top
  recipe = recipes.nvfp4(rht=False)
  dy = jax.random.normal(jax.random.key(2), (32, 64), jnp.float32)
  key = jax.random.key(7)
  got = jax.jit(lambda dy: dgrad_gradient(dy, recipe, key))(dy)
  want, other = (jax.jit(lambda dy, t=t: quantize_operand(dy, recipe.dgrad.lhs, axis=1, recipe=recipe,
                                                          key=jax.random.fold_in(key, t)))(dy) for t in (1, 2))
  assert recipe.dgrad.lhs.rounding == "stochastic" and not _codes_equal(want, other)
  assert _codes_equal(got, want)
