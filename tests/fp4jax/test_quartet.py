"""Quartet (arXiv 2505.14669): the QuEST and Tseng MXFP4 quantizers bit for bit against NumPy, the clip-masked
straight-through gradient, the fixed forward Hadamard and per-call backward signs, the preset and its training."""

import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.pretrain import data
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import policy as policy_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
import recipes_beyond_helpers as helpers
import reference as ref
import reference_recipes as rref

dg = importlib.import_module("fp4jax.dot_general")  # the module (fp4jax.dot_general is the function)
QUEST = fp4jax.MXFP4(scale_rule="quest")
TSENG = fp4jax.MXFP4(scale_rule="tseng")
_layer_operands = jax.jit(dg.layer_operands, static_argnums=2)


def _check(x, fmt, r, axis=-1):
  """quantize, dequantize and fake_quant of `fmt` equal the reference `r` bit for bit (NaN scales compared as NaN)."""
  q, mask = fp4jax.quantize_with_clip_mask(jnp.asarray(x), fmt, axis=axis)
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()), r["codes"])
  np.testing.assert_array_equal(np.asarray(q.scales, np.float64), r["scales"])
  ref.assert_same_bits(fp4jax.dequantize(q), r["dequant"])
  ref.assert_same_bits(fp4jax.fake_quant(jnp.asarray(x), fmt, axis=axis), r["dequant"])
  np.testing.assert_array_equal(np.asarray(mask), np.abs(r["scaled"]) < 6.0)
  return q, np.asarray(mask)


# ---------------------------------------------------------------- the QuEST quantizer

