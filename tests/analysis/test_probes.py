"""Tests for fp4jax.analysis.probes and model_probes: exact zeros for BF16, a known rounding bias recovered, the
1/sqrt(K) decay of stochastic rounding, the chain-rule gap of 1D weights, the rule's GEMMs reproduced bit for bit,
capture vs autodiff."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.pretrain import model as model_lib
from fp4jax.analysis import model_probes, probes
from fp4jax import recipes

# One shape for the layer tests, so each recipe's probe compiles once: M tokens, K = N features.
M, K = 512, 64
DRAWS = 64
SCALE = 2.0**-10  # gradient-sized values; a power of two keeps every value below exact
# A block of 16: one element at the block maximum (6 after scaling: exact) and 15 at 1.125, a quarter of the way
# from grid point 1 to grid point 1.5. Round-to-nearest sends them all to 1 (a bias of -0.125 each); stochastic
# rounding sends them to 1.5 with probability 1/4 (unbiased, variance 1/4 * 3/4 * 0.5^2 each).
RNE_BIAS = float(np.sqrt(15 * 0.125**2) / np.sqrt(36 + 15 * 1.125**2))
SR_NOISE = float(np.sqrt(15 * 0.25 * 0.75 * 0.25) / np.sqrt(36 + 15 * 1.125**2))


def known_bias_tensors() -> probes.LayerTensors:
  """x random; W = I (exact in NVFP4, 1D or 2D); dY with random signs in the block pattern above."""
  x = jax.random.normal(jax.random.key(0), (M, K)).astype(jnp.bfloat16)
  magnitude = np.full((M, K), 1.125, np.float32)
  magnitude[:, ::16] = 6.0
  signs = np.where(np.random.default_rng(0).random((M, K)) < 0.5, -1.0, 1.0)
  dy = jnp.asarray(magnitude * signs * SCALE, jnp.bfloat16)
  return probes.LayerTensors(x, jnp.eye(K, dtype=jnp.float32), dy)


def random_tensors(seed=1) -> probes.LayerTensors:
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  return probes.LayerTensors(jax.random.normal(kx, (M, K)).astype(jnp.bfloat16),
                             0.1 * jax.random.normal(kw, (K, K)),
                             (1e-3 * jax.random.normal(kd, (M, K))).astype(jnp.bfloat16))


@pytest.fixture(scope="module")
def known():
  t = known_bias_tensors()
  key = jax.random.key(5)
  return {name: probes.probe_layer(t, recipes.get_recipe(spec), key, num_draws=DRAWS)
          for name, spec in (("bf16", "bf16"), ("rne", "nvfp4:stochastic_rounding=false"), ("sr", "nvfp4"))}


def test_bf16_gives_exactly_zero_error_and_bias(known):
  res = known["bf16"]
  for metric in ("fprop_err", "chain_dgrad", "chain_wgrad", "weight_mismatch"):
    assert res[metric] == 0.0
  for metric in ("dgrad_err", "wgrad_err"):
    assert np.all(res[metric] == 0.0)
  for metric in ("fprop_cos",):
    assert res[metric] == pytest.approx(1.0, abs=1e-6)
  for gemm in ("dgrad", "wgrad"):
    for ref in probes.BIAS_REFERENCES:
      curve = res["bias"][gemm][ref]
      assert curve["K"] == [1, 2, 4, 8, 16, 32]
      assert all(m == 0.0 for m in curve["mean"]) and all(s == 0.0 for s in curve["se"])
      assert probes.bias_floor(curve) == 0.0
  assert res["stats"] == {}


def test_round_to_nearest_bias_is_recovered_and_flat(known):
  res = known["rne"]
  for ref in probes.BIAS_REFERENCES:  # W = I: all three references equal dY
    curve = res["bias"]["dgrad"][ref]
    np.testing.assert_allclose(curve["mean"], RNE_BIAS, rtol=1e-4)
    assert all(s == 0.0 for s in curve["se"])  # every draw is the same
    assert probes.bias_floor(curve) == pytest.approx(RNE_BIAS, rel=1e-4)
    assert probes.decay_slope(curve) == pytest.approx(0.0, abs=1e-6)
  # 15 of every 16 magnitudes sit at 1.125 and quantize to 1: zero codes none, saturated (6) one in 16.
  stats = res["stats"]["dgrad.dY"]
  assert stats["sat"] == pytest.approx(1 / 16) and stats["zero"] == 0.0
  assert stats["scale_lo"] == stats["scale_hi"] == 448.0


def test_stochastic_rounding_bias_decays_like_inverse_sqrt_k(known):
  curve = known["sr"]["bias"]["dgrad"]["exact_grad"]
  k, mean = np.asarray(curve["K"], np.float64), np.asarray(curve["mean"])
  # Single draws: the predicted SR noise; means of K draws: that noise / sqrt(K), within 10% up to K = 32.
  assert mean[0] == pytest.approx(SR_NOISE, rel=0.03)
  np.testing.assert_allclose(mean * np.sqrt(k), SR_NOISE, rtol=0.10)
  assert probes.decay_slope(curve) == pytest.approx(-0.5, abs=0.03)
  assert probes.bias_floor(curve) < 0.4 * RNE_BIAS  # unbiased: the floor is noise in the estimate only
  assert all(s > 0 for s in curve["se"])
  # Round-to-nearest's error on the same tensors is lower per draw, but it never averages away.
  assert known["rne"]["dgrad_err"][0] < known["sr"]["dgrad_err"].mean()
  assert mean[-1] < RNE_BIAS


def test_2d_weights_keep_the_chain_rule_and_1d_weights_break_it():
  t, key = random_tensors(), jax.random.key(6)
  two_d = probes.probe_layer(t, "nvfp4", key, num_draws=DRAWS)
  one_d = probes.probe_layer(t, "nvfp4:weight_2d=false", key, num_draws=DRAWS)
  assert two_d["chain_dgrad"] == 0.0 and two_d["weight_mismatch"] == 0.0
  assert one_d["chain_dgrad"] > 0.02 and one_d["weight_mismatch"] > 0.02
  # 2D + SR: the mean of K draws approaches the quantized forward's gradient; 1D flattens at the weight mismatch.
  assert probes.decay_slope(two_d["bias"]["dgrad"]["chain"]) < -0.4
  assert probes.bias_floor(one_d["bias"]["dgrad"]["chain"]) > 0.5 * one_d["chain_dgrad"]


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4:weight_2d=false,rht=false", "tetrajet_v2", "quartet2:rht_size=16"])
def test_quantized_gemms_equal_the_custom_vjp_rule(spec):
  recipe = recipes.get_recipe(spec)
  x, w, dy = random_tensors(2)
  x, w, dy = x[:64], w, dy[:64]
  key = jax.random.key(9)

  def layer(x, w):
    return fp4jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, key=key,
                              preferred_element_type=jnp.float32).astype(x.dtype)

  def rule(x, w, dy):
    y, vjp = jax.vjp(layer, x, w)
    return (y, *vjp(dy))

  y, dx, dw = jax.jit(rule)(x, w, dy)
  y2, dx2, dw2, _, _ = jax.jit(lambda x, w, dy: probes.quantized_gemms(x, w, dy, recipe, key))(x, w, dy)
  for a, b in ((y, y2), (dx, dx2), (dw, dw2)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))


def test_key_dependent_backward_operands_are_rebuilt_per_draw():
  """Re-quantized Fprop operands with SR (TetraJet-v2, Quartet II) depend on the layer key even with fixed signs."""
  assert not probes._operands_need_key(recipes.nvfp4())  # pylint: disable=protected-access
  assert probes._operands_need_key(recipes.nvfp4(random_signs="per_call"))  # pylint: disable=protected-access
  assert probes._operands_need_key(recipes.tetrajet_v2().replace(rht_signs="fixed"))  # pylint: disable=protected-access
  assert not probes._operands_need_key(  # pylint: disable=protected-access
      recipes.tetrajet_v2(stochastic_rounding=False).replace(rht_signs="fixed"))
  # Per-call Fprop signs alone (fixed backward signs, no SR on the re-quantized operands): each draw reused the
  # base key's operands while the inverse transform took the draw's key (dgrad error 1.4 where the rule's is 0.38).
  q = recipes.quartet()
  rne = lambda op: dataclasses.replace(op, rounding="nearest")
  only_fprop = q.replace(rht_signs="fixed", fprop_rht_signs="per_call",
                         dgrad=recipes.GemmConfig(q.dgrad.lhs, rne(q.dgrad.rhs)),
                         wgrad=recipes.GemmConfig(q.wgrad.lhs, rne(q.wgrad.rhs)))
  assert probes._operands_need_key(only_fprop)  # pylint: disable=protected-access
  assert not probes._operands_need_key(only_fprop.replace(fprop_rht_signs="none"))  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def tiny_model():
  config = model_lib.get_model_config("tiny", n_layers=1, d_ff=64, n_kv_heads=4, max_seq_len=32)
  model = model_lib.Transformer(config, rngs=nnx.Rngs(params=0))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 33)).astype(np.int32)
  return model, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_capture_matches_autodiff_and_bf16_model_probe_is_exact(tiny_model):
  model, batch = tiny_model
  loss, tensors = model_probes.capture_layer_tensors(model, batch)
  assert set(tensors) == set(model.linear_layers())
  reference = model_probes.reference_gradient(model, batch)
  ref_loss, ref_grad = reference.loss, reference.grad
  assert loss == pytest.approx(ref_loss, rel=1e-6)
  assert float(np.mean(reference.seq_losses)) == pytest.approx(ref_loss, rel=1e-6)
  # x^T dY of the captured tensors is the BF16 model's own kernel gradient (flat in the params' tree order).
  params = nnx.state(model_probes.with_recipes(model, "bf16"), nnx.Param)
  offset, found = 0, 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = [getattr(k, "key", None) for k in path]
    name = ".".join(str(k) for k in keys[:keys.index("kernel")]) if "kernel" in keys else None
    if name in tensors:
      _, _, dw = probes.bf16_gemms(*tensors[name])
      np.testing.assert_allclose(np.asarray(ref_grad[offset:offset + leaf.size]).reshape(dw.shape), dw, rtol=0,
                                 atol=1e-2 * float(jnp.max(jnp.abs(dw))))
      found += 1
    offset += leaf.size
  assert found == len(tensors) and offset == ref_grad.size
  zero = model_probes.model_probe(model, batch, "bf16", jax.random.key(0), reference=reference, num_draws=2)
  assert zero["dloss"] == 0.0 and zero["dloss_se"] == 0.0 and np.all(zero["seq_dloss"] == 0.0)
  assert np.all(zero["grad_err"] == 0.0) and zero["grad_bias"] == 0.0


def test_model_probe_checks_keys_and_token_ids(tiny_model):
  """key=None is fine without randomness and a clear error with it (was TypeError: unexpected PRNG key type);
  token ids outside the vocabulary are refused (the embedding lookup made the loss silently NaN)."""
  model, batch = tiny_model
  reference = model_probes.reference_gradient(model, batch)
  zero = model_probes.model_probe(model, batch, "bf16", None, reference=reference, num_draws=2)
  assert zero["dloss"] == 0.0 and np.all(zero["grad_err"] == 0.0)
  with pytest.raises(ValueError, match="need randomness; pass key="):
    model_probes.model_probe(model, batch, "nvfp4", None, reference=reference)
  for field, ids in (("inputs", batch["inputs"] + 256), ("targets", batch["targets"] - 256)):
    bad = dict(batch, **{field: ids})
    with pytest.raises(ValueError, match=f"batch {field} must be token ids in \\[0, 256\\)"):
      model_probes.capture_layer_tensors(model, bad)
    with pytest.raises(ValueError, match="token ids"):
      model_probes.reference_gradient(model, bad)


def test_bad_inputs_raise():
  t = random_tensors()
  with pytest.raises(ValueError, match="power of two"):
    probes.probe_layer(t, "nvfp4", jax.random.key(0), num_draws=6)
  assert probes.bias_levels(np.int64(4)) == (1, 2)  # numpy integers are integers
  for bad in (True, 4.0):
    with pytest.raises(ValueError, match="power of two"):
      probes.bias_levels(bad)
  with pytest.raises(ValueError, match="x \\[M, K\\]"):
    probes.probe_layer(probes.LayerTensors(t.x_MxK, t.w_KxN[:32], t.dy_MxN), "nvfp4", jax.random.key(0))
  with pytest.raises(ValueError, match="need K divisible by 16"):  # the rule's check, not "pass pad=True"
    probes.probe_layer(probes.LayerTensors(t.x_MxK[:, :40], t.w_KxN[:40], t.dy_MxN), "nvfp4", jax.random.key(0))
  with pytest.raises(ValueError, match="pass key="):
    probes.probe_layer(t, "nvfp4", None)
  model = model_lib.Transformer(model_lib.get_model_config("tiny", n_layers=1), rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match="every linear layer"):
    model_probes.with_recipes(model, {"blocks.0.attn.q": recipes.nvfp4()})
  with pytest.raises(ValueError, match="batch"):
    model_probes.capture_layer_tensors(model, {"inputs": np.zeros((2, 8), np.int32)})


def test_error_measures_of_edge_cases():
  """A NaN reference scored 0 error and cosine 0 before: a diverged layer looked exact."""
  nan, one = jnp.array([jnp.nan, 1.0]), jnp.ones(2)
  assert np.isnan(float(probes.rel_error(one, nan))) and np.isnan(float(probes.rel_error(nan, one)))
  assert np.isnan(float(probes.cosine(nan, one))) and np.isnan(float(probes.cosine(one, nan)))
  zero = jnp.zeros(2)
  assert float(probes.rel_error(zero, zero)) == 0.0 and float(probes.rel_error(one, zero)) == np.inf
  assert float(probes.cosine(zero, zero)) == 1.0 and float(probes.cosine(one, zero)) == 0.0
  assert float(probes.rel_error(2 * one, one)) == 1.0 and float(probes.cosine(one, -one)) == pytest.approx(-1.0)
  # Tensors nonzero only in subnormals, which XLA:CPU's arithmetic flushes: two unrelated ones scored error 0 and
  # cosine 1 (where the arithmetic keeps subnormals, as on a GPU, they are measured).
  tiny = jnp.asarray(np.array([1e-39, 2e-39], np.float32))
  if float(jnp.sum(tiny)) == 0.0:  # this platform flushes them
    assert np.isnan(float(probes.rel_error(-tiny, tiny))) and np.isnan(float(probes.cosine(-tiny, tiny)))
    assert float(probes.rel_error(tiny, zero)) == np.inf  # a nonzero against a zero reference
  assert float(probes.rel_error(-zero, zero)) == 0.0 and float(probes.cosine(-zero, zero)) == 1.0  # -0 is zero
  t = random_tensors()
  r = probes.probe_layer(probes.LayerTensors(t.x_MxK.at[0, 0].set(jnp.nan), t.w_KxN, t.dy_MxN), "nvfp4",
                         jax.random.key(0), num_draws=2)
  assert np.isnan(float(r["fprop_err"])) and np.all(np.isnan(r["wgrad_err"])), r


def test_probes_pin_auto_gemm_mode_to_the_float32_reference():
  """"auto" is bf16 (summation order differs from f32): probes run f32 so stored results reproduce bit for bit."""
  assert probes.as_probed("nvfp4").gemm_mode == "f32"
  assert probes.as_probed(recipes.nvfp4(gemm_mode="bf16")).gemm_mode == "bf16"
  assert probes.as_probed("nvfp4").replace(gemm_mode="auto") == recipes.nvfp4()


def test_operand_stats_of_an_all_zero_operand_have_no_scale_range():
  """An all-zero operand reported scale_lo=inf, scale_hi=0 and octaves=-inf (a mean over layers became -inf)."""
  for fmt in ("nvfp4", "mxfp4"):
    st = {k: float(v) for k, v in probes.operand_stats(fp4jax.quantize(jnp.zeros((4, 64)), fmt)).items()}
    assert st["zero"] == 1.0 and st["sat"] == 0.0 and st["scale_zero"] == 1.0, (fmt, st)
    assert all(np.isnan(st[k]) for k in ("scale_lo", "scale_hi", "octaves")), (fmt, st)
  one_block = jnp.zeros((4, 64)).at[0, 0].set(1.0)
  st = probes.operand_stats(fp4jax.quantize(one_block, "nvfp4"))
  assert float(st["octaves"]) == 0.0 and float(st["scale_lo"]) == float(st["scale_hi"]) > 0


def test_cosine_and_bias_floor_of_extreme_values():
  """Finite tensors with entries above ~1e19 scored cosine and relative error NaN (sums of squares overflowed
  float32); an inf single-draw error made the bias floor 0."""
  big = jnp.asarray([3e30, 4e30, 0.0])
  assert float(probes.cosine(big, big)) == pytest.approx(1.0, abs=1e-6)
  assert float(probes.cosine(big, -2 * big)) == pytest.approx(-1.0, abs=1e-6)
  assert float(probes.cosine(big, jnp.asarray([0.0, 0.0, 1e30]))) == 0.0
  assert float(probes.rel_error(1.5 * big, big)) == pytest.approx(0.5, rel=1e-6)
  assert float(probes.rel_error(big, jnp.zeros(3))) == np.inf
  assert np.isnan(float(probes.cosine(big.at[2].set(np.inf), big)))
  assert np.isnan(probes.bias_floor({"K": [1, 2], "groups": [[np.inf, 1.0], [1.0]]}))
  assert probes.bias_floor({"K": [1, 2], "groups": [[1.0, 1.0], [1.0]]}) == 1.0


def test_wgrad_code_statistics_skip_the_token_padding():
  """M = 24 tokens pad to 32 for Wgrad's 16-blocks along M: without an RHT the 8 zero rows counted as zero codes."""
  kx, kw, kd = jax.random.split(jax.random.key(2), 3)
  t = probes.LayerTensors(jax.random.normal(kx, (24, 32)).astype(jnp.bfloat16), jax.random.normal(kw, (32, 32)),
                          jax.random.normal(kd, (24, 32)).astype(jnp.bfloat16))
  recipe = probes.as_probed("nvfp4:rht=false,stochastic_rounding=false")
  stats = probes.probe_layer(t, recipe, None, num_draws=2)["stats"]
  ops = probes.quantized_operands(t.x_MxK, t.w_KxN, recipe, jax.random.key(0))  # the key is unused
  x_wgrad = np.asarray(fp4jax.dequantize(ops.x_wgrad, jnp.float32))
  assert x_wgrad.shape[0] == 32 and not np.any(x_wgrad[24:])
  assert stats["wgrad.x"]["zero"] == pytest.approx(np.mean(x_wgrad[:24] == 0))
  fprop_x = np.asarray(fp4jax.dequantize(ops.x_fprop, jnp.float32))
  assert stats["fprop.x"]["zero"] == pytest.approx(np.mean(fprop_x == 0))
  # A diverging layer (entries ~2^58: sums of squares overflow float32) scores as the same layer scaled down; its
  # bias table was NaN (inf / inf) beside finite per-draw errors.
  big = probes.LayerTensors(t.x_MxK * 2.0**58, t.w_KxN, t.dy_MxN * 2.0**58)
  small, large = probes.probe_layer(t, recipe, None, num_draws=2), probes.probe_layer(big, recipe, None, num_draws=2)
  for gemm in ("dgrad", "wgrad"):
    for ref in probes.BIAS_REFERENCES:
      np.testing.assert_allclose(large["bias"][gemm][ref]["mean"], small["bias"][gemm][ref]["mean"], rtol=1e-4)
    np.testing.assert_allclose(large[f"{gemm}_err"], small[f"{gemm}_err"], rtol=1e-4)


