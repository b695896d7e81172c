"""Quantized dot_general with a custom_vjp: the Fprop, Dgrad and Wgrad GEMMs of a linear layer, as a recipe says.

For y = x W with x [..., K] (tokens M = product of leading dims) and W [K, N] (or [N, K]):
  Fprop  y  = Q(x along K)            @ Q(W, 2D)
  Dgrad  dx = Q(dY along N, SR)       @ Q(W, 2D)^T          (the Fprop weight codes, transposed: no re-quantization)
  Wgrad  dW = Q(RHT x along M)^T      @ Q(RHT dY along M, SR)
The "xla" backend multiplies the operands' values with float32 accumulation: either code x block scale in bfloat16
(exact: at most 6 significant bits) with the per-tensor scales applied to the float32 output (gemm_mode "bf16",
BF16 tensor cores on a GPU), which equals a real FP4 GEMM up to float32 summation order, or the fully dequantized
float32 values at HIGHEST precision (gemm_mode "f32", the reference, which also rounds each decoded element and
product to float32); see fp4jax.gemm.
Residuals are kept quantized: the backward needs Q(W, 2D) and Q(RHT x along M), both computed in the forward pass
from high-precision tensors (or, for operands marked `requantize`, from the dequantized Fprop operands), so no
full-precision copy of x or W is saved.

With an RHT on Fprop and `requantize`d backward operands (Quartet), Dgrad and Wgrad run in Fprop's transformed
basis along K; their outputs get the Fprop operands' clip masks (QuEST's straight-through estimator) and then the
inverse transform (`to_input_basis`).

The rule is built from public pieces, `layer_operands`, `fprop`, `dgrad` and `wgrad`, so that analysis code
(fp4jax.analysis.probes) runs exactly the rule's GEMMs on tensors of its choice.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp4jax import explicit_axes
from fp4jax import gemm as gemm_lib
from fp4jax import grids
from fp4jax import keys
from fp4jax import prng
from fp4jax import recipes as recipes_lib
from fp4jax import rht as rht_lib
from fp4jax.gemm import resolve_gemm_mode  # pylint: disable=unused-import  (re-exported)
from fp4jax.quantize import quantize, quantize_with_clip_mask

# Independent randomness per GEMM, derived from the one key the caller passes per layer call: fold_in(key, tag).
_DGRAD_SR, _WGRAD_SR, _RHT_SIGNS = 1, 2, 3
_DGRAD_W_SR, _WGRAD_X_SR = 4, 5  # SR of the backward's weight / activation operands (TetraJet-v2)
_TAGS = (_DGRAD_SR, _WGRAD_SR, _RHT_SIGNS, _DGRAD_W_SR, _WGRAD_X_SR)


class LayerKeys(NamedTuple):
  """One layer call's randomness, derived from its key at once; accepted wherever the rule takes a layer `key`.

  keys[i] = fold_in(key, _TAGS[i]) and seeds[i] its hash-generator seed, made by batched threefry evaluations
  (fp4jax.prng.fold_in_many, seeds_from_keys): the same bits as the rule's pieces derive from the plain key, in
  one small kernel instead of one per operand. A model derives all its layers' at once (derive_layer_keys on an
  array of keys), down to one kernel per step.
  """

  keys: Any  # PRNG keys [..., len(_TAGS)]
  seeds: Any  # uint32 [..., len(_TAGS), 2]


def derive_layer_keys(key) -> LayerKeys:
  """The LayerKeys of a layer call's `key`, or of each key of a typed key array (leading axes kept)."""
  if jnp.ndim(key) > (0 if keys.is_typed_key(key) else 1):
    if prng.batches_exactly(key):
      return jax.vmap(derive_layer_keys)(key)
    return jax.tree.map(lambda *a: jnp.stack(a), *[derive_layer_keys(k) for k in key])
  k = prng.fold_in_many(keys.check_layer_stream_key(key, "key"), _TAGS)
  return LayerKeys(k, prng.seeds_from_keys(k))


