"""Low-noise probes of a recipe's numerics on fixed tensors: no training trajectory, so no seed-to-seed noise.

A BF16 forward/backward of a trained model on fixed batches captures, per linear layer, its input x [M, K], weight
W [K, N] and output gradient dY [M, N] (fp4jax.analysis.model_probes.capture_layer_tensors). Each recipe's three
GEMMs, run by fp4jax.dot_general's own public pieces, are then applied to those SAME tensors (`probe_layer`) and
compared with the BF16 GEMMs the model trains with:

  error   ||out - out_bf16|| / ||out_bf16|| for Fprop (y), Dgrad (dx) and Wgrad (dW), per stochastic-rounding
          draw; cosine similarity likewise.
  bias    ||mean of K draws - reference|| / ||reference|| for K = 1, 2, 4, ... over disjoint groups of draws (mean
          and standard error across groups). Noise averages away like 1/sqrt(K); a bias stays. References:
            "bf16"       the BF16 GEMM (total error; the deterministic weight/activation rounding never averages out),
            "exact_grad" the same recipe with its output-gradient operand left unrounded (RHT kept): isolates the
                         gradient rounding, which stochastic rounding makes unbiased and round-to-nearest does not
                         (where the other operand is drawn per step, by per-call RHT signs or stochastic rounding of
                         a re-quantized W or x, each draw's own: the mean of K draws against the mean of theirs),
            "chain"      the exact gradient of the quantized forward (straight-through): dY Wq_fprop^T for Dgrad,
                         Q_fprop(x)^T dY for Wgrad.
  chain   the Dgrad weight's distance from the Fprop weight, ||dY (Wq_dgrad - Wq_fprop)^T|| / ||dY Wq_fprop^T||:
          zero when Dgrad reuses the 2D Fprop codes, non-zero for 1D weights re-quantized along N. Wgrad's analogue
          compares its activation operand with Fprop's (always different: blocks along M, RHT).
  codes   per quantized operand: fraction of zero and of saturated (+-6) E2M1 codes, tensor amax, block-scale range.

Whole-model probes (capture, loss and gradient under per-layer recipes) are in fp4jax.analysis.model_probes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax.recipes as recipes_lib
from fp4jax.dot_general import (Operands, check_layer_shape, dgrad, dgrad_gradient, fprop, layer_operands,
                                to_input_basis, wgrad, wgrad_gradient)
from fp4jax import formats
from fp4jax.qarray import QArray
from fp4jax.quantize import dequantize

BIAS_REFERENCES = ("bf16", "exact_grad", "chain")
# Operands a recipe quantizes, by "gemm.operand" (Dgrad's W is Fprop's when the recipe reuses it).
OPERANDS = ("fprop.x", "fprop.W", "dgrad.dY", "dgrad.W", "wgrad.dY", "wgrad.x")
_HIGHEST = jax.lax.Precision.HIGHEST


def as_probed(recipe) -> recipes_lib.Recipe:
  """A Recipe or recipe string, with gemm_mode "auto" pinned to "f32" (the float32 reference GEMMs).

  "auto" is "bf16" on every platform, equal to "f32" only up to float32 summation order; probing in "f32" keeps
  probe results reproducible bit for bit across platforms and from earlier runs. An explicit mode is kept.
  """
  recipe = recipes_lib.get_recipe(recipe)
  return recipe.replace(gemm_mode="f32", name=recipe.name) if recipe.gemm_mode == "auto" else recipe


def recipe_variants() -> dict[str, recipes_lib.Recipe]:
  """The recipes the probes compare by default: BF16, the paper's NVFP4, NVFP4 minus one component, MXFP4."""
  return {
      "bf16": recipes_lib.bf16(),
      "nvfp4": recipes_lib.nvfp4(),
      "nvfp4-noRHT": recipes_lib.nvfp4(rht=False),
      "nvfp4-noSR": recipes_lib.nvfp4(stochastic_rounding=False),
      "nvfp4-no2D": recipes_lib.nvfp4(weight_2d=False),
      "mxfp4": recipes_lib.mxfp4(),
  }


# --- small reductions --------------------------------------------------------------------------------------------

