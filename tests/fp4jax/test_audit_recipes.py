"""Audit of the recipe presets as they train (stochastic rounding and per-call RHT signs on): each preset's three
GEMMs through fp4jax.dot_general equal the GEMMs of operands quantized by hand from the publications' descriptions.

The other recipe tests compare the rule with references in deterministic variants (round to nearest, fixed signs);
here the rule's randomness is reproduced instead: one layer call's key gives each GEMM operand its stochastic-rounding
key fold_in(key, tag) (Dgrad dY 1, Wgrad dY 2, Dgrad W 4, Wgrad x 5) and the backward RHT its signs fold_in(key, 3).
Sources: arXiv 2509.25149 (NVIDIA), 2512.02010 (Four Over Six, mit-han-lab/fouroversix), 2510.27527 (TetraJet-v2,
thu-ml/TetraJet-v2-NVFP4Training), 2601.22813 (Quartet II, IST-DASLab/Quartet-II), 2505.14669 (Quartet,
IST-DASLab/Quartet) and 2502.20586 (Tseng et al.).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import formats
from fp4jax import mxfp4
from fp4jax import rht
from fp4jax.quantize import quantize_elements, quantize_with_clip_mask

DN = (((1,), (0,)), ((), ()))  # x [M, K] . W [K, N]
M, K, N = 128, 32, 128  # N: Quartet II's RHT-128 runs along N in Dgrad
NV = fp4jax.NVFP4()
FOUR_SIX = fp4jax.NVFP4(scale_rule="4over6")
DOUBLE = fp4jax.NVFP4(double_block=True)
EDEN = fp4jax.NVFP4(scale_rule="eden", eden_group=128)
QUEST = fp4jax.MXFP4(scale_rule="quest")
TSENG = fp4jax.MXFP4(scale_rule="tseng")

PRESETS = {
    "four_over_six": fp4jax.recipes.four_over_six(gemm_mode="f32"),
    "tetrajet_v2": fp4jax.recipes.tetrajet_v2(gemm_mode="f32"),
    "quartet2": fp4jax.recipes.quartet2(gemm_mode="f32"),
    "quartet": fp4jax.recipes.quartet(gemm_mode="f32"),
}


def _inputs(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K)) * np.exp(rng.uniform(-1, 1, (1, K)))  # uneven channels
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  g = rng.standard_normal((M, N)) * 1e-5  # gradient-sized: the tensor scale must keep its blocks in range
  return jnp.asarray(x, dtype), jnp.asarray(w, jnp.float32), jnp.asarray(g, dtype)


@functools.partial(jax.jit, static_argnames="recipe")
def _rule(x, w, g, key, recipe):
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key), x, w)
  dx, dw = vjp(g.astype(y.dtype))
  return y, dx, dw


def _deq(t, fmt, axis, tag=None, key=None, **kw):
  """Dequantized float32 values of t quantized along `axis`; stochastically rounded with fold_in(key, tag)."""
  if tag is not None:
    kw.update(rounding="stochastic", key=jax.random.fold_in(key, tag))
  return fp4jax.dequantize(fp4jax.quantize(t, fmt, axis=axis, **kw), jnp.float32)


def _h(t, size, axis, signs=None, inverse=False):
  return fp4jax.random_hadamard(t, size=size, axis=axis, signs=signs, inverse=inverse)


def _mm(a, b):
  return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)


def _published(x, w, g, key, name):
  """(y, dx, dW) of `name`'s recipe as its publication describes it, from quantizers called by hand."""
  if name == "four_over_six":
    # NVIDIA's recipe (2D weights reused by Dgrad, SR on dY, RHT-16 with the fixed signs on Wgrad), 4/6 scales on
    # every operand.
    wq = _deq(w, FOUR_SIX, 0, block_2d=True)
    return (_mm(_deq(x, FOUR_SIX, 1), wq), _mm(_deq(g, FOUR_SIX, 1, 1, key), wq.T),
            _mm(_deq(_h(x, 16, 0), FOUR_SIX, 0).T, _deq(_h(g, 16, 0), FOUR_SIX, 0, 2, key)))
  if name in ("tetrajet_v2", "quartet2"):
    # Forward: 1x16 along K, round to nearest. Backward: dY and the dequantized Fprop x and W, each RHT'd along the
    # backward GEMM's contraction axis with one fresh sign vector, then SR (TetraJet-v2: elements; Quartet II's
    # MS-EDEN: corrected block scales).
    fwd, bwd, size = (DOUBLE, DOUBLE, 16) if name == "tetrajet_v2" else (NV, EDEN, 128)
    s = jax.random.fold_in(key, 3)
    xq, wq = _deq(x, fwd, 1), _deq(w, fwd, 0)
    dx = _mm(_deq(_h(g, size, 1, s), bwd, 1, 1, key), _deq(_h(wq.astype(w.dtype), size, 1, s), bwd, 1, 4, key).T)
    dw = _mm(_deq(_h(xq.astype(x.dtype), size, 0, s), bwd, 0, 5, key).T, _deq(_h(g, size, 0, s), bwd, 0, 2, key))
    return _mm(xq, wq), dx, dw
  if name == "quartet":
    # Forward: fixed Hadamard-32 along K, QuEST, clip mask. Backward: RHT-32 with fresh signs on dY and the Fprop
    # operands (in the Hadamard basis), Tseng's 3/4 MXFP4 with SR, then the mask and the inverse Hadamard.
    ones, s = jnp.ones(32), jax.random.fold_in(key, 3)
    qx, mx = quantize_with_clip_mask(_h(x, 32, 1, ones), QUEST, axis=1)
    qw, mw = quantize_with_clip_mask(_h(w, 32, 0, ones), QUEST, axis=0)
    xq, wq = fp4jax.dequantize(qx, jnp.float32), fp4jax.dequantize(qw, jnp.float32)
    dxh = _mm(_deq(_h(g, 32, 1, s), TSENG, 1, 1, key), _deq(_h(wq.astype(w.dtype), 32, 1, s), TSENG, 1, 4, key).T)
    dwh = _mm(_deq(_h(xq.astype(x.dtype), 32, 0, s), TSENG, 0, 5, key).T, _deq(_h(g, 32, 0, s), TSENG, 0, 2, key))
    return (_mm(xq, wq), _h(jnp.where(mx, dxh, 0.0), 32, 1, ones, inverse=True),
            _h(jnp.where(mw, dwh, 0.0), 32, 0, ones, inverse=True))
  raise ValueError(name)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / np.abs(b).max()


