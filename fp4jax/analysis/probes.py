"""Low-noise probes of a recipe's numerics on fixed tensors: no training trajectory, so no seed-to-seed noise.

A BF16 forward/backward of a trained model on fixed batches captures, per linear layer, its input x [M, K], weight
W [K, N] and output gradient dY [M, N] (`capture_layer_tensors`). Each recipe's three GEMMs are then applied to
those SAME tensors (`probe_layer`) and compared with the BF16 GEMMs the model trains with:

  error   ||out - out_bf16|| / ||out_bf16|| for Fprop (y), Dgrad (dx) and Wgrad (dW), per stochastic-rounding
          draw; cosine similarity likewise.
  bias    ||mean of K draws - reference|| / ||reference|| for K = 1, 2, 4, ... over disjoint groups of draws (mean
          and standard error across groups). Noise averages away like 1/sqrt(K); a bias stays. References:
            "bf16"       the BF16 GEMM (total error; the deterministic weight/activation rounding never averages out),
            "exact_grad" the same recipe with its output-gradient operand left unrounded (RHT kept): isolates the
                         gradient rounding, which stochastic rounding makes unbiased and round-to-nearest does not,
            "chain"      the exact gradient of the quantized forward (straight-through): dY Wq_fprop^T for Dgrad,
                         Q_fprop(x)^T dY for Wgrad.
  chain   the Dgrad weight's distance from the Fprop weight, ||dY (Wq_dgrad - Wq_fprop)^T|| / ||dY Wq_fprop^T||:
          zero when Dgrad reuses the 2D Fprop codes, non-zero for 1D weights re-quantized along N. Wgrad's analogue
          compares its activation operand with Fprop's (always different: blocks along M, RHT).
  codes   per quantized operand: fraction of zero and of saturated (+-6) E2M1 codes, tensor amax, block-scale range.

`model_probe` runs the whole model with per-layer recipes (a precision policy, or one block quantized at a time) on
a fixed batch and compares loss and parameter gradient with the BF16 model's: the BF16-layer choice. And
`continue_training` continues a restored train state under a recipe for a few steps (the paper's ablation style).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fp4jax.pretrain.data
import fp4jax.pretrain.model
import fp4jax.recipes as recipes_lib
import fp4jax.pretrain.steps
import fp4jax.pretrain.trainer
from fp4jax import formats
from fp4jax.dot_general import (dgrad_gradient, dgrad_weight, fprop_operands, wgrad_activations,
                                wgrad_gradient)
from fp4jax.qarray import QArray
from fp4jax.quantize import dequantize

BIAS_REFERENCES = ("bf16", "exact_grad", "chain")
# Operands a recipe quantizes, by "gemm.operand" (Dgrad's W is Fprop's when the recipe reuses it).
OPERANDS = ("fprop.x", "fprop.W", "dgrad.dY", "dgrad.W", "wgrad.dY", "wgrad.x")
_HIGHEST = jax.lax.Precision.HIGHEST


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

def rel_error(a, ref) -> jax.Array:
  """||a - ref|| / ||ref|| in float32 (0 when both are zero, inf when only ref is)."""
  a, ref = jnp.asarray(a, jnp.float32), jnp.asarray(ref, jnp.float32)
  num, den = jnp.linalg.norm(a - ref), jnp.linalg.norm(ref)
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def cosine(a, b) -> jax.Array:
  """Cosine similarity of two tensors as flat vectors (1 when both are zero, 0 when only one is)."""
  a, b = jnp.ravel(jnp.asarray(a, jnp.float32)), jnp.ravel(jnp.asarray(b, jnp.float32))
  na, nb = jnp.linalg.norm(a), jnp.linalg.norm(b)
  den = na * nb
  return jnp.where(den > 0, jnp.dot(a, b, precision=_HIGHEST) / jnp.where(den > 0, den, 1.0),
                   jnp.where((na == 0) & (nb == 0), 1.0, 0.0))


def standard_error(values) -> float:
  """Standard error of the mean of `values` (NaN with fewer than two values)."""
  v = np.asarray(values, np.float64)
  return float(np.std(v, ddof=1) / np.sqrt(v.size)) if v.size >= 2 else float("nan")


def bias_levels(num_draws: int) -> tuple[int, ...]:
  """Group sizes K = 1, 2, 4, ..., num_draws / 2: every level has at least two disjoint groups (for an error bar)."""
  if not isinstance(num_draws, int) or num_draws < 2 or num_draws & (num_draws - 1):
    raise ValueError(f"num_draws must be a power of two >= 2; got {num_draws!r}.")
  return tuple(2**l for l in range(int(math.log2(num_draws))))


# --- capture: per-layer x, W, dY from a BF16 forward/backward ----------------------------------------------------

class LayerTensors(NamedTuple):
  """One linear layer's GEMM inputs from the BF16 model: x [M, K] and dY [M, N] in the compute dtype, W [K, N]."""

  x_MxK: jax.Array
  w_KxN: jax.Array
  dy_MxN: jax.Array