def check_layer_key(key, name: str = "key"):
  """Returns `key` if it is one PRNG key or the LayerKeys of one, else raises a ValueError naming `name`."""
  if not isinstance(key, LayerKeys):
    return keys.check_layer_stream_key(key, name)
  n = len(_TAGS)
  k_shape, s_shape = jnp.shape(key.keys), jnp.shape(key.seeds)
  typed = keys.is_typed_key(key.keys)
  raw = (n, keys._raw_key_words())  # pylint: disable=protected-access  # 2 for threefry, 4 for rbg
  if k_shape != ((n,) if typed else raw) or s_shape != (n, 2) or jnp.result_type(key.seeds) != jnp.uint32:
    raise ValueError(f"{name}: the LayerKeys of one layer call hold keys [{n}] and uint32 seeds [{n}, 2] "
                     f"(fp4jax.dot_general's derive_layer_keys of one key); got keys {k_shape}, seeds {s_shape} "
                     f"{jnp.result_type(key.seeds)}.")
  return key


def rule_keys(recipe: recipes_lib.Recipe, key):
  """What a custom_vjp rule hands its pieces: the LayerKeys of `key`, derived once, when the recipe draws randomness
  (`key` itself when it already is LayerKeys, or when nothing is drawn)."""
  return derive_layer_keys(key) if recipe.needs_key and not isinstance(key, LayerKeys) else key


def _sub_key(recipe: recipes_lib.Recipe, key, tag: int):
  """fold_in(key, tag), or the same bits taken from LayerKeys: the hash generator gets its seed (HashSeed)."""
  if not isinstance(key, LayerKeys):
    return jax.random.fold_in(key, tag)
  i = _TAGS.index(tag)
  if tag != _RHT_SIGNS and recipe.sr_bits == "hash":
    return prng.HashSeed(key.seeds[i])
  return key.keys[i]


# --- operands -----------------------------------------------------------------------------------------------------

def _rht_signs(recipe: recipes_lib.Recipe, key, gemm: str = "backward"):
  mode = recipe.signs_of(gemm)
  if mode == "none":
    return jnp.ones((recipe.rht_size,), jnp.float32)
  if mode == "per_call":
    return _sub_key(recipe, key, _RHT_SIGNS)
  return None  # the fixed default vector


def quantize_operand(x, cfg: recipes_lib.OperandConfig, *, axis: int, recipe: recipes_lib.Recipe, key=None,
                     signs=None, compute_dtype=None, with_mask: bool = False, unit: bool | str = False):
  """One GEMM operand as the recipe says: RHT along `axis` (if on), then quantize with blocks along `axis`.

  Returns a QArray, or `x` cast to `compute_dtype` (if given) when the operand stays in high precision. With
  `with_mask`, (that, the clip mask of `quantize_with_clip_mask` or None when the operand is not quantized). With
  `unit`, an operand that only feeds an xla-backend GEMM comes back as the gemm.Unit that GEMM reads (its exact
  bfloat16 form in "bf16" mode; its dequantized float32 values in "f32" mode and for formats with no exact bfloat16
  form, such as FP8 with float32 block scales: the same bits the GEMM would take from the QArray) without packed
  codes: the rule's GEMM-only operands take this path. `unit="bf16"`: the exact bfloat16 form only (bf16 mode), a
  QArray otherwise; for residuals, which then take no more memory than the bf16 recipe's bfloat16 copy.
  """
  if recipe.backend == "pallas" and cfg.quantized:
    from fp4jax import backends  # pylint: disable=g-import-not-at-top
    q = backends.pallas_quantize(x, cfg, axis=axis, recipe=recipe, key=key, signs=signs, with_mask=with_mask)
    if q is not None:
      return q
  if cfg.rht:
    x = rht_lib.random_hadamard(x, size=recipe.rht_size, axis=axis, signs=signs)
  if not cfg.quantized:
    x = x.astype(compute_dtype) if compute_dtype is not None else x
    return (x, None) if with_mask else x
  kwargs = dict(axis=axis, block_2d=cfg.block_2d, rounding=cfg.rounding,
                key=key if cfg.rounding == "stochastic" else None, random_bits=recipe.random_bits, pad=cfg.pad,
                sr_bits=recipe.sr_bits)
  if unit and not with_mask and recipe.backend != "pallas":
    u = gemm_lib.unit_values(x, cfg.fmt, **kwargs) if gemm_lib.resolve_gemm_mode(recipe) == "bf16" else None
    if u is not None:
      return u
    if unit != "bf16":
      # No exact bfloat16 form (FP8's float32 block scales) or "f32" mode: the GEMM reads
      # the dequantized float32 values either way.
      return gemm_lib.f32_unit(x, cfg.fmt, **kwargs)
  return (quantize_with_clip_mask if with_mask else quantize)(x, cfg.fmt, **kwargs)