@pytest.mark.parametrize("kind", ["gauss", "heavy", "zeros_mixed"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_quest_bits_match_reference(kind, axis):
  x = helpers.inputs(kind, seed=3, shape=(64, 128))
  r = rref.mxfp4_quest(x, axis=axis)
  _, mask = _check(x, QUEST, r, axis=axis)
  np.testing.assert_array_equal(mask, r["mask"])
  if kind != "zeros_mixed":  # QuEST clips a few per cent of Gaussian-like elements, never most of them
    assert 0.001 < 1 - mask.mean() < 0.2


def test_quest_bfloat16_input_and_magnitudes():
  rng = np.random.default_rng(4)
  x = rng.standard_normal((16, 64)) * np.exp(rng.uniform(-60, 60, (16, 1)))  # scales from 2^-87 to 2^87
  xb = jnp.asarray(x, jnp.bfloat16)
  _check(xb, QUEST, rref.mxfp4_quest(np.asarray(xb, np.float32)))
  _check(x.astype(np.float32), QUEST, rref.mxfp4_quest(x.astype(np.float32)))


def test_quest_zero_and_constant_groups():
  """sigma = 0: the scale is 2^floor(log2 1e-8) = 2^-27; zeros stay zero (and pass the gradient), a constant
  group saturates to +-6 * 2^-27 (all clipped: no gradient), as in Quartet's kernel."""
  x = np.zeros((4, 64), np.float32)
  x[1, :32] = 3.0
  x[2, 32:] = -1e35  # constant and huge: x / 2^-27 overflows float32, still saturates
  x[3] = np.random.default_rng(0).standard_normal(64)
  r = rref.mxfp4_quest(x)
  q, mask = _check(x, QUEST, r)
  s = np.asarray(q.scales, np.float64)
  assert s[0, 0] == s[0, 1] == s[1, 0] == s[2, 1] == 2.0**-27
  codes = np.asarray(q.unpacked_codes())
  assert (codes[0] == 0).all() and mask[0].all()
  assert (codes[1, :32] == 7).all() and not mask[1, :32].any()
  assert (codes[2, 32:] == 15).all() and not mask[2, 32:].any()
  assert mask[3].mean() > 0.8


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quest_non_finite_poisons_tensor_and_scale(bad):
  x = helpers.inputs("gauss", seed=5, shape=(4, 64))
  x[2, 40] = bad
  r = rref.mxfp4_quest(x)
  q, mask = _check(x, QUEST, r)  # scales: NaN for the block holding it only
  assert np.isnan(np.asarray(q.scales, np.float64)).sum() == 1
  assert np.isnan(np.asarray(fp4jax.dequantize(q))).all()
  assert not mask[2, 40]


def test_quest_scale_is_a_power_of_two_below_the_gaussian_clip():
  """2^e <= 2.92 sigma / 6 < 2^(e+1) on random groups, sigma computed here in float64."""
  x = helpers.inputs("heavy", seed=6, shape=(32, 256))
  q = fp4jax.quantize(jnp.asarray(x), QUEST)
  s = np.asarray(q.scales, np.float64)
  c = np.std(x.astype(np.float64).reshape(32, 8, 32), axis=-1) * rref.QUEST_SCALE + rref.QUEST_EPS
  assert (s <= c).all() and (c < 2 * s).all()


def test_clip_mask_refuses_formats_that_choose_scales():
  with pytest.raises(ValueError, match="one scaling per block"):
    fp4jax.quantize_with_clip_mask(jnp.ones((2, 32)), fp4jax.NVFP4(scale_rule="4over6"))


# ---------------------------------------------------------------- the Tseng (backward) quantizer

@pytest.mark.parametrize("kind", ["gauss", "heavy", "zeros_mixed"])
def test_tseng_bits_match_reference_and_never_saturate(kind):
  x = helpers.inputs(kind, seed=7, shape=(32, 128))
  r = rref.mxfp4_tseng(x, axis=0)
  _, mask = _check(x, TSENG, r, axis=0)
  assert mask.all()  # the block max lands in [3, 6)
  assert np.abs(r["scaled"]).max() < 6.0


def test_tseng_stochastic_rounding_neighbours_and_unbiased():
  x = helpers.inputs("gauss", seed=8, shape=(4, 64))
  r = rref.mxfp4_tseng(x)
  lo, hi = ref.e2m1_neighbours(r["scaled"])
  draws = helpers.sr_dequant(x, TSENG, 2000, seed=0)  # [draws, 4, 64]
  values = draws / (ref.expand(r["scales"], 32, -1, False) * np.float32(4 / 3))  # back on the element grid
  assert np.all(np.isclose(np.abs(values), lo, rtol=1e-6) | np.isclose(np.abs(values), hi, rtol=1e-6))
  # Unbiased: the mean of 2000 draws is within 5 standard errors of x everywhere.
  se = draws.std(axis=0) / np.sqrt(draws.shape[0]) + 1e-12
  assert np.all(np.abs(draws.mean(axis=0) - x) <= 5 * se + 1e-6 * np.abs(x))


# ---------------------------------------------------------------- the recipe

def test_preset_table_and_cli_form():
  r = fp4jax.recipes.quartet()
  text = r.table()
  assert r.name == "quartet" and fp4jax.recipes.get_recipe("quartet") == r
  assert text.count("mxfp4(quest) 1x32 RNE RHT clip-masked grad") == 2
  assert text.count("mxfp4(tseng) 1x32 SR RHT") == 4 and text.count("of Fprop Q") == 2
  assert "fprop_rht_signs=none" in text and "rht_signs=per_call" in text
  assert r.needs_key and not r.dgrad_reuses_weight
  rtn = fp4jax.recipes.get_recipe("quartet:stochastic_rounding=false")
  assert rtn.name == "quartet-sr" and rtn.dgrad.lhs.rounding == "nearest"
  stored = json.loads(json.dumps(policy_lib.PrecisionPolicy(recipe=r.replace(name="hand")).to_dict()))
  assert policy_lib.PrecisionPolicy.from_dict(stored).recipe == r.replace(name="hand")


def test_bad_configs_raise():
  r = fp4jax.recipes.quartet()
  bad_op = fp4jax.recipes.OperandConfig(fmt=TSENG, clip_mask=True)
  with pytest.raises(ValueError, match="Fprop operands only"):
    r.replace(dgrad=fp4jax.recipes.GemmConfig(bad_op, bad_op))
  with pytest.raises(ValueError, match="fprop_rht_signs"):
    r.replace(fprop_rht_signs="sometimes")
  with pytest.raises(ValueError, match="scale_rule"):
    fp4jax.MXFP4(scale_rule="std")
  x = jnp.ones((4, 32))
  ops = _layer_operands(x, jnp.ones((32, 32)), r, jax.random.key(0))
  with pytest.raises(ValueError, match="x_mask"):
    dg.dgrad(jnp.ones((4, 32)), ops.w_dgrad, r, jax.random.key(0), jnp.float32)


def test_forward_hadamard_is_fixed_and_orthogonal():
  h = np.asarray(fp4jax.hadamard_matrix(32, np.ones(32)), np.float64)
  np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-6)
  np.testing.assert_array_equal(np.sign(h), ref.sylvester(32))  # plain Sylvester order, no signs
  assert (np.abs(h) == np.float32(1 / np.sqrt(32))).all()
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  r = fp4jax.recipes.quartet()
  a, b = (_layer_operands(x, w, r, jax.random.key(k)) for k in (0, 1))
  for name in ("x_fprop", "w_fprop", "x_mask", "w_mask"):
    for u, v in zip(jax.tree.leaves(getattr(a, name)), jax.tree.leaves(getattr(b, name))):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  # The Fprop operands are QuEST of x H and of H^T W along K (H: the plain Sylvester Hadamard / sqrt(32)).
  xh = np.asarray(fp4jax.random_hadamard(x, size=32, axis=1, signs=np.ones(32)))
  np.testing.assert_allclose(xh, ref.rht_apply(x, 32, np.ones(32), axis=1), atol=1e-5)
  rx = rref.mxfp4_quest(xh)
  np.testing.assert_array_equal(np.asarray(a.x_fprop.unpacked_codes()), rx["codes"])
  np.testing.assert_array_equal(np.asarray(a.x_mask), rx["mask"])
  wh = np.asarray(fp4jax.random_hadamard(w, size=32, axis=0, signs=np.ones(32)))
  np.testing.assert_array_equal(np.asarray(a.w_fprop.unpacked_codes()), rref.mxfp4_quest(wh, axis=0)["codes"])


def test_backward_signs_change_with_the_key():
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  r = fp4jax.recipes.quartet(stochastic_rounding=False)  # no SR: only the signs depend on the key
  a, b = (_layer_operands(x, w, r, jax.random.key(k)) for k in (0, 1))
  for name in ("w_dgrad", "x_wgrad"):
    assert np.mean(np.asarray(getattr(a, name).unpacked_codes()) != np.asarray(getattr(b, name).unpacked_codes())) > 0.3
  signs = [np.asarray(fp4jax.rht.resolve_signs(32, jax.random.fold_in(jax.random.key(k), dg._RHT_SIGNS)))
           for k in range(4)]
  assert len({tuple(s) for s in signs}) == 4


def _bwd_reference(x, w, g, key, mask_where):
  """dx and dW of quartet(stochastic_rounding=False) in float64 from the NumPy quantizers.

  mask_where: "before" (Quartet: mask in the Hadamard basis, then H^T), "after" (H^T, then the mask) or "none".
  """
  ones = np.ones(32)
  signs = np.asarray(fp4jax.rht.resolve_signs(32, jax.random.fold_in(key, dg._RHT_SIGNS)), np.float64)
  f32h = lambda t, axis, s: np.asarray(fp4jax.random_hadamard(jnp.asarray(t, jnp.float32), size=32, axis=axis,
                                                              signs=s), np.float64)
  qx = rref.mxfp4_quest(f32h(x, 1, ones))
  qw = rref.mxfp4_quest(f32h(w, 0, ones), axis=0)
  # Dgrad: dY and the Fprop W (dequantized, [K, N]) with the per-call RHT along N, Tseng RTN along N.
  dy_n = rref.mxfp4_tseng(f32h(g, 1, signs))["dequant"]
  w_n = rref.mxfp4_tseng(f32h(qw["dequant"], 1, signs))["dequant"]
  dx_h = dy_n @ w_n.T
  # Wgrad: dY and the Fprop x along M.
  dy_m = rref.mxfp4_tseng(f32h(g, 0, signs), axis=0)["dequant"]
  x_m = rref.mxfp4_tseng(f32h(qx["dequant"], 0, signs), axis=0)["dequant"]
  dw_h = x_m.T @ dy_m
  inv = lambda t, axis: ref.rht_apply(t, 32, ones, axis=axis, inverse=True)
  if mask_where == "before":
    return inv(dx_h * qx["mask"], 1), inv(dw_h * qw["mask"], 0)
  if mask_where == "after":
    return inv(dx_h, 1) * qx["mask"], inv(dw_h, 0) * qw["mask"]
  return inv(dx_h, 1), inv(dw_h, 0)


def test_gradients_are_masked_before_the_inverse_hadamard():
  """dx and dW of the rule equal the hand-built Quartet backward (mask in the Hadamard basis, then H^T); dropping
  the mask or applying it after H^T gives gradients far outside the tolerance."""
  rng = np.random.default_rng(11)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  x[:, 5] *= 30  # outlier channels: more clipping, a mask that matters
  w = (rng.standard_normal((64, 96)) / 8).astype(np.float32)
  g = rng.standard_normal((64, 96)).astype(np.float32)
  key = jax.random.key(3)
  r = fp4jax.recipes.quartet(stochastic_rounding=False, gemm_mode="f32")
  outs = helpers.fwd_and_grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), key, r)
  y, dx, dw = (np.asarray(t, np.float64) for t in outs)
  want = _bwd_reference(x, w, g, key, "before")
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  assert rel(dx, want[0]) < 1e-5 and rel(dw, want[1]) < 1e-5, (rel(dx, want[0]), rel(dw, want[1]))
  for wrong in ("after", "none"):
    other = _bwd_reference(x, w, g, key, wrong)
    assert rel(other[0], want[0]) > 1e-2 and rel(other[1], want[1]) > 1e-2, wrong
  # Fprop: the product of the QuEST operands (Hadamards cancel).
  qx = rref.mxfp4_quest(ref.rht_apply(x, 32, np.ones(32), axis=1))
  qw = rref.mxfp4_quest(ref.rht_apply(w, 32, np.ones(32), axis=0), axis=0)
  assert rel(np.asarray(y, np.float64), qx["dequant"] @ qw["dequant"]) < 1e-5