def _norm(v, axis=None) -> jax.Array:
  """Frobenius norm of a float32 array (over `axis`), scaled by its max |v| first: a plain sum of squares overflows
  to inf from |v| ~ 1e19 (a diverging layer), and inf / inf made errors and cosines NaN. inf / NaN give inf / NaN."""
  if not v.size:
    return jnp.zeros(jnp.sum(v, axis=axis).shape, jnp.float32)
  m = jnp.max(jnp.abs(v), axis=axis, keepdims=True)
  scale = jnp.where(jnp.isfinite(m) & (m > 0), m, 1.0)
  norm = jnp.squeeze(scale, axis) * jnp.sqrt(jnp.sum(jnp.square(v / scale), axis=axis))
  return jnp.where(jnp.isfinite(jnp.squeeze(m, axis)), norm, jnp.squeeze(m, axis))


def level_norms(v_LxMxN) -> jax.Array:
  """[L] Frobenius norms of the [M, N] slices of a stack, overflow-safe as `rel_error`'s."""
  return _norm(v_LxMxN, axis=(1, 2))


def _hidden_nonzero(v, norm) -> jax.Array:
  """True when `v` has a zero norm yet nonzero entries: subnormals only, which XLA:CPU's arithmetic reads as 0."""
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0x7FFFFFFF)  # -0 is zero
  return (norm == 0) & jnp.any(bits != 0)


def _check_same_shape(what: str, a, b) -> None:
  # Broadcasting ([3] against [3, 1]) or flattening (g against g.T) would score unrelated entries against each other.
  if a.shape != b.shape:
    raise ValueError(f"{what} compares tensors of one shape; got {a.shape} and {b.shape}.")


def rel_error(a, ref) -> jax.Array:
  """||a - ref|| / ||ref|| in float32 (0 when both are zero, inf when ref is zero and a is not; NaN when either
  holds a NaN: a diverged tensor must not score as exact; NaN too when ref is nonzero only in subnormals, which
  XLA:CPU's arithmetic flushes to zero: a vanished gradient must not score as exact either)."""
  a, ref = jnp.asarray(a, jnp.float32), jnp.asarray(ref, jnp.float32)
  _check_same_shape("rel_error", a, ref)
  num, den = _norm(a - ref), _norm(ref)
  num = jnp.where(_hidden_nonzero(a, num) & (den == 0), jnp.inf, num)  # a nonzero against a zero ref (a - ref = a)
  out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))
  return jnp.where(jnp.isnan(num) | jnp.isnan(den) | _hidden_nonzero(ref, den), jnp.nan, out)


def cosine(a, b) -> jax.Array:
  """Cosine similarity of two tensors as flat vectors (1 when both are zero, 0 when only one is, NaN when either
  holds a NaN or is nonzero only in subnormals: XLA:CPU reads those as zero, so their direction is unmeasured)."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  _check_same_shape("cosine", a, b)
  a, b = jnp.ravel(a), jnp.ravel(b)
  na, nb = _norm(a), _norm(b)
  na = jnp.where(_hidden_nonzero(a, na), jnp.nan, na)
  nb = jnp.where(_hidden_nonzero(b, nb), jnp.nan, nb)
  # Unit vectors first: a.b and |a| |b| overflow float32 (inf / inf = NaN) from norms of ~1e19.
  ua, ub = a / jnp.where(na > 0, na, 1.0), b / jnp.where(nb > 0, nb, 1.0)
  out = jnp.where((na > 0) & (nb > 0), jnp.dot(ua, ub, precision=_HIGHEST),
                  jnp.where((na == 0) & (nb == 0), 1.0, 0.0))
  return jnp.where(jnp.isnan(na) | jnp.isnan(nb), jnp.nan, out)


def standard_error(values) -> float:
  """Standard error of the mean of `values` (NaN with fewer than two values)."""
  v = np.asarray(values, np.float64)
  return float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size >= 2 else float("nan")


def bias_levels(num_draws: int) -> tuple[int, ...]:
  """Group sizes K = 1, 2, 4, ..., num_draws / 2: every level has at least two disjoint groups (for an error bar)."""
  if isinstance(num_draws, bool) or not isinstance(num_draws, (int, np.integer)) or num_draws < 2 or (
      num_draws & (num_draws - 1)):
    raise ValueError(f"num_draws must be a power of two >= 2; got {num_draws!r}.")
  return tuple(2**l for l in range(int(math.log2(int(num_draws)))))


# --- one layer's GEMM inputs ------------------------------------------------------------------------------------

class LayerTensors(NamedTuple):
  """One linear layer's GEMM inputs from the BF16 model: x [M, K] and dY [M, N] in the compute dtype, W [K, N]."""

  x_MxK: jax.Array
  w_KxN: jax.Array
  dy_MxN: jax.Array