def _token_multiple(recipe: recipes_lib.Recipe) -> int:
  """Token count multiple needed by Wgrad's blocks and RHT tiles along M."""
  m = 1
  for op in (recipe.wgrad.lhs, recipe.wgrad.rhs):
    if op.quantized:
      m = math.lcm(m, op.fmt.block_size)
  if recipe.wgrad.rht:
    m = math.lcm(m, recipe.rht_size)
  return m


def _pad_tokens(x_MxD, multiple):
  pad = -x_MxD.shape[0] % multiple
  return jnp.pad(x_MxD, ((0, pad), (0, 0))) if pad else x_MxD


def fprop_operands(x_MxK, w_KxN, recipe, key):
  """Fprop's quantized operands: x with blocks along K, W with blocks along K (2D per the recipe)."""
  return _fprop_operands_and_masks(x_MxK, w_KxN, recipe, key)[:2]


def _fprop_operands_and_masks(x_MxK, w_KxN, recipe, key, unit_x=False, unit_w=False):
  """(x, W, x's clip mask, W's clip mask): the masks None unless the operand asks for one (`clip_mask`)."""
  signs = _rht_signs(recipe, key, "fprop")
  lhs, rhs = recipe.fprop.lhs, recipe.fprop.rhs
  x = quantize_operand(x_MxK, lhs, axis=1, recipe=recipe, signs=signs, with_mask=lhs.clip_mask, unit=unit_x)
  w = quantize_operand(w_KxN, rhs, axis=0, recipe=recipe, signs=signs, compute_dtype=x_MxK.dtype,
                       with_mask=rhs.clip_mask, unit=unit_w)
  xq, x_mask = x if lhs.clip_mask else (x, None)
  wq, w_mask = w if rhs.clip_mask else (w, None)
  return xq, wq, x_mask, w_mask


def to_input_basis(g, mask, recipe, key, *, axis, in_fprop_basis, what="x"):
  """The gradient of an Fprop input (dx: axis 1, dW: axis 0) from a backward GEMM's output `g`.

  A backward GEMM on re-quantized Fprop operands (`in_fprop_basis`) returns the gradient in Fprop's RHT basis along
  K: the operand's clip mask applies there (QuEST's straight-through estimator), then the inverse RHT. A GEMM on
  the original tensors returns it in the original basis: with a mask and an Fprop RHT, it is carried to that basis
  and back, so the mask always zeroes the elements the Fprop quantizer saturated.
  """
  clip = recipe.fprop.lhs.clip_mask if axis == 1 else recipe.fprop.rhs.clip_mask
  if clip and mask is None:
    raise ValueError(f"recipe {recipe.name!r} masks the gradient of the Fprop {what} where it was clipped: pass "
                     f"{what}_mask= (Operands.{what}_mask from layer_operands).")
  rht = recipe.fprop.rht and (in_fprop_basis or clip)
  if not rht and not clip:
    return g
  signs = _rht_signs(recipe, key, "fprop")
  if rht and not in_fprop_basis:
    g = rht_lib.random_hadamard(g, size=recipe.rht_size, axis=axis, signs=signs)
  if clip:
    g = jnp.where(mask, g, jnp.zeros_like(g))
  if rht:
    g = rht_lib.random_hadamard(g, size=recipe.rht_size, axis=axis, signs=signs, inverse=True)
  return g


def _fprop_source(q, fn, arg):
  if q is None:
    raise ValueError(f"{fn}: the recipe re-quantizes the Fprop operand (`requantize`); pass {arg}=.")
  return q