class _Delta(nnx.Variable):
  """A zero added to a layer's output; its gradient is the layer's output gradient dY."""


class _Input(nnx.Variable):
  """The input a layer received (overwritten by each call)."""


class _Tap(nnx.Module):
  """Wraps a linear layer: records its input and adds a zero `_Delta` to its output (for capture only)."""

  def __init__(self, inner: nnx.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
    self.inner = inner
    self.x_in = _Input(jnp.zeros(in_shape, inner.dtype))
    self.delta = _Delta(jnp.zeros(out_shape, inner.dtype))

  def __call__(self, x, *, key=None):
    self.x_in[...] = x.astype(self.inner.dtype)  # what the layer's GEMMs see (Linear casts its input so)
    return self.inner(x, key=key) + self.delta[...]


def _parent_and_attr(model: nnx.Module, name: str):
  *path, attr = name.split(".")
  parent = model
  for part in path:
    parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
  return parent, attr


def _by_layer(state, leaf: str) -> dict[str, Any]:
  """{layer name: value} for the variables named `leaf` directly under each layer path of a flat nnx state."""
  out = {}
  for path, var in nnx.to_flat_state(state):
    if path and path[-1] == leaf:
      value = var.get_value() if hasattr(var, "get_value") else var.value
      out[".".join(map(str, path[:-1]))] = value
  return out


def with_recipes(model: fp4jax.pretrain.model.Transformer, recipes) -> fp4jax.pretrain.model.Transformer:
  """A copy of `model` (its own modules and variables; arrays shared) whose linear layers run `recipes`.

  recipes: one Recipe (or recipe string) for every layer, or {layer name: Recipe} naming every linear layer.
  """
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, state, copy=True)
  layers = copy.linear_layers()
  if isinstance(recipes, Mapping):
    missing, unknown = sorted(set(layers) - set(recipes)), sorted(set(recipes) - set(layers))
    if missing or unknown:
      raise ValueError(f"recipes must name every linear layer exactly; missing {missing[:3]}, unknown {unknown[:3]}.")
    for name, layer in layers.items():
      layer.recipe = recipes_lib.get_recipe(recipes[name])
  else:
    recipe = recipes_lib.get_recipe(recipes)
    for layer in layers.values():
      layer.recipe = recipe
  return copy


def _check_batch(batch: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
  if not isinstance(batch, Mapping) or "inputs" not in batch or "targets" not in batch:
    raise ValueError("batch must be a dict with 'inputs' and 'targets' int arrays [B, T].")
  tokens, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
  if tokens.ndim != 2 or tokens.shape != targets.shape or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"batch inputs/targets must be int arrays of one shape [B, T]; got {tokens.dtype}{tokens.shape} "
                     f"and {targets.dtype}{targets.shape}.")
  return tokens, targets