def check_layer(tensors: LayerTensors, recipe: recipes_lib.Recipe, key, what: str):
  """`key` (a placeholder when None and the recipe draws nothing) once x [M, K], W [K, N], dY [M, N] fit `recipe`
  as fp4jax.dot_general checks a layer (block and RHT sizes dividing K and N); else ValueError naming `what`."""
  x, w, dy = tensors
  if x.ndim != 2 or w.ndim != 2 or dy.ndim != 2 or x.shape[1] != w.shape[0] or dy.shape != (x.shape[0], w.shape[1]):
    raise ValueError(f"{what} needs x [M, K], W [K, N], dY [M, N]; got {x.shape}, {w.shape}, {dy.shape}.")
  check_layer_shape(*w.shape, recipe)  # otherwise the quantizer's error suggests a pad=True no probe takes
  if key is None:
    if recipe.needs_key:
      raise ValueError(f"{what}: recipe {recipe.name!r} uses stochastic rounding or random RHT signs; pass key=.")
    return jax.random.key(0)  # every draw is the same: the key is never used
  return key


# --- one layer's GEMMs under a recipe ----------------------------------------------------------------------------

def _f32(operand) -> jax.Array:
  return dequantize(operand, jnp.float32) if isinstance(operand, QArray) else operand.astype(jnp.float32)