def test_bf16_switches_keep_the_mask_and_drop_requantization():
  """A BF16 backward still masks the clipped Fprop elements (carried to the Hadamard basis and back); a BF16
  forward re-quantizes the backward operands from the high-precision tensors."""
  rng = np.random.default_rng(14)
  x = rng.standard_normal((32, 64)).astype(np.float32)
  x[:, 3] *= 30
  w = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
  g = rng.standard_normal((32, 32)).astype(np.float32)
  bwd = fp4jax.recipes.quartet(gemm_mode="f32").with_bf16(forward=False)
  _, dx, _ = helpers.fwd_and_grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), jax.random.key(0), bwd)
  mask = rref.mxfp4_quest(np.asarray(fp4jax.random_hadamard(jnp.asarray(x), size=32, signs=np.ones(32))))["mask"]
  want = ref.rht_apply(mask * ref.rht_apply(g.astype(np.float64) @ w.T, 32, np.ones(32)), 32, np.ones(32),
                       inverse=True)
  assert not mask.all()
  np.testing.assert_allclose(np.asarray(dx), want, rtol=1e-4, atol=1e-4)
  fwd = fp4jax.recipes.quartet().with_bf16(backward=False)
  assert not fwd.fprop.quantized and not fwd.dgrad.rhs.requantize and fwd.dgrad.rhs.fmt == TSENG
  _, *grads = helpers.fwd_and_grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), jax.random.key(0), fwd)
  assert all(np.isfinite(np.asarray(t)).all() for t in grads)