def dgrad_weight(w_KxN, wq_fprop, recipe, key, compute_dtype, unit=False):
  """Dgrad's weight operand, blocked along N: the Fprop codes when the recipe allows it, else re-quantized
  (from W, or from the dequantized Fprop W when the operand says `requantize`); `unit`: as gemm.Unit (see
  quantize_operand) instead of a QArray when re-quantized."""
  if recipe.dgrad_reuses_weight:
    return wq_fprop
  if recipe.dgrad.rhs.requantize:
    w_KxN = gemm_lib.f32_values(_fprop_source(wq_fprop, "dgrad_weight", "wq_fprop")).astype(w_KxN.dtype)
  return quantize_operand(w_KxN, recipe.dgrad.rhs, axis=1, recipe=recipe, key=_sub_key(recipe, key, _DGRAD_W_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=compute_dtype, unit=unit)


def wgrad_activations(x_MxK, recipe, key, xq_fprop=None, unit=False):
  """Wgrad's activation operand: x (or the dequantized Fprop x, with `requantize`) padded to the token multiple,
  RHT and blocks along M (tokens). `unit` as in quantize_operand: True, a gemm.Unit; "bf16", a Unit where it has an
  exact bfloat16 form in bf16 mode, else a QArray."""
  if recipe.wgrad.rhs.requantize:
    x_MxK = gemm_lib.f32_values(_fprop_source(xq_fprop, "wgrad_activations", "xq_fprop")).astype(x_MxK.dtype)
  x_MxK = _pad_tokens(x_MxK, _token_multiple(recipe))
  return quantize_operand(x_MxK, recipe.wgrad.rhs, axis=0, recipe=recipe, key=_sub_key(recipe, key, _WGRAD_X_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=x_MxK.dtype, unit=unit)


def dgrad_gradient(dy_MxN, recipe, key, compute_dtype=None, unit=False):
  """Dgrad's output-gradient operand: blocks along N, stochastic rounding per the recipe."""
  return quantize_operand(dy_MxN, recipe.dgrad.lhs, axis=1, recipe=recipe, key=_sub_key(recipe, key, _DGRAD_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=compute_dtype, unit=unit)


def wgrad_gradient(dy_MxN, recipe, key, compute_dtype=None, unit=False):
  """Wgrad's output-gradient operand: padded tokens, RHT and blocks along M, stochastic rounding per the recipe."""
  dy_MxN = _pad_tokens(dy_MxN, _token_multiple(recipe))
  return quantize_operand(dy_MxN, recipe.wgrad.lhs, axis=0, recipe=recipe, key=_sub_key(recipe, key, _WGRAD_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=compute_dtype, unit=unit)


# --- the three GEMMs, public: the custom_vjp rule below is built from them, and so are the analysis probes -------

class Operands(NamedTuple):
  """The operands the forward pass builds from x and W (QArrays, or high-precision arrays when not quantized).

  x_fprop [M, K] and w_fprop [K, N] feed Fprop; w_dgrad (Dgrad's weight, blocked along N) and x_wgrad ([M', K],
  tokens padded to Wgrad's multiple) are the backward's residuals. None where `layer_operands(backward=False)`.
  x_mask [M, K] and w_mask [K, N] (bool): the Fprop operands' clip masks, for operands with `clip_mask`, else None.
  """

  x_fprop: Any
  w_fprop: Any
  w_dgrad: Any = None
  x_wgrad: Any = None
  x_mask: Any = None
  w_mask: Any = None


def layer_operands(x_MxK, w_KxN, recipe: recipes_lib.Recipe, key, *, backward: bool = True,
                   unit: bool = False) -> Operands:
  """Quantizes x and W for Fprop and, if `backward`, for Dgrad and Wgrad, as the custom_vjp rule does.

  With `unit`, the Fprop operands come as gemm.Unit (see quantize_operand), and so do the backward's re-quantized
  operands, Dgrad's weight when it reuses Fprop's, and Wgrad's x where it has an exact bfloat16 form in bf16 mode:
  the rule's own fast path, with the same GEMM inputs bit for bit.
  """
  xq, wq, x_mask, w_mask = _fprop_operands_and_masks(x_MxK, w_KxN, recipe, key, unit, unit)
  if not backward:
    return Operands(xq, wq)
  # Wgrad's x is a residual: its bfloat16 Unit (2 bytes per element, as the bf16 recipe keeps x) where there is
  # one; unpacking codes in the backward cost the `small` step ~0.07 of the bf16 step on XLA:CPU (RESULTS.md).
  # Re-quantized operands are rebuilt from the Fprop operands, whose packed codes XLA:CPU fused into their readers:
  # each element recomputed both codes of its byte and its block's E4M3 scale. As Units of any form (float32 values
  # where there is no bfloat16 one) they are decoded from float32 scales, with the same temp memory in the `small`
  # train step (RESULTS.md).
  unit_x = (True if recipe.wgrad.rhs.requantize else "bf16") if unit else False
  unit_w = unit and recipe.dgrad.rhs.requantize
  return Operands(xq, wq, dgrad_weight(w_KxN, wq, recipe, key, x_MxK.dtype, unit=unit_w),
                  wgrad_activations(x_MxK, recipe, key, xq, unit=unit_x), x_mask, w_mask)


def fprop(ops: Operands, recipe: recipes_lib.Recipe):
  """Fprop y [M, N] = x_fprop @ w_fprop, float32."""
  return gemm_lib.gemm(ops.x_fprop, ops.w_fprop, (1, 0), recipe)


def dgrad(dy_MxN, w_dgrad, recipe: recipes_lib.Recipe, key, compute_dtype, x_mask=None, unit=False):
  """Dgrad: (dx [M, K] float32, the quantized dY operand) from the output gradient and Dgrad's weight operand
  (and Fprop x's clip mask, `Operands.x_mask`, when the recipe masks it). `unit`: dY as gemm.Unit (quantize_operand)."""
  dyq = dgrad_gradient(dy_MxN, recipe, key, compute_dtype, unit=unit)
  dx = gemm_lib.gemm(dyq, w_dgrad, (1, 1), recipe)[:dy_MxN.shape[0]]
  return to_input_basis(dx, x_mask, recipe, key, axis=1, in_fprop_basis=recipe.dgrad.rhs.requantize,
                         what="x"), dyq


def wgrad(dy_MxN, x_wgrad, recipe: recipes_lib.Recipe, key, compute_dtype, w_mask=None, unit=False):
  """Wgrad: (dW [K, N] float32, the quantized dY operand) from the output gradient and Wgrad's activation operand
  (and Fprop W's clip mask, `Operands.w_mask`, when the recipe masks it). `unit`: dY as gemm.Unit (quantize_operand)."""
  dyq_t = wgrad_gradient(dy_MxN, recipe, key, compute_dtype, unit=unit)
  dw = gemm_lib.gemm(x_wgrad, dyq_t, (0, 0), recipe)
  return to_input_basis(dw, w_mask, recipe, key, axis=0, in_fprop_basis=recipe.wgrad.rhs.requantize,
                         what="w"), dyq_t


# --- the custom_vjp rule on canonical [M, K] x [K, N] ------------------------------------------------------------

SECOND_ORDER_ERROR = (
    "fp4jax.dot_general: a second derivative (grad of grad, jax.hessian, jvp of grad) through a quantized GEMM is "
    "not supported. Its backward GEMMs round their operands, so differentiating them gives zero, not the layer's "
    "curvature. For curvature or meta-gradients, run these layers with recipe 'bf16', or differentiate through "
    "fp4jax.fake_quant, whose straight-through gradient is the identity.")


def _first_order_only(tree):
  """`tree` unchanged; raises SECOND_ORDER_ERROR if any of its float arrays is differentiated (the rule's forward
  or backward traced under a JVP, as a second derivative does), rather than letting JAX return silent zeros."""
  leaves, treedef = jax.tree.flatten(tree)
  floats = [i for i, leaf in enumerate(leaves)
            if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)]
  guarded = _refuse_tangents(tuple(leaves[i] for i in floats))
  for i, leaf in zip(floats, guarded):
    leaves[i] = leaf
  return jax.tree.unflatten(treedef, leaves)


@jax.custom_jvp
def _refuse_tangents(arrays):
  return arrays


@_refuse_tangents.defjvp
def _refuse_tangents_jvp(primals, tangents):
  del primals, tangents
  raise NotImplementedError(SECOND_ORDER_ERROR)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qmatmul(x_MxK, w_KxN, key, recipe):
  return fprop(layer_operands(x_MxK, w_KxN, recipe, key, backward=False, unit=True), recipe)


def _qmatmul_fwd(x_MxK, w_KxN, key, recipe):
  x_MxK, w_KxN = _first_order_only((x_MxK, w_KxN))  # a first derivative runs this rule on primals only
  key = rule_keys(recipe, key)
  ops = layer_operands(x_MxK, w_KxN, recipe, key, unit=True)
  residuals = (
      ops.w_dgrad, ops.x_wgrad, ops.x_mask, ops.w_mask, key,
      jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype),  # carry dtypes for the cotangents
  )
  return fprop(ops, recipe), residuals


def _qmatmul_bwd(recipe, residuals, dy_MxN):
  dy_MxN, residuals = _first_order_only((dy_MxN, residuals))
  w_dgrad, x_wgrad, x_mask, w_mask, key, x_proto, w_proto = residuals
  dx_MxK, _ = dgrad(dy_MxN, w_dgrad, recipe, key, x_proto.dtype, x_mask, unit=True)
  dw_KxN, _ = wgrad(dy_MxN, x_wgrad, recipe, key, x_proto.dtype, w_mask, unit=True)
  return dx_MxK.astype(x_proto.dtype), dw_KxN.astype(w_proto.dtype), None


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)
# Called outside jit (a notebook, a test), the rule's hundreds of small ops would each dispatch and compile on their
# own (minutes for 4/6 with RHTs); jitted once per shape and recipe instead. Inside a jit it is inlined.
_qmatmul_jit = jax.jit(_qmatmul, static_argnums=(3,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cast_output(y, dtype):
  """`y.astype(dtype)` for the GEMM's float32 output, whose transpose widens a narrower cotangent from its bits.

  Autodiff's own transpose of the cast converts dY back with a cast, which makes the caller's float32 -> bfloat16
  cast of dY and this bfloat16 -> float32 cast a pair XLA:GPU removes (grids.exact_float32): the backward rule would
  quantize the unrounded float32 dY there, the rounded one on the CPU. Same values as the cast wherever the pair
  stays.
  """
  return y.astype(dtype)


def _cast_output_fwd(y, dtype):
  return y.astype(dtype), jnp.zeros((0,), y.dtype)


def _cast_output_bwd(dtype, proto, ct):
  del dtype
  wide = grids.exact_float32(ct) if ct.dtype in (jnp.bfloat16, jnp.float16) else ct
  return (wide.astype(proto.dtype),)


cast_output.defvjp(_cast_output_fwd, _cast_output_bwd)


# --- the public drop-in -------------------------------------------------------------------------------------------

def check_axes_in_range(axes, ndim: int, what: str, dimension_numbers, where: str = "fp4jax.dot_general"):
  """Raises a ValueError unless every axis in `axes` indexes an operand of rank `ndim` (negative ones count from the
  end): taken modulo the rank, an axis out of range would silently name another one (3 on a 2D weight: axis 1)."""
  bad = [a for a in axes if not -ndim <= int(a) < ndim]
  if bad:
    raise ValueError(f"{where}: {what} axes {bad} are out of range for rank {ndim} (dimension_numbers="
                     f"{dimension_numbers}); use axes in [0, {ndim}).")


def _canonical_weight_axes(lhs, rhs, dimension_numbers):
  """Checks the dimension numbers describe a linear layer; returns the rhs contracting axis (0: [K,N], 1: [N,K])."""
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
  check_axes_in_range(lc + lb, lhs.ndim, "lhs", dimension_numbers)
  check_axes_in_range(rc + rb, rhs.ndim, "rhs", dimension_numbers)
  if lb or rb:
    raise ValueError(f"fp4jax.dot_general quantizes linear layers; batch dimensions are not supported "
                     f"(got dimension_numbers={dimension_numbers}). Keep batched GEMMs (attention) in high precision.")
  if rhs.ndim != 2 or len(lc) != 1 or len(rc) != 1 or lc[0] % lhs.ndim != lhs.ndim - 1:
    raise ValueError(f"fp4jax.dot_general expects activations [..., K] contracted on their last axis with a "
                     f"weight [K, N] or [N, K]; got lhs {lhs.shape}, rhs {rhs.shape}, dimension_numbers="
                     f"{dimension_numbers}. fp4jax.quantized_dot_general(recipe) takes any linear layer's layout "
                     f"(contracted axes anywhere, several of them, kernels of any rank).")
  r = rc[0] % 2
  if lhs.shape[-1] != rhs.shape[r]:
    raise ValueError(f"contraction sizes differ: lhs {lhs.shape} axis -1 has {lhs.shape[-1]}, rhs {rhs.shape} "
                     f"axis {r} has {rhs.shape[r]}.")
  return r


def _largest_rht_size_dividing(length: int, rht_size: int) -> int:
  """The largest power of two <= rht_size that divides `length` (1 when `length` is odd)."""
  d = rht_size
  while d > 1 and length % d:
    d //= 2
  return d


_FEATURE_OPERANDS = (("fprop", "lhs", "K"), ("fprop", "rhs", "K"), ("dgrad", "lhs", "N"), ("dgrad", "rhs", "N"))


def rht_size_limit(k: int, n: int, recipe: recipes_lib.Recipe) -> int | None:
  """The largest RHT size (a power of two <= recipe.rht_size) whose tiles divide the axes a layer with weight
  [K, N] = [k, n] runs `recipe`'s Fprop and Dgrad RHTs along; None when neither GEMM has an RHT."""
  sizes = {"K": k, "N": n}
  fits = [_largest_rht_size_dividing(sizes[dim], recipe.rht_size) for gemm, role, dim in _FEATURE_OPERANDS
          if getattr(recipe.gemm(gemm), role).rht]
  return min(fits) if fits else None


# The axes of K and N that each operand's blocks run along: 1D blocks run along the GEMM's contracted axis (Wgrad's
# is M, the tokens), 2D blocks also along the operand's other axis (an activation's other axis is M).
_BLOCK_AXES = {("fprop", "lhs"): (("K",), ("K",)), ("fprop", "rhs"): (("K",), ("K", "N")),
               ("dgrad", "lhs"): (("N",), ("N",)), ("dgrad", "rhs"): (("N",), ("K", "N")),
               ("wgrad", "lhs"): ((), ("N",)), ("wgrad", "rhs"): ((), ("K",))}


def check_layer_shape(k: int, n: int, recipe: recipes_lib.Recipe) -> None:
  """Raises a ValueError unless a linear layer with weight [K, N] = [k, n] can run `recipe`: the blocks of its
  operands and the Fprop and Dgrad RHT tiles divide K and N (Wgrad's token axis is padded inside the rule)."""
  sizes = {"K": k, "N": n}
  # Blocks first: a smaller rht_size cannot fix them, so the RHT hint below is only given where it suffices.
  for (gemm, role), (axes_1d, axes_2d) in _BLOCK_AXES.items():
    op = getattr(recipe.gemm(gemm), role)
    if not op.quantized or op.pad:
      continue
    b = op.fmt.block_size
    for d in (axes_2d if op.block_2d else axes_1d):
      if sizes[d] % b:
        raise ValueError(f"{gemm} {role}: {op.fmt.name} blocks of {b} need {d} divisible by {b}; got {d}={sizes[d]} "
                         f"(weight [K, N] = [{k}, {n}]). Use a multiple of {b}, or keep this layer in bf16.")
  for gemm, role, dim in _FEATURE_OPERANDS:
    if getattr(recipe.gemm(gemm), role).rht and sizes[dim] % recipe.rht_size:
      fit = _largest_rht_size_dividing(sizes[dim], recipe.rht_size)
      example = f" (e.g. recipe '{recipe.name}:rht_size={fit}')" if recipe.name in recipes_lib.PRESETS else ""
      hint = (f"Use rht_size={fit} or smaller, a power of two dividing {dim}{example}" if fit > 1
              else f"No RHT size divides {dim}")
      raise ValueError(f"{gemm} {role}: recipe {recipe.name!r} runs a {recipe.rht_size}-point RHT along {dim}, which "
                       f"needs {dim} divisible by {recipe.rht_size}; got {dim}={sizes[dim]} (weight [K, N] = "
                       f"[{k}, {n}]). {hint}, or keep this layer in bf16.")


def lax_output_dtype(lhs, rhs, dimension_numbers) -> jnp.dtype:
  """The dtype lax.dot_general gives `lhs` and `rhs` without preferred_element_type: their promoted dtype, except
  bfloat16 for float16 with bfloat16 (where jnp.result_type gives float32)."""
  del dimension_numbers  # the dtype does not depend on them (and lax refuses the negative axes taken here)
  spec = lambda a: jax.ShapeDtypeStruct((1, 1), jnp.result_type(a))
  return jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ()))), spec(lhs), spec(rhs)).dtype


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe, key=None,
                out_sharding=None):
  """A drop-in for `jax.lax.dot_general` whose GEMMs (forward and backward) are quantized by `recipe`.

  Args:
    lhs: activations [..., K] (any leading dims; tokens M = their product).
    rhs: weight [K, N], or [N, K] when `dimension_numbers` contract its axis 1.
    dimension_numbers: as for lax.dot_general; only a linear layer's contraction is accepted.
    precision: used only by unquantized recipes (quantized GEMMs accumulate in float32).
    preferred_element_type: output dtype; defaults to the promoted input dtype, as in lax.dot_general.
    recipe: a fp4jax.Recipe (or its name string).
    key: PRNG key, required when the recipe uses stochastic rounding or per-call RHT signs. One key per layer
      call; it is split per GEMM inside the rule. Or its LayerKeys (derive_layer_keys): the same bits.
    out_sharding: as for lax.dot_general: the output's sharding. With operands sharded over Explicit mesh axes
      (`jax.make_mesh`'s default) it defaults to lax.dot_general's; the quantized GEMMs then run with the axes
      made Auto (fp4jax.explicit_axes). Otherwise, when given, it constrains the output's sharding.

  Inside jax.shard_map each shard quantizes its local operands (per-tensor scales are per shard, and stochastic
  rounding draws the same bits in every shard for one key: fold the shard's index into it); operands that vary
  over different manual axes (a replicated weight) are widened as lax.dot_general widens them, so the weight's
  gradient is summed over the batch's axes. backend="pallas" runs the XLA path there, with a warning.
  """
  recipe = recipes_lib.get_recipe(recipe)
  if key is not None:
    check_layer_key(key, "key")
  if not recipe.is_quantized:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)
  r = _canonical_weight_axes(lhs, rhs, dimension_numbers)
  if recipe.needs_key and key is None:
    raise ValueError(f"recipe {recipe.name!r} uses stochastic rounding or random RHT signs: pass key=.")
  if key is None:
    key = jax.random.key(0)  # unused by the rule's arithmetic; keeps one code path
  k, n = (rhs.shape if r == 0 else rhs.shape[::-1])
  check_layer_shape(k, n, recipe)
  out_dtype = preferred_element_type or lax_output_dtype(lhs, rhs, dimension_numbers)
  if lhs.size == 0 or rhs.size == 0:  # nothing to quantize (an empty batch): lax's empty or all-zero result
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=out_dtype,
                               out_sharding=out_sharding)

  def gemm(lhs, rhs, key):
    # Inside shard_map, as lax.dot_general: a replicated weight's cotangent is then summed over the batch's axes.
    lhs, rhs, _ = explicit_axes.vary_alike(lhs, rhs, key)
    w_KxN = rhs if r == 0 else rhs.T
    y_MxN = _qmatmul_jit(lhs.reshape(-1, k), w_KxN, key, recipe)
    return cast_output(y_MxN.reshape(*lhs.shape[:-1], n), jnp.dtype(out_dtype))

  return explicit_axes.run_gemm(gemm, (lhs, rhs, key), lhs, rhs, dimension_numbers, out_dtype, out_sharding)