def _mm(a, b, contract) -> jax.Array:
  """float32 product of two operands' values contracting (a_axis, b_axis), as the rule's xla backend computes it."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(_f32(a), _f32(b), dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


def bf16_gemms(x_MxK, w_KxN, dy_MxN, compute_dtype=jnp.bfloat16):
  """(y, dx, dW) float32 of a BF16 linear layer as fp4jax.nn.Linear trains it (outputs rounded as it rounds them)."""
  def layer(x, w):
    y = jax.lax.dot_general(x.astype(compute_dtype), w.astype(compute_dtype), (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(compute_dtype)
  y, vjp = jax.vjp(layer, x_MxK.astype(compute_dtype), w_KxN)
  dx, dw = vjp(dy_MxN.astype(compute_dtype))
  return y.astype(jnp.float32), dx.astype(jnp.float32), dw.astype(jnp.float32)


def quantized_operands(x_MxK, w_KxN, recipe: recipes_lib.Recipe, key) -> Operands:
  """Fprop's x and W, Dgrad's W and Wgrad's x, built by fp4jax.dot_general's own `layer_operands`."""
  return layer_operands(x_MxK, w_KxN, recipe, key)


def quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe: recipes_lib.Recipe, key, operands: Operands | None = None):
  """(y, dx, dW, dy_dgrad, dy_wgrad) of a quantized recipe on fixed tensors, as fp4jax.dot_general computes them.

  The rule's own functions (fp4jax.dot_general.layer_operands, fprop, dgrad, wgrad) with one `key` per layer call,
  so y, dx and dW equal jax.vjp of fp4jax.dot_general bit for bit; each output is rounded to its dtype as
  fp4jax.nn.Linear and the rule round them. `operands` (from quantized_operands) skips recomputing the
  key-independent operands between draws.
  """
  ops = quantized_operands(x_MxK, w_KxN, recipe, key) if operands is None else operands
  dy = dy_MxN.astype(jnp.float32)  # the rule receives the float32 cotangent of its float32 output
  y = fprop(ops, recipe).astype(x_MxK.dtype).astype(jnp.float32)
  dx, dyq = dgrad(dy, ops.w_dgrad, recipe, key, x_MxK.dtype, ops.x_mask)
  dw, dyq_t = wgrad(dy, ops.x_wgrad, recipe, key, x_MxK.dtype, ops.w_mask)
  return (y, dx.astype(x_MxK.dtype).astype(jnp.float32), dw.astype(w_KxN.dtype).astype(jnp.float32), dyq,
          dyq_t)


def exact_gradient_recipe(recipe: recipes_lib.Recipe) -> recipes_lib.Recipe:
  """`recipe` with the output-gradient operands of Dgrad and Wgrad left unrounded (RHT still applied)."""
  unrounded = lambda op: dataclasses.replace(op, fmt=None, rounding="nearest")
  return recipe.replace(name=recipe.name + "-exactgrad",
                        dgrad=recipes_lib.GemmConfig(unrounded(recipe.dgrad.lhs), recipe.dgrad.rhs),
                        wgrad=recipes_lib.GemmConfig(unrounded(recipe.wgrad.lhs), recipe.wgrad.rhs))


def _exact_grads(dy_MxN, recipe, key, ops: Operands):
  """(dx, dW) float32 of `recipe` on the operands `ops` with its output-gradient operands left unrounded."""
  dy = dy_MxN.astype(jnp.float32)
  m = dy.shape[0]
  exact = exact_gradient_recipe(recipe)
  # Pad dY as Wgrad pads x (the exact-gradient recipe may need a smaller token multiple).
  dy_pad = jnp.pad(dy, ((0, ops.x_wgrad.shape[0] - m), (0, 0)))
  dx = to_input_basis(_mm(dgrad_gradient(dy, exact, key, jnp.float32), ops.w_dgrad, (1, 1))[:m], ops.x_mask, recipe,
                      key, axis=1, in_fprop_basis=recipe.dgrad.rhs.requantize)
  dw = to_input_basis(_mm(ops.x_wgrad, wgrad_gradient(dy_pad, exact, key, jnp.float32), (0, 0)), ops.w_mask, recipe,
                      key, axis=0, in_fprop_basis=recipe.wgrad.rhs.requantize, what="w")
  return dx, dw


def _references(x_MxK, w_KxN, dy_MxN, recipe, key, ops: Operands):
  """{"bf16", "exact_grad", "chain"} references for dx and dW (float32); see the module docstring."""
  y_ref, dx_ref, dw_ref = bf16_gemms(x_MxK, w_KxN, dy_MxN, x_MxK.dtype)
  dy = dy_MxN.astype(jnp.float32)
  # Gradients of the Fprop inputs come back from the Fprop RHT basis and get their clip masks as the rule's do.
  dx_chain = to_input_basis(_mm(dy, ops.w_fprop, (1, 1)), ops.x_mask, recipe, key, axis=1, in_fprop_basis=True)
  dw_chain = to_input_basis(_mm(ops.x_fprop, dy, (0, 0)), ops.w_mask, recipe, key, axis=0, in_fprop_basis=True,
                            what="w")
  dx_exact, dw_exact = _exact_grads(dy_MxN, recipe, key, ops)
  refs_dx = {"bf16": dx_ref, "exact_grad": dx_exact, "chain": dx_chain}
  refs_dw = {"bf16": dw_ref, "exact_grad": dw_exact, "chain": dw_chain}
  return y_ref, refs_dx, refs_dw


# --- code statistics ----------------------------------------------------------------------------------------------

def operand_stats(q, rows: int | None = None) -> dict[str, jax.Array]:
  """{zero, sat, amax, scale_lo, scale_hi, octaves, scale_zero, scale_subnormal} of an FP4 QArray ({} otherwise).

  zero / sat: fractions of E2M1 codes that are +-0 / +-6. amax: the tensor's max |x|. scale_lo / scale_hi: the
  smallest / largest non-zero block scale (NVFP4: the stored E4M3 value, whose range is [2^-9, 448]; MXFP4: 2^e);
  octaves: log2(scale_hi / scale_lo); all three NaN when every block's scale is 0. scale_zero: fraction of blocks
  whose scale is 0 (all-zero or underflowed blocks; MXFP4: the smallest exponent). scale_subnormal: NVFP4 blocks
  whose E4M3 scale is subnormal (< 2^-6). rows: count the codes of the first `rows` rows only (Wgrad's operands
  without an RHT along M: the zero rows padding the tokens are not data; the scale statistics still count every
  block).
  """
  if not isinstance(q, QArray) or not q.fmt.is_fp4:
    return {}
  shape = q.orig_shape if rows is None else (min(rows, q.orig_shape[0]), *q.orig_shape[1:])
  magnitude = q.unpacked_codes()[tuple(slice(0, n) for n in shape)] & 7
  if isinstance(q.fmt, formats.NVFP4):
    s = q.scales.astype(jnp.float32)
    empty = s == 0
    subnormal = jnp.mean((~empty) & (s < 2.0**-6))
  else:
    from fp4jax import mxfp4  # pylint: disable=g-import-not-at-top
    e, _ = mxfp4.decode_exponents(q.scales)
    s = jnp.exp2(e.astype(jnp.float32))
    empty = e <= mxfp4.E8M0_MIN_EXPONENT
    subnormal = jnp.float32(0.0)
  # No non-zero block (an all-zero operand): no scale range; NaN, not lo=inf, hi=0 and octaves=-inf.
  any_block = jnp.any(~empty)
  lo = jnp.where(any_block, jnp.min(jnp.where(empty, jnp.inf, s)), jnp.nan)
  hi = jnp.where(any_block, jnp.max(jnp.where(empty, 0.0, s)), jnp.nan)
  # jnp.max: NVFP4 double-block scaling (TetraJet-v2) stores one amax per 1x128 group.
  return {"zero": jnp.mean(magnitude == 0), "sat": jnp.mean(magnitude == 7),
          "amax": jnp.max(q.amax.astype(jnp.float32)),
          "scale_lo": lo, "scale_hi": hi, "octaves": jnp.log2(hi / lo), "scale_zero": jnp.mean(empty),
          "scale_subnormal": subnormal}


# --- the per-layer probe ------------------------------------------------------------------------------------------

def _operands_need_key(recipe) -> bool:
  """Whether layer_operands depends on the layer key (then each draw rebuilds them, as the rule does per call):
  per-call RHT signs, or stochastic rounding of Dgrad's W or Wgrad's x (re-quantized Fprop operands)."""
  sr = lambda op: op.quantized and op.rounding == "stochastic"
  per_call = any(recipe.signs_of(g) == "per_call" for g in ("fprop", "dgrad", "wgrad"))  # Fprop's may differ
  return per_call or (sr(recipe.dgrad.rhs) and not recipe.dgrad_reuses_weight) or sr(recipe.wgrad.rhs)


def _probe_layer(x_MxK, w_KxN, dy_MxN, key, recipe, num_draws):
  levels = bias_levels(num_draws)
  fresh = False
  if not recipe.is_quantized:
    y_ref, dx_ref, dw_ref = bf16_gemms(x_MxK, w_KxN, dy_MxN, x_MxK.dtype)
    refs_dx = dict.fromkeys(BIAS_REFERENCES, dx_ref)
    refs_dw = dict.fromkeys(BIAS_REFERENCES, dw_ref)
    draw = lambda k: bf16_gemms(x_MxK, w_KxN, dy_MxN, x_MxK.dtype)[1:]
    y, stats = y_ref, {}
    ops = Operands(x_MxK, w_KxN, w_KxN, x_MxK)
  else:
    ops = quantized_operands(x_MxK, w_KxN, recipe, key)
    y_ref, refs_dx, refs_dw = _references(x_MxK, w_KxN, dy_MxN, recipe, key, ops)
    fresh = _operands_need_key(recipe)
    def draw(k):
      if not fresh:
        return quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe, k, ops)[1:3]
      # Operands drawn anew each step: the "exact_grad" reference is this draw's own (same operands, dY unrounded).
      ops_k = quantized_operands(x_MxK, w_KxN, recipe, k)
      return quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe, k, ops_k)[1:3] + _exact_grads(dy_MxN, recipe, k, ops_k)
    y, _, _, dyq, dyq_t = quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe, jax.random.fold_in(key, 0),
                                          None if fresh else ops)
    # Wgrad pads the tokens with zero rows; an RHT along M mixes them into the data, so they count only with one.
    rows = None if recipe.wgrad.rht else x_MxK.shape[0]
    stats = {"fprop.x": operand_stats(ops.x_fprop), "fprop.W": operand_stats(ops.w_fprop),
             "dgrad.dY": operand_stats(dyq), "dgrad.W": operand_stats(ops.w_dgrad),
             "wgrad.dY": operand_stats(dyq_t, rows), "wgrad.x": operand_stats(ops.x_wgrad, rows)}
    stats = {k: v for k, v in stats.items() if v}

  n_refs, n_levels = len(BIAS_REFERENCES), len(levels)
  sizes_L = jnp.asarray(levels, jnp.int32)

  def series_errors(mean_dx_L, mean_dw_L, exact_dx_L=None, exact_dw_L=None):
    """[2 * refs, L] relative errors of per-level means (dgrad refs first, then wgrad refs); exact_*_L: per-level
    means of the draws' own "exact_grad" references (operands drawn per step), else the fixed references."""
    def rel(mean_L, ref):
      ref = ref if ref.ndim == 3 else ref[None]
      num = level_norms(mean_L - ref)
      den = jnp.broadcast_to(level_norms(ref), num.shape)
      return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))
    own = {"dgrad": exact_dx_L, "wgrad": exact_dw_L}
    out = []
    for gemm, mean_L, refs in (("dgrad", mean_dx_L, refs_dx), ("wgrad", mean_dw_L, refs_dw)):
      out += [rel(mean_L, own[gemm] if r == "exact_grad" and own[gemm] is not None else refs[r])
              for r in BIAS_REFERENCES]
    return jnp.stack(out)

  def per_draw_metrics(dx, dw):
    return jnp.stack([rel_error(dx, refs_dx["bf16"]), cosine(dx, refs_dx["bf16"]),
                      rel_error(dw, refs_dw["bf16"]), cosine(dw, refs_dw["bf16"])])

  if not recipe.needs_key:
    # Every draw is the same: the mean of any K draws is the single draw, so each group has the same error.
    dx, dw = draw(key)[:2]
    errors = series_errors(dx[None], dw[None])  # [series, 1]
    table = jnp.broadcast_to(errors[:, :, None], (2 * n_refs, n_levels, num_draws))
    per_draw = jnp.broadcast_to(per_draw_metrics(dx, dw)[:, None], (4, num_draws))
  else:
    def body(d, carry):
      sums, table, per_draw = carry  # sums: dx, dW (and with fresh operands their exact_grad references) [L, ...]
      outs = draw(jax.random.fold_in(key, d))
      per_draw = per_draw.at[:, d].set(per_draw_metrics(*outs[:2]))
      sums = tuple(s + o[None] for s, o in zip(sums, outs))
      # Level l closes a group of sizes_L[l] draws every sizes_L[l] draws: record its error, restart its sum.
      done_L = (d + 1) % sizes_L == 0
      scale_L = 1.0 / sizes_L.astype(jnp.float32)
      errors = series_errors(*(s * scale_L[:, None, None] for s in sums))
      rows, groups = jnp.arange(n_levels), d // sizes_L
      table = table.at[:, rows, groups].set(jnp.where(done_L[None], errors, table[:, rows, groups]))
      sums = tuple(jnp.where(done_L[:, None, None], 0.0, s) for s in sums)
      return sums, table, per_draw

    shapes = (refs_dx["bf16"].shape, refs_dw["bf16"].shape) * (2 if fresh else 1)
    init = (tuple(jnp.zeros((n_levels,) + shape, jnp.float32) for shape in shapes),
            jnp.full((2 * n_refs, n_levels, num_draws), jnp.nan, jnp.float32),
            jnp.zeros((4, num_draws), jnp.float32))
    _, table, per_draw = jax.lax.fori_loop(0, num_draws, body, init)

  return {
      "fprop_err": rel_error(y, y_ref), "fprop_cos": cosine(y, y_ref),
      "dgrad_err": per_draw[0], "dgrad_cos": per_draw[1], "wgrad_err": per_draw[2], "wgrad_cos": per_draw[3],
      "bias": table,  # [series (dgrad x 3 refs, wgrad x 3 refs), level, group]; NaN beyond each level's groups
      "chain_dgrad": rel_error(refs_dx["exact_grad"], refs_dx["chain"]),
      "chain_wgrad": rel_error(refs_dw["exact_grad"], refs_dw["chain"]),
      "weight_mismatch": rel_error(_f32(ops.w_dgrad), _f32(ops.w_fprop)),
      "stats": stats,
  }