def capture_layer_tensors(model: fp4jax.pretrain.model.Transformer, batch: Mapping[str, Any]
                          ) -> tuple[float, dict[str, LayerTensors]]:
  """(BF16 loss, {layer name: LayerTensors}) from one forward/backward of `model` with every linear layer in BF16.

  dY is the gradient of the mean cross-entropy of `batch` with respect to the layer's (compute-dtype) output: what
  the layer's Dgrad and Wgrad receive in training. `model` is not modified.
  """
  tokens_BxT, targets_BxT = _check_batch(batch)
  tapped = with_recipes(model, recipes_lib.bf16())
  if tapped.config.remat:  # recorded inputs do not cross nnx.remat; capture needs no memory savings
    tapped.config = dataclasses.replace(tapped.config, remat=False)
  b, t = tokens_BxT.shape
  kernels = {}
  for name, layer in tapped.linear_layers().items():
    parent, attr = _parent_and_attr(tapped, name)
    kernels[name] = layer.kernel[...]
    setattr(parent, attr, _Tap(layer, (b, t, layer.in_features), (b, t, layer.out_features)))
  graphdef, deltas, rest = nnx.split(tapped, _Delta, ...)

  @jax.jit
  def run(deltas, rest, tokens_BxT, targets_BxT):
    def loss_fn(deltas):
      m = nnx.merge(graphdef, deltas, rest, copy=True)  # fresh variables: the taps write theirs in this trace
      # A key (unused: every layer is BF16) skips the model's key check, which cannot see through the taps.
      loss = fp4jax.pretrain.steps.cross_entropy(m(tokens_BxT, key=jax.random.key(0)), targets_BxT)
      return loss, nnx.state(m, _Input)
    (loss, inter), grads = jax.value_and_grad(loss_fn, has_aux=True)(deltas)
    return loss, inter, grads

  loss, inter, grads = run(deltas, rest, tokens_BxT, targets_BxT)
  inputs, dys = _by_layer(inter, "x_in"), _by_layer(grads, "delta")
  out = {}
  for name, w_KxN in kernels.items():
    k, n = w_KxN.shape
    out[name] = LayerTensors(inputs[name].reshape(-1, k), w_KxN, dys[name].reshape(-1, n))
  return float(loss), out


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


class Operands(NamedTuple):
  """The key-independent operands of a quantized recipe's GEMMs (QArrays, or high-precision arrays)."""

  x_fprop: Any
  w_fprop: Any
  w_dgrad: Any
  x_wgrad: Any


def quantized_operands(x_MxK, w_KxN, recipe: recipes_lib.Recipe, key) -> Operands:
  """Fprop's x and W, Dgrad's W and Wgrad's x, exactly as fp4jax.dot_general's rule builds them."""
  xq, wq = fprop_operands(x_MxK, w_KxN, recipe, key)
  return Operands(xq, wq, dgrad_weight(w_KxN, wq, recipe, key, x_MxK.dtype),
                  wgrad_activations(x_MxK, recipe, key))


def quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe: recipes_lib.Recipe, key, operands: Operands | None = None):
  """(y, dx, dW, dy_dgrad, dy_wgrad) of a quantized recipe on fixed tensors, as fp4jax.dot_general computes them.

  The same helper functions and keys as the custom_vjp rule (one `key` per layer call), so y, dx and dW equal
  jax.vjp of fp4jax.dot_general bit for bit; y is rounded to the compute dtype as fp4jax.nn.Linear rounds it.
  `operands` (from quantized_operands) skips recomputing the key-independent operands between draws.
  """
  ops = quantized_operands(x_MxK, w_KxN, recipe, key) if operands is None else operands
  dy = dy_MxN.astype(jnp.float32)  # the rule receives the float32 cotangent of its float32 output
  m = x_MxK.shape[0]
  y = _mm(ops.x_fprop, ops.w_fprop, (1, 0)).astype(x_MxK.dtype).astype(jnp.float32)
  dyq = dgrad_gradient(dy, recipe, key, x_MxK.dtype)
  dx = _mm(dyq, ops.w_dgrad, (1, 1))[:m].astype(x_MxK.dtype).astype(jnp.float32)
  dyq_t = wgrad_gradient(dy, recipe, key, x_MxK.dtype)
  dw = _mm(ops.x_wgrad, dyq_t, (0, 0)).astype(w_KxN.dtype).astype(jnp.float32)
  return y, dx, dw, dyq, dyq_t


