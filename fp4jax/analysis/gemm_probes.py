"""One recipe's three GEMMs on one layer's fixed tensors, measured against exact products (for comparing recipes).

fp4jax.analysis.probes compares a recipe with the BF16 layer it replaces; this module compares any recipe's GEMMs
with the exact products of the same inputs, so every recipe of a comparison (BF16 included) is measured on one scale.
Given a layer's x [M, K], W [K, N] and output gradient dY [M, N] (fp4jax.analysis.model_probes.capture_layer_tensors),
draw d runs the rule's own public pieces (fp4jax.dot_general.layer_operands, fprop, dgrad, wgrad) with the layer key
fold_in(key, d), as one training step would, in gemm_mode "f32" (dequantized float32 values at HIGHEST precision:
"bf16" mode differs within float32 rounding). Outputs stay float32 (not rounded to the model's dtype). Measured:

  error      ||out_d - exact|| / ||exact|| per draw, for Fprop (y = x W), Dgrad (dx = dY W^T), Wgrad (dW = x^T dY);
             exact = the float64 product of the captured tensors.
  bias       ||mean of K draws - ref|| / ||ref|| for K = 1, 2, 4, ..., over disjoint groups of draws (mean and
             standard error across groups). Noise falls like 1/sqrt(K); a bias stays. Two references:
               "exact"  the exact product: what a training step should compute; every FP4 recipe has a floor here
                        (round-to-nearest of the forward operands never averages out);
               "qfwd"   the gradient of the quantized forward (straight-through): dY Q(W)^T for Dgrad, Q(x)^T dY for
                        Wgrad, with Q the Fprop operands (an Fprop RHT undone). A backward that is an unbiased
                        estimate of the quantized forward's gradient falls like 1/sqrt(K) here.
  chain gap  ||B_d - G|| / ||G|| per draw, B_d the draw's backward GEMM with its output-gradient operand left
             unrounded (RHT kept) and G the "qfwd" gradient: how far the backward's other operand (Dgrad's W,
             Wgrad's x) is from the Fprop one. Zero when Dgrad reuses the 2D Fprop weight codes (as
             fp4jax.analysis.probes defines it for one draw; here averaged over draws, since recipes that re-quantize
             with stochastic rounding draw that operand anew each step).
  maxima     the signed relative error of the block maxima of each stochastically rounded output-gradient operand
             (Dgrad's and Wgrad's dY, after any RHT), sum of sign(v) (q - v) / sum of |v| over the maxima v, per
             draw: negative when they shrink on average. NVIDIA's scale rule clips about half of the block maxima
             (about -1 % on Gaussian data); block scales rounded up (an unbiased rule) give 0. Weighted by |v| so
             that blocks whose E4M3 scale underflows (relative error -1 on tiny values) count as little as they
             weigh in a GEMM.
The "qfwd" series are NaN when the forward itself is random (per-call RHT signs or SR in Fprop): no fixed reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax.recipes as recipes_lib
from fp4jax.dot_general import Operands, dgrad, fprop, layer_operands, to_input_basis, wgrad
from fp4jax.analysis import probes
from fp4jax.analysis.probes import LayerTensors, rel_error
from fp4jax.qarray import QArray
from fp4jax.quantize import dequantize

GEMMS = ("fprop", "dgrad", "wgrad")
REFERENCES = ("exact", "qfwd")
# (gemm, reference) of each bias series, in the order of the raw table's first axis.
SERIES = (("fprop", "exact"), ("dgrad", "exact"), ("wgrad", "exact"), ("dgrad", "qfwd"), ("wgrad", "qfwd"))
_HIGHEST = jax.lax.Precision.HIGHEST


def exact_products(tensors: LayerTensors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(y = x W, dx = dY W^T, dW = x^T dY) in float64 (NumPy) from the captured tensors' values."""
  x, w, dy = (np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in tensors)
  return x @ w, dy @ w.T, x.T @ dy


def probe_recipe(recipe) -> recipes_lib.Recipe:
  """The recipe as probed: a Recipe or recipe string, in gemm_mode "f32" when quantized."""
  recipe = recipes_lib.get_recipe(recipe)
  return recipe.replace(gemm_mode="f32", name=recipe.name) if recipe.is_quantized else recipe


def _values(operand) -> jax.Array:
  return dequantize(operand, jnp.float32) if isinstance(operand, QArray) else operand.astype(jnp.float32)