_probe_layer_jit = jax.jit(_probe_layer, static_argnums=(4, 5))


def probe_layer(tensors: LayerTensors, recipe, key, *, num_draws: int = 8) -> dict[str, Any]:
  """Errors, bias curves, chain-rule gap and code statistics of `recipe` on one layer's fixed tensors.

  Args:
    tensors: the layer's BF16 x [M, K], W [K, N], dY [M, N] (from capture_layer_tensors).
    recipe: a Recipe or recipe string.
    key: PRNG key; draw d uses fold_in(key, d) as the layer key of one training step (None for recipes without
      randomness).
    num_draws: stochastic-rounding draws, a power of two >= 2; bias levels K = 1 .. num_draws / 2.

  Returns numpy values: fprop_err, fprop_cos (floats); dgrad_err, dgrad_cos, wgrad_err, wgrad_cos ([num_draws]
  per draw, vs BF16); bias {gemm: {reference: {"K", "mean", "se", "groups"}}}; chain_dgrad, chain_wgrad,
  weight_mismatch (floats); stats {operand: {statistic: float}} for the quantized operands. GEMMs run in
  gemm_mode "f32" unless the recipe names a mode (`as_probed`).
  """
  recipe = as_probed(recipe)
  key = check_layer(tensors, recipe, key, "probe_layer")
  x, w, dy = tensors
  raw = jax.device_get(_probe_layer_jit(x, w, dy, key, recipe, num_draws))
  out = {k: (float(v) if np.ndim(v) == 0 else np.asarray(v)) for k, v in raw.items() if k not in ("bias", "stats")}
  out["stats"] = {op: {k: float(v) for k, v in s.items()} for op, s in raw["stats"].items()}
  out["bias"] = summarize_bias(np.asarray(raw["bias"]), num_draws)
  return out