def exact_gradient_recipe(recipe: recipes_lib.Recipe) -> recipes_lib.Recipe:
  """`recipe` with the output-gradient operands of Dgrad and Wgrad left unrounded (RHT still applied)."""
  unrounded = lambda op: dataclasses.replace(op, fmt=None, rounding="nearest")
  return recipe.replace(name=recipe.name + "-exactgrad",
                        dgrad=recipes_lib.GemmConfig(unrounded(recipe.dgrad.lhs), recipe.dgrad.rhs),
                        wgrad=recipes_lib.GemmConfig(unrounded(recipe.wgrad.lhs), recipe.wgrad.rhs))


def _references(x_MxK, w_KxN, dy_MxN, recipe, key, ops: Operands):
  """{"bf16", "exact_grad", "chain"} references for dx and dW (float32); see the module docstring."""
  y_ref, dx_ref, dw_ref = bf16_gemms(x_MxK, w_KxN, dy_MxN, x_MxK.dtype)
  dy = dy_MxN.astype(jnp.float32)
  m = x_MxK.shape[0]
  exact = exact_gradient_recipe(recipe)
  # Pad dY as Wgrad pads x (the exact-gradient recipe may need a smaller token multiple).
  dy_pad = jnp.pad(dy, ((0, ops.x_wgrad.shape[0] - m), (0, 0)))
  dx_exact = _mm(dy, ops.w_dgrad, (1, 1))
  dw_exact = _mm(ops.x_wgrad, wgrad_gradient(dy_pad, exact, key, jnp.float32), (0, 0))
  dx_chain = _mm(dy, ops.w_fprop, (1, 1))
  dw_chain = _mm(ops.x_fprop, dy, (0, 0))
  refs_dx = {"bf16": dx_ref, "exact_grad": dx_exact, "chain": dx_chain}
  refs_dw = {"bf16": dw_ref, "exact_grad": dw_exact, "chain": dw_chain}
  return y_ref, refs_dx, refs_dw


# --- code statistics ----------------------------------------------------------------------------------------------

def operand_stats(q) -> dict[str, jax.Array]:
  """{zero, sat, amax, scale_lo, scale_hi, octaves, scale_zero, scale_subnormal} of an FP4 QArray ({} otherwise).

  zero / sat: fractions of E2M1 codes that are +-0 / +-6. amax: the tensor's max |x|. scale_lo / scale_hi: the
  smallest / largest non-zero block scale (NVFP4: the stored E4M3 value, whose range is [2^-9, 448]; MXFP4: 2^e);
  octaves: log2(scale_hi / scale_lo). scale_zero: fraction of blocks whose scale is 0 (all-zero or underflowed
  blocks; MXFP4: the smallest exponent). scale_subnormal: NVFP4 blocks whose E4M3 scale is subnormal (< 2^-6).
  """
  if not isinstance(q, QArray) or not q.fmt.is_fp4:
    return {}
  magnitude = q.unpacked_codes()[tuple(slice(0, n) for n in q.orig_shape)] & 7
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
  lo = jnp.min(jnp.where(empty, jnp.inf, s))
  hi = jnp.max(jnp.where(empty, 0.0, s))
  return {"zero": jnp.mean(magnitude == 0), "sat": jnp.mean(magnitude == 7), "amax": q.amax.astype(jnp.float32),
          "scale_lo": lo, "scale_hi": hi, "octaves": jnp.log2(hi / lo), "scale_zero": jnp.mean(empty),
          "scale_subnormal": subnormal}


# --- the per-layer probe ------------------------------------------------------------------------------------------