def test_bf16_gemm_mode_matches_f32_up_to_rounding():
  rng = np.random.default_rng(12)
  x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
  g = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  out = {}
  for mode in ("f32", "bf16"):
    r = fp4jax.recipes.quartet(gemm_mode=mode)
    out[mode] = helpers.fwd_and_grads(x, w, g, jax.random.key(0), r)
  for a, b in zip(out["f32"], out["bf16"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))


def test_probes_run_quartet_gemms():
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(13)
  x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
  g = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  r = fp4jax.recipes.quartet(gemm_mode="f32")
  key = jax.random.key(5)
  _, dx, dw, _, _ = probes.quantized_gemms(x, w, g, r, key)
  _, want_dx, want_dw = helpers.fwd_and_grads(x, w, g, key, r)
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(want_dw))


# ---------------------------------------------------------------- training

STEPS = 8


@pytest.mark.slow
def test_quartet_trains_tiny_model(tmp_path):
  config = TrainConfig.from_options(out=str(tmp_path / "run"), model=model_lib.get_model_config("tiny", n_layers=1),
                                    data=data.DataConfig(cache_dir=str(tmp_path / "data_cache")), seq_len=32,
                                    batch_size=8, steps=STEPS, lr=1e-2, warmup_fraction=0.1, decay_fraction=0.25,
                                    eval_every=0, eval_batches=0, checkpoint_every=STEPS, progress=False,
                                    recipe="quartet")
  losses = trainer.train(config, (), log=None)["losses"]
  assert len(losses) == STEPS and all(np.isfinite(losses)), losses
  assert np.mean(losses[-3:]) < losses[0] - 1.5, losses