def summarize_bias(table, num_draws: int) -> dict[str, dict[str, dict[str, Any]]]:
  """{gemm: {reference: {"K", "mean", "se", "groups"}}} from the raw [series, level, group] error table."""
  levels = bias_levels(num_draws)
  out = {}
  for i, (gemm, ref) in enumerate((g, r) for g in ("dgrad", "wgrad") for r in BIAS_REFERENCES):
    groups = [np.asarray(table[i, l, :num_draws // k], np.float64) for l, k in enumerate(levels)]
    out.setdefault(gemm, {})[ref] = {"K": list(levels), "mean": [float(g.mean()) for g in groups],
                                     "se": [standard_error(g) for g in groups], "groups": [g.tolist() for g in groups]}
  return out


def bias_floor(curve: Mapping[str, Any]) -> float:
  """Estimated bias ||E[estimate] - reference|| / ||reference|| from a bias curve, with the noise removed.

  For error e_K of the mean of K draws, E[e_K^2] = b^2 + v / K; the smallest and largest K give
  b^2 = (K_max E[e_Kmax^2] - E[e_1^2]) / (K_max - 1) (clipped at 0); NaN when either level holds an inf or NaN. A
  curve with one level (num_draws=2) cannot separate the two: the mean single-draw error is returned, an upper
  bound that still holds the noise.
  """
  k = curve["K"]
  if len(k) < 2:
    return float(np.mean(curve["groups"][0]))
  e1 = np.mean(np.square(curve["groups"][0]))
  ek = np.mean(np.square(curve["groups"][-1]))
  if not (np.isfinite(e1) and np.isfinite(ek)):  # an inf single-draw error made the estimate 0 (clipped -inf)
    return float("nan")
  kmax = k[-1]
  return float(np.sqrt(max((kmax * ek - e1) / (kmax - 1), 0.0)))


def decay_slope(curve: Mapping[str, Any]) -> float:
  """Least-squares slope of log(mean error) against log(K): -0.5 for pure noise, 0 for a fixed bias."""
  k, mean = np.asarray(curve["K"], np.float64), np.asarray(curve["mean"], np.float64)
  if k.size < 2 or np.any(mean <= 0):
    return float("nan") if k.size < 2 or np.all(mean == 0) else 0.0
  return float(np.polyfit(np.log(k), np.log(mean), 1)[0])