def _probe_layer(x_MxK, w_KxN, dy_MxN, key, recipe, num_draws):
  levels = bias_levels(num_draws)
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
    per_call = recipe.rht_signs == "per_call"
    def draw(k):
      return quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe, k, None if per_call else ops)[1:3]
    y, _, _, dyq, dyq_t = quantized_gemms(x_MxK, w_KxN, dy_MxN, recipe, jax.random.fold_in(key, 0),
                                          None if per_call else ops)
    stats = {"fprop.x": operand_stats(ops.x_fprop), "fprop.W": operand_stats(ops.w_fprop),
             "dgrad.dY": operand_stats(dyq), "dgrad.W": operand_stats(ops.w_dgrad),
             "wgrad.dY": operand_stats(dyq_t), "wgrad.x": operand_stats(ops.x_wgrad)}
    stats = {k: v for k, v in stats.items() if v}

  refs_dx_R = jnp.stack([refs_dx[r] for r in BIAS_REFERENCES])
  refs_dw_R = jnp.stack([refs_dw[r] for r in BIAS_REFERENCES])
  n_refs, n_levels = len(BIAS_REFERENCES), len(levels)
  sizes_L = jnp.asarray(levels, jnp.int32)

  def series_errors(mean_dx_L, mean_dw_L):
    """[2 * refs, L] relative errors of per-level means (dgrad refs first, then wgrad refs)."""
    def rel(mean_L, refs_R):
      num = jnp.sqrt(jnp.sum(jnp.square(mean_L[None] - refs_R[:, None]), axis=(2, 3)))
      den = jnp.sqrt(jnp.sum(jnp.square(refs_R), axis=(1, 2)))[:, None]
      return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))
    return jnp.concatenate([rel(mean_dx_L, refs_dx_R), rel(mean_dw_L, refs_dw_R)])

  def per_draw_metrics(dx, dw):
    return jnp.stack([rel_error(dx, refs_dx["bf16"]), cosine(dx, refs_dx["bf16"]),
                      rel_error(dw, refs_dw["bf16"]), cosine(dw, refs_dw["bf16"])])

  if not recipe.needs_key:
    # Every draw is the same: the mean of any K draws is the single draw, so each group has the same error.
    dx, dw = draw(key)
    errors = series_errors(dx[None], dw[None])  # [series, 1]
    table = jnp.broadcast_to(errors[:, :, None], (2 * n_refs, n_levels, num_draws))
    per_draw = jnp.broadcast_to(per_draw_metrics(dx, dw)[:, None], (4, num_draws))
  else:
    def body(d, carry):
      sums_dx, sums_dw, table, per_draw = carry
      dx, dw = draw(jax.random.fold_in(key, d))
      per_draw = per_draw.at[:, d].set(per_draw_metrics(dx, dw))
      sums_dx, sums_dw = sums_dx + dx[None], sums_dw + dw[None]
      # Level l closes a group of sizes_L[l] draws every sizes_L[l] draws: record its error, restart its sum.
      done_L = (d + 1) % sizes_L == 0
      scale_L = 1.0 / sizes_L.astype(jnp.float32)
      errors = series_errors(sums_dx * scale_L[:, None, None], sums_dw * scale_L[:, None, None])
      rows, groups = jnp.arange(n_levels), d // sizes_L
      table = table.at[:, rows, groups].set(jnp.where(done_L[None], errors, table[:, rows, groups]))
      sums_dx = jnp.where(done_L[:, None, None], 0.0, sums_dx)
      sums_dw = jnp.where(done_L[:, None, None], 0.0, sums_dw)
      return sums_dx, sums_dw, table, per_draw

    init = (jnp.zeros((n_levels,) + refs_dx["bf16"].shape, jnp.float32),
            jnp.zeros((n_levels,) + refs_dw["bf16"].shape, jnp.float32),
            jnp.full((2 * n_refs, n_levels, num_draws), jnp.nan, jnp.float32),
            jnp.zeros((4, num_draws), jnp.float32))
    _, _, table, per_draw = jax.lax.fori_loop(0, num_draws, body, init)

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
    key: PRNG key; draw d uses fold_in(key, d) as the layer key of one training step.
    num_draws: stochastic-rounding draws, a power of two >= 2; bias levels K = 1 .. num_draws / 2.

  Returns numpy values: fprop_err, fprop_cos (floats); dgrad_err, dgrad_cos, wgrad_err, wgrad_cos ([num_draws]
  per draw, vs BF16); bias {gemm: {reference: {"K", "mean", "se", "groups"}}}; chain_dgrad, chain_wgrad,
  weight_mismatch (floats); stats {operand: {statistic: float}} for the quantized operands.
  """
  recipe = recipes_lib.get_recipe(recipe)
  x, w, dy = tensors
  if x.ndim != 2 or w.ndim != 2 or dy.ndim != 2 or x.shape[1] != w.shape[0] or dy.shape != (x.shape[0], w.shape[1]):
    raise ValueError(f"probe_layer needs x [M, K], W [K, N], dY [M, N]; got {x.shape}, {w.shape}, {dy.shape}.")
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
  b^2 = (K_max E[e_Kmax^2] - E[e_1^2]) / (K_max - 1) (clipped at 0).
  """
  k = curve["K"]
  if len(k) < 2:
    return float(np.mean(curve["groups"][0]))
  e1 = np.mean(np.square(curve["groups"][0]))
  ek = np.mean(np.square(curve["groups"][-1]))
  kmax = k[-1]
  return float(np.sqrt(max((kmax * ek - e1) / (kmax - 1), 0.0)))