def test_model_probe_averages_the_loss_of_a_random_forward(tiny_model):
  """Per-call Fprop RHT signs make the forward random: the loss was draw 0's, with an error bar blind to draws."""
  model, batch = tiny_model
  reference = model_probes.reference_gradient(model, batch)
  spec = "nvfp4:rht_on=fprop+wgrad,random_signs=per_call"
  key = jax.random.key(0)
  res = model_probes.model_probe(model, batch, spec, key, reference=reference, num_draws=2)
  quantized = model_probes.with_recipes(model, spec)
  fn, params = model_probes._loss_and_grad_fn(quantized)  # pylint: disable=protected-access
  draws = [fn(params, jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"]), jax.random.fold_in(key, d))
           for d in range(2)]
  losses = [float(d[0]) for d in draws]
  assert losses[0] != losses[1]
  assert res["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
  np.testing.assert_allclose(res["seq_dloss"], np.mean([np.asarray(d[1]) for d in draws], 0) - reference.seq_losses,
                             rtol=1e-5)
  se = np.hypot(probes.standard_error(res["seq_dloss"]), probes.standard_error(losses))
  assert res["dloss_se"] == pytest.approx(se, rel=1e-6)


def test_exact_grad_reference_of_operands_drawn_per_step_is_each_draws_own():
  """Per-call RHT signs re-draw Wgrad's x each step: every draw was compared with draw `key`'s exact gradient, so
  its rounding noise of x read as a gradient-rounding bias (K=8 floor ~0.1 vs ~0.01 with fixed signs)."""
  t = random_tensors()
  # float32 x and dY: the rule then keeps the unrounded dY in float32, as the probe's reference does.
  t = probes.LayerTensors(t.x_MxK[:64, :32].astype(jnp.float32), t.w_KxN[:32, :32],
                          t.dy_MxN[:64, :32].astype(jnp.float32))
  recipe, key, draws = probes.as_probed("nvfp4:random_signs=per_call"), jax.random.key(3), 4
  curve = probes.probe_layer(t, recipe, key, num_draws=draws)["bias"]["wgrad"]["exact_grad"]
  exact = probes.exact_gradient_recipe(recipe)
  dw, ref = [], []
  for d in range(draws):
    k = jax.random.fold_in(key, d)
    dw.append(np.float64(probes.quantized_gemms(*t, recipe, k)[2]))
    ref.append(np.float64(probes.quantized_gemms(*t, exact, k)[2]))  # the same x operand, dY unrounded
  for size, groups in zip(curve["K"], curve["groups"]):
    want = [np.linalg.norm(np.mean(dw[g:g + size], 0) - np.mean(ref[g:g + size], 0))
            / np.linalg.norm(np.mean(ref[g:g + size], 0)) for g in range(0, draws, size)]
    np.testing.assert_allclose(groups, want, rtol=1e-4)


def test_standard_error_is_the_sample_std_over_sqrt_n():
  """ddof=1: [1, 3] has sample std sqrt(2), so the standard error of its mean is 1 (ddof=0 would give 1/sqrt(2))."""
  assert probes.standard_error([1.0, 3.0]) == pytest.approx(1.0, rel=1e-12)
  assert probes.standard_error([0.0, 0.0, 3.0]) == pytest.approx(1.0, rel=1e-12)  # sample std sqrt(3)
  assert np.isnan(probes.standard_error([2.0]))


def test_rel_error_and_cosine_refuse_tensors_of_other_shapes():
  """Broadcast or flattened, they scored equal values as a 93 % error and a transposed reference as 0.91 aligned."""
  a = jnp.array([1.0, 2.0, 3.0])
  g = jnp.arange(6.0).reshape(2, 3)
  with pytest.raises(ValueError, match=r"rel_error compares tensors of one shape; got \(3,\) and \(3, 1\)"):
    probes.rel_error(a, a[:, None])
  with pytest.raises(ValueError, match="cosine compares tensors of one shape"):
    probes.cosine(g, g.T)
  assert float(probes.rel_error(a, a)) == 0.0 and float(probes.cosine(g, g)) == pytest.approx(1.0)


def test_probe_layer_runs_a_double_block_recipe_and_reports_the_tensor_amax():
  """TetraJet-v2's NVFP4 keeps one amax per 1x128 group: the probe's float() of it raised a TypeError."""
  k = jax.random.split(jax.random.key(0), 3)
  t = probes.LayerTensors(jax.random.normal(k[0], (128, 256), jnp.bfloat16),
                          0.05 * jax.random.normal(k[1], (256, 128)), jax.random.normal(k[2], (128, 128), jnp.bfloat16))
  out = probes.probe_layer(t, "tetrajet_v2", jax.random.key(1), num_draws=2)
  assert out["stats"]["fprop.x"]["amax"] == float(jnp.max(jnp.abs(t.x_MxK.astype(jnp.float32))))  # max over groups
  assert all(np.ndim(v) == 0 for s in out["stats"].values() for v in s.values())