def quantized_dot_general(recipe, key=None, *, fixed_key_every_call=None):
  """A function with lax.dot_general's signature that runs `recipe` (for Flax's `dot_general=` arguments).

  Kernels of any layout whose contraction is a linear layer's (nnx.LinearGeneral's [K, heads, head_dim]) run as one
  2D GEMM. Stochastic rounding needs fresh randomness on every call: pass `key=` to each call, or let
  `fp4jax.quantize_model` inject the layers (keys from the model's "quant" stream). Without a key an SR recipe is
  refused, unless `fixed_key_every_call` is given: then that one key is reused by every call (the same rounding
  noise on every step, so SR is biased across training: only for tests and debugging).
  """
  recipe = recipes_lib.get_recipe(recipe)
  if key is not None:
    raise ValueError("quantized_dot_general(recipe, key) no longer closes over a key (every step would reuse its "
                     "stochastic-rounding noise). Use fp4jax.quantize_model(model, rules, rngs=...) for a Flax model, "
                     "pass key= to each call, or (tests only) fixed_key_every_call=key.")
  if fixed_key_every_call is not None:
    keys.check_key(fixed_key_every_call, "fixed_key_every_call")

  def fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, key=None, out_sharding=None):
    from fp4jax import contraction  # pylint: disable=g-import-not-at-top  (contraction imports this module)
    if key is None:
      key = fixed_key_every_call
    if key is None and recipe.needs_key:
      raise ValueError(f"recipe {recipe.name!r} uses stochastic rounding or random RHT signs, which need a fresh key "
                       f"on every call: pass key= to this call, or quantize the model with fp4jax.quantize_model("
                       f"model, rules, rngs=nnx.Rngs(quant=seed)), which draws one per call from the 'quant' stream.")
    return contraction.linear_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                          recipe=recipe, key=key, where="quantized_dot_general",
                                          out_sharding=out_sharding)

  return fn