def decay_slope(curve: Mapping[str, Any]) -> float:
  """Least-squares slope of log(mean error) against log(K): -0.5 for pure noise, 0 for a fixed bias."""
  k, mean = np.asarray(curve["K"], np.float64), np.asarray(curve["mean"], np.float64)
  if k.size < 2 or np.any(mean <= 0):
    return float("nan") if k.size < 2 or np.all(mean == 0) else 0.0
  return float(np.polyfit(np.log(k), np.log(mean), 1)[0])


# --- model-level probes -------------------------------------------------------------------------------------------

def _flat(tree) -> jax.Array:
  return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])


def _loss_and_grad(graphdef, params, rest, tokens_BxT, targets_BxT, key):
  def loss_fn(params):
    logits_BxTxV = nnx.merge(graphdef, params, rest)(tokens_BxT, key=key).astype(jnp.float32)
    per_token_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
    # The mean over everything, as fp4jax.pretrain.steps.cross_entropy; per-sequence means for standard errors.
    return per_token_BxT.mean(), per_token_BxT.mean(axis=1)
  (loss, loss_B), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, loss_B, _flat(grads)


# graphdef (the model's structure and layer recipes) is static: one compilation per distinct model setting.
_loss_and_grad_jit = jax.jit(_loss_and_grad, static_argnums=0)


def _loss_and_grad_fn(model: fp4jax.pretrain.model.Transformer):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return lambda params, *args: _loss_and_grad_jit(graphdef, params, rest, *args), params


class Reference(NamedTuple):
  """The BF16 model on a batch: mean loss, per-sequence losses [B] and the flat float32 parameter gradient."""

  loss: float
  seq_losses: np.ndarray
  grad: jax.Array


def reference_gradient(model: fp4jax.pretrain.model.Transformer, batch: Mapping[str, Any]) -> Reference:
  """Loss, per-sequence losses and flat float32 parameter gradient of the model with every linear layer in BF16."""
  tokens, targets = _check_batch(batch)
  fn, params = _loss_and_grad_fn(with_recipes(model, recipes_lib.bf16()))
  loss, loss_B, grad = fn(params, tokens, targets, None)
  return Reference(float(loss), np.asarray(loss_B), grad)