def _mm(a, b, contract) -> jax.Array:
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(_values(a), _values(b), dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


def forward_is_random(recipe: recipes_lib.Recipe) -> bool:
  """Whether Fprop's operands depend on the layer key (per-call RHT signs or stochastic rounding in Fprop)."""
  ops = (recipe.fprop.lhs, recipe.fprop.rhs)
  return (recipe.fprop.rht and recipe.signs_of("fprop") == "per_call") or any(
      op.quantized and op.rounding == "stochastic" for op in ops)


def qfwd_gradients(dy_MxN, ops: Operands, recipe: recipes_lib.Recipe, key):
  """(dx, dW) float32: the straight-through gradient of the quantized forward y = Q(x) Q(W) for output gradient dY.

  With an Fprop RHT, Q(x) and Q(W) live in the rotated basis along K: the rule's own `to_input_basis` rotates the
  gradients back and applies the Fprop operands' clip masks, as the rule's backward does.
  """
  dx = _mm(dy_MxN, ops.w_fprop, (1, 1))
  dw = _mm(ops.x_fprop, dy_MxN, (0, 0))
  return (to_input_basis(dx, ops.x_mask, recipe, key, axis=1, in_fprop_basis=True),
          to_input_basis(dw, ops.w_mask, recipe, key, axis=0, in_fprop_basis=True, what="w"))


def _maxima_bias(q, v, axis: int) -> jax.Array:
  """sum sign(v) (q - v) / sum |v| over the block maxima v of `v` (blocks of q's block size along `axis`)."""
  bs = q.fmt.block_size
  vq = jnp.moveaxis(_values(q), axis, -1)
  vv = jnp.moveaxis(v.astype(jnp.float32), axis, -1)
  vq = vq.reshape(-1, vq.shape[-1] // bs, bs)
  vv = vv.reshape(-1, vv.shape[-1] // bs, bs)
  idx = jnp.argmax(jnp.abs(vv), axis=-1)[..., None]
  vmax = jnp.take_along_axis(vv, idx, axis=-1)[..., 0]
  qmax = jnp.take_along_axis(vq, idx, axis=-1)[..., 0]
  den = jnp.sum(jnp.abs(vmax))
  return jnp.sum(jnp.sign(vmax) * (qmax - vmax)) / jnp.where(den > 0, den, 1.0)


def _sr_operand(cfg) -> bool:
  return cfg.quantized and cfg.rounding == "stochastic" and getattr(cfg.fmt, "block_size", 0) > 0


def _draw(x_MxK, w_KxN, dy_MxN, recipe, key, qfwd_ref):
  """One training step's GEMM outputs (y, dx, dW), chain gaps [2] and block-maxima biases [2] for layer key `key`."""
  nan = jnp.float32(jnp.nan)
  if not recipe.is_quantized:
    c = x_MxK.dtype
    y = _mm(x_MxK.astype(c), w_KxN.astype(c), (1, 0))
    dx = _mm(dy_MxN.astype(c), w_KxN.astype(c), (1, 1))
    dw = _mm(x_MxK.astype(c), dy_MxN.astype(c), (0, 0))
    return y, dx, dw, jnp.zeros((2,), jnp.float32), jnp.stack([nan, nan])
  dy = dy_MxN.astype(jnp.float32)  # the rule receives the float32 cotangent of its float32 output
  ops = layer_operands(x_MxK, w_KxN, recipe, key)
  y = fprop(ops, recipe)
  dx, dyq = dgrad(dy, ops.w_dgrad, recipe, key, x_MxK.dtype, ops.x_mask)
  dw, dyq_t = wgrad(dy, ops.x_wgrad, recipe, key, x_MxK.dtype, ops.w_mask)
  unrounded = probes.exact_gradient_recipe(recipe)
  dx_u, dy_v = dgrad(dy, ops.w_dgrad, unrounded, key, jnp.float32, ops.x_mask)
  # dY padded as Wgrad pads x (the unrounded recipe may need a smaller token multiple).
  dy_pad = jnp.pad(dy, ((0, ops.x_wgrad.shape[0] - dy.shape[0]), (0, 0)))
  dw_u, dy_v_t = wgrad(dy_pad, ops.x_wgrad, unrounded, key, jnp.float32, ops.w_mask)
  dx_c, dw_c = qfwd_ref if qfwd_ref is not None else qfwd_gradients(dy, ops, recipe, key)
  chain = jnp.stack([rel_error(dx_u, dx_c), rel_error(dw_u, dw_c)])
  maxima = jnp.stack([_maxima_bias(dyq, dy_v, 1) if _sr_operand(recipe.dgrad.lhs) else nan,
                      _maxima_bias(dyq_t, dy_v_t, 0) if _sr_operand(recipe.wgrad.lhs) else nan])
  return y, dx, dw, chain, maxima


def _probe(x_MxK, w_KxN, dy_MxN, exact, key, recipe, num_draws):
  levels = probes.bias_levels(num_draws)
  n_levels = len(levels)
  y_ex, dx_ex, dw_ex = exact
  qfwd_ref = None
  if recipe.is_quantized and not forward_is_random(recipe):
    ops0 = layer_operands(x_MxK, w_KxN, recipe, key)  # with the backward: clip masks come with it
    qfwd_ref = qfwd_gradients(dy_MxN.astype(jnp.float32), ops0, recipe, key)
  elif not recipe.is_quantized:
    c = x_MxK.dtype
    qfwd_ref = (_mm(dy_MxN.astype(c), w_KxN.astype(c), (1, 1)), _mm(x_MxK.astype(c), dy_MxN.astype(c), (0, 0)))
  refs = [y_ex, dx_ex, dw_ex] + ([qfwd_ref[0], qfwd_ref[1]] if qfwd_ref is not None else [None, None])
  gemm_of_series = [GEMMS.index(g) for g, _ in SERIES]

  def series_errors(sums, scale_L):
    out = []
    for s, ref in enumerate(refs):
      if ref is None:
        out.append(jnp.full((n_levels,), jnp.nan, jnp.float32))
        continue
      mean_L = sums[gemm_of_series[s]] * scale_L[:, None, None]
      num = probes.level_norms(mean_L - ref[None])
      den = probes.level_norms(ref[None])[0]
      out.append(jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0)))
    return jnp.stack(out)  # [series, L]

  def draw_metrics(outs, chain, maxima):
    errs = jnp.stack([rel_error(o, r) for o, r in zip(outs, (y_ex, dx_ex, dw_ex))])
    return jnp.concatenate([errs, chain, maxima])  # [3 + 2 + 2]

  sizes_L = jnp.asarray(levels, jnp.int32)
  if not recipe.needs_key:
    y, dx, dw, chain, maxima = _draw(x_MxK, w_KxN, dy_MxN, recipe, key, qfwd_ref)
    errors = series_errors((y[None], dx[None], dw[None]), jnp.ones((n_levels,), jnp.float32))
    table = jnp.broadcast_to(errors[:, :, None], (len(SERIES), n_levels, num_draws))
    per_draw = jnp.broadcast_to(draw_metrics((y, dx, dw), chain, maxima)[:, None], (7, num_draws))
    return table, per_draw

  def body(d, carry):
    sums, table, per_draw = carry
    y, dx, dw, chain, maxima = _draw(x_MxK, w_KxN, dy_MxN, recipe, jax.random.fold_in(key, d), qfwd_ref)
    per_draw = per_draw.at[:, d].set(draw_metrics((y, dx, dw), chain, maxima))
    sums = tuple(s + o[None] for s, o in zip(sums, (y, dx, dw)))
    # Level l closes a group of sizes_L[l] draws every sizes_L[l] draws: record its error, restart its sum.
    done_L = (d + 1) % sizes_L == 0
    errors = series_errors(sums, 1.0 / sizes_L.astype(jnp.float32))
    rows, groups = jnp.arange(n_levels), d // sizes_L
    table = table.at[:, rows, groups].set(jnp.where(done_L[None], errors, table[:, rows, groups]))
    sums = tuple(jnp.where(done_L[:, None, None], 0.0, s) for s in sums)
    return sums, table, per_draw

  init = (tuple(jnp.zeros((n_levels,) + r.shape, jnp.float32) for r in (y_ex, dx_ex, dw_ex)),
          jnp.full((len(SERIES), n_levels, num_draws), jnp.nan, jnp.float32),
          jnp.zeros((7, num_draws), jnp.float32))
  _, table, per_draw = jax.lax.fori_loop(0, num_draws, body, init)
  return table, per_draw


_probe_jit = jax.jit(_probe, static_argnums=(5, 6))


def probe_gemms(tensors: LayerTensors, recipe, key, *, num_draws: int = 16) -> dict[str, Any]:
  """Error, bias curves, chain gap and block-maxima bias of `recipe`'s GEMMs on one layer's fixed tensors.

  Args:
    tensors: the layer's x [M, K], W [K, N], dY [M, N] (x and dY in the model's compute dtype).
    recipe: a Recipe or recipe string (run in gemm_mode "f32").
    key: PRNG key; draw d uses fold_in(key, d) as the layer key of one training step (None for recipes without
      randomness).
    num_draws: draws, a power of two >= 2; bias levels K = 1 .. num_draws / 2.

  Returns numpy / float values: err {gemm: [num_draws]} (vs the exact product); bias {gemm: {reference: {"K",
  "mean", "se", "groups"}}} for the SERIES; chain {"dgrad", "wgrad": [num_draws]}; maxima {"dgrad", "wgrad":
  [num_draws]} (NaN where that dY operand is not stochastically rounded FP4).
  """
  recipe = probe_recipe(recipe)
  key = probes.check_layer(tensors, recipe, key, "probe_gemms")
  x, w, dy = tensors
  exact = tuple(jnp.asarray(p, jnp.float32) for p in exact_products(tensors))
  table, per_draw = jax.device_get(_probe_jit(x, w, dy, exact, key, recipe, num_draws))
  table, per_draw = np.asarray(table, np.float64), np.asarray(per_draw, np.float64)
  levels = probes.bias_levels(num_draws)
  bias: dict[str, dict[str, Any]] = {}
  for s, (gemm, ref) in enumerate(SERIES):
    groups = [table[s, l, :num_draws // k] for l, k in enumerate(levels)]
    bias.setdefault(gemm, {})[ref] = {"K": list(levels), "mean": [float(g.mean()) for g in groups],
                                      "se": [probes.standard_error(g) for g in groups],
                                      "groups": [g.tolist() for g in groups]}
  return {"recipe": recipe.name, "err": dict(zip(GEMMS, per_draw[:3])), "bias": bias,
          "chain": {"dgrad": per_draw[3], "wgrad": per_draw[4]},
          "maxima": {"dgrad": per_draw[5], "wgrad": per_draw[6]}}
