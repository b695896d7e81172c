"""Tests for fp4jax.analysis.gemm_probes: BF16 against a NumPy float64 reference, the rule's GEMMs reproduced draw by
draw, the quantized forward's gradient with an Fprop RHT undone, 1/sqrt(K) decay vs plateau, and the SR bias at block
maxima of NVIDIA's scale rule vs unbiased scales (Gaussian data, fixed keys)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import formats
from fp4jax import recipes
from fp4jax.analysis import gemm_probes
from fp4jax.analysis.probes import LayerTensors

M, K, N = 256, 64, 32
DRAWS = 32
KEY = jax.random.key(7)


def tensors(dtype=jnp.bfloat16) -> LayerTensors:
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return LayerTensors(jax.random.normal(k1, (M, K)).astype(dtype), 0.1 * jax.random.normal(k2, (K, N)),
                      (1e-3 * jax.random.normal(k3, (M, N))).astype(dtype))


def _rel(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(a - ref) / np.linalg.norm(ref)


def test_bf16_matches_a_float64_reference():
  t = tensors()
  res = gemm_probes.probe_gemms(t, "bf16", KEY, num_draws=4)
  x, w, dy = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in t)
  w16 = np.asarray(jnp.asarray(t.w_KxN, jnp.bfloat16).astype(jnp.float32), np.float64)
  # Only W's cast to bfloat16 differs from the exact products; x and dY are bfloat16 already (Wgrad is exact).
  np.testing.assert_allclose(res["err"]["fprop"], _rel(x @ w16, x @ w), rtol=1e-4)
  np.testing.assert_allclose(res["err"]["dgrad"], _rel(dy @ w16.T, dy @ w.T), rtol=1e-4)
  assert np.all(res["err"]["wgrad"] < 1e-6)
  for g, ref in gemm_probes.SERIES:  # deterministic: every K gives the one draw's error
    curve = res["bias"][g][ref]
    assert len(set(curve["mean"])) == 1 and all(s == 0 for s in curve["se"])
  assert np.all(res["chain"]["dgrad"] == 0) and np.isnan(res["maxima"]["dgrad"]).all()
  # Entries ~2^60 (a diverging layer): the bias table's sums of squares overflowed float32 (inf / inf = NaN).
  big = gemm_probes.probe_gemms(LayerTensors(t.x_MxK * 2.0**60, t.w_KxN, t.dy_MxN * 2.0**60), "bf16", KEY,
                                num_draws=4)
  for g, ref in gemm_probes.SERIES:
    np.testing.assert_allclose(big["bias"][g][ref]["mean"], res["bias"][g][ref]["mean"], rtol=1e-4)


def test_draws_are_the_rules_gemms():
  # float32 activations, so the rule's outputs are not rounded: its y, dx, dW equal the probe's per-draw GEMMs.
  t = tensors(jnp.float32)
  recipe = recipes.nvfp4(gemm_mode="f32")
  res = gemm_probes.probe_gemms(t, recipe, KEY, num_draws=4)
  x, w, dy = t
  exact = gemm_probes.exact_products(t)
  dims = (((1,), (0,)), ((), ()))

  @jax.jit  # one compilation for the 4 draws (the key is an argument)
  def rule(key):
    f = lambda a, b: fp4jax.dot_general(a, b, dims, recipe=recipe, key=key, preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  for d in range(4):
    y, dx, dw = rule(jax.random.fold_in(KEY, d))
    np.testing.assert_allclose(res["err"]["fprop"][d], _rel(y, exact[0]), rtol=1e-5)
    np.testing.assert_allclose(res["err"]["dgrad"][d], _rel(dx, exact[1]), rtol=1e-5)
    np.testing.assert_allclose(res["err"]["wgrad"][d], _rel(dw, exact[2]), rtol=1e-5)
  assert len(set(res["err"]["dgrad"].tolist())) == 4  # SR: every draw differs


def test_quantized_forward_gradient_undoes_an_fprop_rht():
  # Fprop rotated but not quantized: the quantized forward is x W, so its gradient is exactly dY W^T and x^T dY.
  t = tensors(jnp.float32)
  nv = recipes.OperandConfig(fmt=formats.NVFP4(), rounding="stochastic")
  rot = recipes.OperandConfig(rht=True)
  recipe = recipes.Recipe(name="rotated", fprop=recipes.GemmConfig(rot, rot), dgrad=recipes.GemmConfig(nv, nv),
                          rht_size=16, gemm_mode="f32")
  ops = gemm_probes.layer_operands(t.x_MxK, t.w_KxN, recipe, KEY)
  assert not np.allclose(np.asarray(ops.x_fprop), np.asarray(t.x_MxK))  # it is rotated
  dx, dw = gemm_probes.qfwd_gradients(t.dy_MxN, ops, recipe, KEY)
  _, dx_ex, dw_ex = gemm_probes.exact_products(t)
  assert _rel(dx, dx_ex) < 1e-6 and _rel(dw, dw_ex) < 1e-6
  assert not gemm_probes.forward_is_random(recipe)
  assert gemm_probes.forward_is_random(recipe.replace(rht_signs="per_call"))


def test_unbiased_backward_decays_and_a_re_quantized_x_plateaus():
  t = tensors()
  q2 = gemm_probes.probe_gemms(t, recipes.quartet2(rht_size=32), KEY, num_draws=DRAWS)
  nv = gemm_probes.probe_gemms(t, recipes.nvfp4(), KEY, num_draws=DRAWS)
  slope = lambda r, g: np.polyfit(np.log(r["bias"][g]["qfwd"]["K"]), np.log(r["bias"][g]["qfwd"]["mean"]), 1)[0]
  # Quartet II re-quantizes the Fprop operands with SR: an unbiased estimate of the quantized forward's gradient.
  assert -0.6 < slope(q2, "wgrad") < -0.4 and -0.6 < slope(q2, "dgrad") < -0.4
  # NVIDIA's Wgrad quantizes x anew (RHT, blocks along M, round to nearest): a plateau at its chain gap.
  assert slope(nv, "wgrad") > -0.3
  assert np.all(nv["chain"]["dgrad"] == 0)  # Dgrad reuses the 2D Fprop weight codes
  assert np.all(nv["chain"]["wgrad"] > 0.05) and np.all(q2["chain"]["dgrad"] > 0.05)
  # Against the exact product every FP4 recipe keeps the forward operands' rounding: its curve flattens.
  assert nv["bias"]["dgrad"]["exact"]["mean"][-1] > 0.5 * nv["bias"]["dgrad"]["exact"]["mean"][0]


def test_block_maxima_bias_of_nvidia_scales_and_unbiased_scales():
  t = tensors()
  nv = gemm_probes.probe_gemms(t, recipes.nvfp4(), KEY, num_draws=DRAWS)
  usr = gemm_probes.probe_gemms(t, recipes.nvfp4(unbiased_sr=True), KEY, num_draws=DRAWS)
  for g in ("dgrad", "wgrad"):
    # NVIDIA: about half of the block maxima clip at 6 when the E4M3 scale rounds down: about -1 % on average.
    assert -0.016 < nv["maxima"][g].mean() < -0.006
    se = np.std(usr["maxima"][g], ddof=1) / np.sqrt(DRAWS)
    assert abs(usr["maxima"][g].mean()) < max(4 * se, 1e-3)


def test_bad_shapes_are_refused():
  t = tensors()
  with pytest.raises(ValueError, match="probe_gemms needs"):
    gemm_probes.probe_gemms(LayerTensors(t.x_MxK, t.w_KxN.T, t.dy_MxN), "nvfp4", KEY)


def test_layers_the_rule_refuses_and_missing_keys_are_named():
  """The rule's own layer check (fp4jax.dot_general.check_layer_shape), not the quantizer's "pass pad=True", which no
  probe takes; key=None only for recipes without randomness (was a TypeError from fold_in)."""
  t = tensors()
  w_Kx40 = jnp.zeros((K, 40))
  with pytest.raises(ValueError, match="need N divisible by 16"):
    gemm_probes.probe_gemms(LayerTensors(t.x_MxK, w_Kx40, jnp.zeros((M, 40), jnp.bfloat16)), "nvfp4", KEY)
  with pytest.raises(ValueError, match="rht_size=32 or smaller"):
    gemm_probes.probe_gemms(t, "quartet2", KEY)  # Dgrad's RHT-128 along N = 32
  with pytest.raises(ValueError, match="pass key="):
    gemm_probes.probe_gemms(t, "nvfp4", None)