def model_probe(model: fp4jax.pretrain.model.Transformer, batch: Mapping[str, Any], recipes, key, *,
                reference: Reference, num_draws: int = 4) -> dict[str, Any]:
  """Loss and parameter-gradient error of the model under per-layer `recipes` against the BF16 model.

  recipes: as for `with_recipes`. reference: `reference_gradient(model, batch)`.
  Returns loss; dloss (loss - BF16 loss: no SR noise, the forward has no randomness) with dloss_se, its standard
  error over the batch's sequences, and seq_dloss [B] (per-sequence differences, for paired comparisons);
  grad_err and grad_cos ([num_draws], vs the BF16 gradient); grad_bias (error of the mean of the draws).
  """
  if not isinstance(num_draws, int) or num_draws < 1:
    raise ValueError(f"num_draws must be an int >= 1; got {num_draws!r}.")
  if not isinstance(reference, Reference):
    raise ValueError("reference must be the Reference returned by reference_gradient(model, batch).")
  tokens, targets = _check_batch(batch)
  if reference.seq_losses.shape != (tokens.shape[0],):
    raise ValueError(f"reference has {reference.seq_losses.shape[0]} sequences; the batch has {tokens.shape[0]}.")
  quantized = with_recipes(model, recipes)
  needs_key = any(layer.recipe.needs_key for layer in quantized.linear_layers().values())
  fn, params = _loss_and_grad_fn(quantized)
  draws = num_draws if needs_key else 1
  errs, coss, total, loss, loss_B = [], [], jnp.zeros_like(reference.grad), None, None
  for d in range(draws):
    l, l_B, g = fn(params, tokens, targets, jax.random.fold_in(key, d))
    if loss is None:  # the forward does not depend on the draw
      loss, loss_B = float(l), np.asarray(l_B)
    errs.append(float(rel_error(g, reference.grad)))
    coss.append(float(cosine(g, reference.grad)))
    total = total + g
  seq_dloss = loss_B - reference.seq_losses
  return {"loss": loss, "dloss": loss - reference.loss, "dloss_se": standard_error(seq_dloss),
          "seq_dloss": seq_dloss, "grad_err": np.asarray(errs * (num_draws // draws)),
          "grad_cos": np.asarray(coss * (num_draws // draws)),
          "grad_bias": float(rel_error(total / draws, reference.grad))}


# --- continuation -------------------------------------------------------------------------------------------------

def continue_training(model: fp4jax.pretrain.model.Transformer, state: fp4jax.pretrain.steps.TrainState, recipes, *, optimizer,
                      dataset, batch_size: int, seq_len: int, steps: int, seed: int, val_batches,
                      cache: fp4jax.pretrain.steps.CompileCache | None = None) -> dict[str, Any]:
  """Continues `state` for `steps` AdamW steps with the linear layers running `recipes`; evaluates at the end.

  Batches are fp4jax.pretrain.data.get_batch(dataset, "train", state.step + i, seed=seed) and the step key is
  fold_in(fold_in(key(seed), 1), step), so two recipes continued with the same seed see the same data (paired).
  Returns {"losses": train losses, "val_bf16": validation loss with a BF16 forward, "val_own": with the recipe's
  own forward, "state": the final TrainState}. Raises fp4jax.pretrain.trainer.TrainingDiverged on a non-finite step.
  """
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be an int >= 1; got {steps!r}.")
  cache = cache if cache is not None else fp4jax.pretrain.steps.CompileCache()
  graphdef = nnx.graphdef(with_recipes(model, recipes))
  bf16_graphdef = nnx.graphdef(with_recipes(model, recipes_lib.bf16()))
  step_fn = cache.get(("probe_train", graphdef, id(optimizer)),
                      lambda: jax.jit(fp4jax.pretrain.steps.make_train_step(graphdef, optimizer)))
  step_key = jax.random.fold_in(jax.random.key(seed), 1)
  start = int(state.step)
  losses = []
  for i in range(start, start + steps):
    batch = fp4jax.pretrain.data.get_batch(dataset, "train", i, batch_size=batch_size, seq_len=seq_len, seed=seed)
    new_state, m = step_fn(state, batch, jax.random.fold_in(step_key, i))
    if not bool(m["finite"]):
      raise fp4jax.pretrain.trainer.TrainingDiverged(i, float(m["loss"]), float(m["grad_norm"]), None)
    state = new_state
    losses.append(float(m["loss"]))
  eval_key = jax.random.fold_in(jax.random.key(seed), 2)

  def val(gd):
    fn = cache.get(("probe_eval", gd), lambda: jax.jit(fp4jax.pretrain.steps.make_eval_step(gd)))
    return float(np.mean([float(fn(state.params, b, eval_key)) for b in val_batches]))

  return {"losses": losses, "val_bf16": val(bf16_graphdef), "val_own": val(graphdef), "state": state}