@functools.partial(jax.jit, static_argnames="name")
def _rule_and_published(x, w, g, key, name):
  """Both in one program: one compilation per preset (the file's time is compiles)."""
  return _rule(x, w, g, key, PRESETS[name]), _published(x, w, g, key, name)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_gemms_equal_the_published_recipe(name):
  x, w, g = _inputs()
  got, want = _rule_and_published(x, w, g, jax.random.key(7), name)
  for gemm, a, b in zip(("fprop", "dgrad", "wgrad"), got, want):
    assert _rel(a, b) < 1e-5, (gemm, _rel(a, b))
  # The operands really were quantized: far from the exact products.
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  for a, exact in zip(got, (x64 @ w64, g64 @ w64.T, x64.T @ g64)):
    assert _rel(a, exact) > 1e-2


def test_constants_are_the_publications():
  """The numbers the recipes rest on, as the papers and reference repositories state them."""
  assert rht.REFERENCE_SIGNS_16 == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
  assert NV.global_range == 6 * 448 and NV.targets == (6.0,)
  assert FOUR_SIX.global_range == 6 * 256 and FOUR_SIX.targets == (6.0, 4.0)
  assert formats.EDEN_E4M3_BOUND == 255.99 and formats.EDEN_ELEM_MAX == 6 / ((17 / 16) * 0.93)
  assert EDEN.global_range == np.float32(6 / ((17 / 16) * 0.93) * 255.99)
  head = NV.replace(headroom=True)
  assert np.float32(head.targets[0]) == np.float32(6 * 16 / 17)
  assert head.global_range == np.float32(6 * 448 * 16 / 17)
  assert mxfp4.QUEST_SCALE == 2.92247856 / 6 and mxfp4.QUEST_EPS == 1e-8
  assert mxfp4.TSENG_ENCODE == 3 / 4 and mxfp4.TSENG_DECODE == 4 / 3
  assert formats.DOUBLE_BLOCK_GROUP * DOUBLE.block_size == 128
  r = fp4jax.recipes
  assert (r.nvfp4().rht_size, r.mxfp4().rht_size, r.tetrajet_v2().rht_size, r.quartet2().rht_size,
          r.quartet().rht_size) == (16, 32, 16, 128, 32)
  assert r.nvfp4().rht_signs == "fixed" and r.quartet().fprop_rht_signs == "none"
  assert all(p.rht_signs == "per_call" for p in (r.tetrajet_v2(), r.quartet2(), r.quartet()))


def test_tetrajet_v2_requantizes_the_dequantized_forward_x_in_xs_dtype():
  """As the tetrajet_v2 docstring says: the dequantized Fprop x is re-quantized in x's dtype (bfloat16 here, where
  TetraJet-v2's kernels keep float32); with a float32 x the operands are the kernels'."""
  key = jax.random.key(1)
  recipe = fp4jax.recipes.tetrajet_v2(stochastic_rounding=False, gemm_mode="f32").replace(rht_signs="fixed")
  for dtype in (jnp.bfloat16, jnp.float32):
    x, w, g = _inputs(dtype)
    _, _, dw = _rule(x, w, g, key, recipe)
    xq = _deq(x, DOUBLE, 1).astype(dtype)  # the Fprop values, rounded to x's dtype
    dy = g.astype(jnp.float32)  # y (float32 W) is float32, so is its cotangent
    want = _mm(_deq(_h(xq, 16, 0), DOUBLE, 0).T, _deq(_h(dy, 16, 0), DOUBLE, 0))
    assert _rel(dw, want) < 1e-6, dtype
  # The difference the docstring quantifies: bfloat16 rounding of the Fprop values moves re-quantized codes.
  x = _inputs(jnp.bfloat16)[0]
  xq = _deq(x, DOUBLE, 1)
  codes = lambda t: quantize_elements(_h(t, 16, 0), DOUBLE, axis=0)[0]  # E2M1 values: the codes
  moved = codes(xq.astype(jnp.bfloat16)) != codes(xq)
  assert 0.002 < float(jnp.mean(moved)) < 0.05
