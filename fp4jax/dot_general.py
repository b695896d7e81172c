"""Quantized dot_general with a custom_vjp: the Fprop, Dgrad and Wgrad GEMMs of a linear layer, as a recipe says.

For y = x W with x [..., K] (tokens M = product of leading dims) and W [K, N] (or [N, K]):
  Fprop  y  = Q(x along K)            @ Q(W, 2D)
  Dgrad  dx = Q(dY along N, SR)       @ Q(W, 2D)^T          (the Fprop weight codes, transposed: no re-quantization)
  Wgrad  dW = Q(RHT x along M)^T      @ Q(RHT dY along M, SR)
Each GEMM multiplies dequantized operands with float32 accumulation (the "xla" backend), which equals a real FP4
GEMM up to float32 summation order. Residuals are kept quantized: the backward needs Q(W, 2D) and Q(RHT x along M),
both computed in the forward pass from high-precision tensors, so no full-precision copy of x or W is saved.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp4jax.quantize import dequantize, quantize
from fp4jax import recipes as recipes_lib
from fp4jax import rht as rht_lib
from fp4jax.qarray import QArray

_HIGHEST = jax.lax.Precision.HIGHEST
# Independent randomness per GEMM, derived from the one key the caller passes per layer call.
_DGRAD_SR, _WGRAD_SR, _RHT_SIGNS = 1, 2, 3
_DGRAD_W_SR, _WGRAD_X_SR = 4, 5  # SR of the backward's weight / activation operands (TetraJet-v2)


# --- operands -----------------------------------------------------------------------------------------------------

def _rht_signs(recipe: recipes_lib.Recipe, key):
  if recipe.rht_signs == "none":
    return jnp.ones((recipe.rht_size,), jnp.float32)
  if recipe.rht_signs == "per_call":
    return jax.random.fold_in(key, _RHT_SIGNS)
  return None  # the fixed default vector


def quantize_operand(x, cfg: recipes_lib.OperandConfig, *, axis: int, recipe: recipes_lib.Recipe, key=None,
                     signs=None, compute_dtype=None):
  """One GEMM operand as the recipe says: RHT along `axis` (if on), then quantize with blocks along `axis`.

  Returns a QArray, or `x` cast to `compute_dtype` (if given) when the operand stays in high precision.
  """
  if recipe.backend == "pallas" and cfg.quantized:
    from fp4jax import backends  # pylint: disable=g-import-not-at-top
    q = backends.pallas_quantize(x, cfg, axis=axis, recipe=recipe, key=key, signs=signs)
    if q is not None:
      return q
  if cfg.rht:
    x = rht_lib.random_hadamard(x, size=recipe.rht_size, axis=axis, signs=signs)
  if not cfg.quantized:
    return x.astype(compute_dtype) if compute_dtype is not None else x
  return quantize(x, cfg.fmt, axis=axis, block_2d=cfg.block_2d, rounding=cfg.rounding,
                               key=key if cfg.rounding == "stochastic" else None, random_bits=recipe.random_bits,
                               pad=cfg.pad)


def _values(operand):
  """float32 values of an operand (dequantized if quantized)."""
  if isinstance(operand, QArray):
    return dequantize(operand, jnp.float32)
  return operand.astype(jnp.float32)


def _gemm(a, b, contract, recipe):
  """a . b contracting axes `contract` = (a_axis, b_axis), float32 accumulation."""
  if recipe.backend == "pallas" and isinstance(a, QArray) and isinstance(b, QArray):
    from fp4jax import backends  # pylint: disable=g-import-not-at-top
    out = backends.pallas_gemm(a, b, contract)
    if out is not None:
      return out
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(_values(a), _values(b), dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


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
  signs = _rht_signs(recipe, key)
  xq = quantize_operand(x_MxK, recipe.fprop.lhs, axis=1, recipe=recipe, signs=signs)
  wq = quantize_operand(w_KxN, recipe.fprop.rhs, axis=0, recipe=recipe, signs=signs, compute_dtype=x_MxK.dtype)
  return xq, wq


def dgrad_weight(w_KxN, wq_fprop, recipe, key, compute_dtype):
  """Dgrad's weight operand, blocked along N: the Fprop codes when the recipe allows it, else re-quantized
  (from W, or from the dequantized Fprop W when the operand says `requantize`)."""
  if recipe.dgrad_reuses_weight:
    return wq_fprop
  if recipe.dgrad.rhs.requantize:
    w_KxN = _values(wq_fprop).astype(w_KxN.dtype)
  return quantize_operand(w_KxN, recipe.dgrad.rhs, axis=1, recipe=recipe, key=jax.random.fold_in(key, _DGRAD_W_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=compute_dtype)


def wgrad_activations(x_MxK, recipe, key, xq_fprop=None):
  """Wgrad's activation operand: x (or the dequantized Fprop x, with `requantize`) padded to the token multiple,
  RHT and blocks along M (tokens)."""
  if recipe.wgrad.rhs.requantize:
    x_MxK = _values(xq_fprop).astype(x_MxK.dtype)
  x_MxK = _pad_tokens(x_MxK, _token_multiple(recipe))
  return quantize_operand(x_MxK, recipe.wgrad.rhs, axis=0, recipe=recipe, key=jax.random.fold_in(key, _WGRAD_X_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=x_MxK.dtype)


def dgrad_gradient(dy_MxN, recipe, key, compute_dtype=None):
  """Dgrad's output-gradient operand: blocks along N, stochastic rounding per the recipe."""
  return quantize_operand(dy_MxN, recipe.dgrad.lhs, axis=1, recipe=recipe, key=jax.random.fold_in(key, _DGRAD_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=compute_dtype)


def wgrad_gradient(dy_MxN, recipe, key, compute_dtype=None):
  """Wgrad's output-gradient operand: padded tokens, RHT and blocks along M, stochastic rounding per the recipe."""
  dy_MxN = _pad_tokens(dy_MxN, _token_multiple(recipe))
  return quantize_operand(dy_MxN, recipe.wgrad.lhs, axis=0, recipe=recipe, key=jax.random.fold_in(key, _WGRAD_SR),
                          signs=_rht_signs(recipe, key), compute_dtype=compute_dtype)


# --- the custom_vjp rule on canonical [M, K] x [K, N] ------------------------------------------------------------

def _fprop(x_MxK, w_KxN, key, recipe):
  xq, wq = fprop_operands(x_MxK, w_KxN, recipe, key)
  return _gemm(xq, wq, (1, 0), recipe), xq, wq


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qmatmul(x_MxK, w_KxN, key, recipe):
  return _fprop(x_MxK, w_KxN, key, recipe)[0]


def _qmatmul_fwd(x_MxK, w_KxN, key, recipe):
  y, xq, wq = _fprop(x_MxK, w_KxN, key, recipe)
  residuals = (
      dgrad_weight(w_KxN, wq, recipe, key, x_MxK.dtype),
      wgrad_activations(x_MxK, recipe, key, xq),
      key,
      jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype),  # carry dtypes for the cotangents
  )
  return y, residuals


def _qmatmul_bwd(recipe, residuals, dy_MxN):
  w_dgrad, x_wgrad, key, x_proto, w_proto = residuals
  m = dy_MxN.shape[0]
  dyq = dgrad_gradient(dy_MxN, recipe, key, x_proto.dtype)
  dx_MxK = _gemm(dyq, w_dgrad, (1, 1), recipe)[:m]
  dyq_t = wgrad_gradient(dy_MxN, recipe, key, x_proto.dtype)
  dw_KxN = _gemm(x_wgrad, dyq_t, (0, 0), recipe)
  return dx_MxK.astype(x_proto.dtype), dw_KxN.astype(w_proto.dtype), None


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


# --- the public drop-in -------------------------------------------------------------------------------------------

def _canonical_weight_axes(lhs, rhs, dimension_numbers):
  """Checks the dimension numbers describe a linear layer; returns the rhs contracting axis (0: [K,N], 1: [N,K])."""
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
  if lb or rb:
    raise ValueError(f"fp4jax.dot_general quantizes linear layers; batch dimensions are not supported "
                     f"(got dimension_numbers={dimension_numbers}). Keep batched GEMMs (attention) in high precision.")
  if rhs.ndim != 2 or len(lc) != 1 or len(rc) != 1 or lc[0] % lhs.ndim != lhs.ndim - 1:
    raise ValueError(f"fp4jax.dot_general expects activations [..., K] contracted on their last axis with a "
                     f"weight [K, N] or [N, K]; got lhs {lhs.shape}, rhs {rhs.shape}, dimension_numbers="
                     f"{dimension_numbers}.")
  r = rc[0] % 2
  if lhs.shape[-1] != rhs.shape[r]:
    raise ValueError(f"contraction sizes differ: lhs {lhs.shape} axis -1 has {lhs.shape[-1]}, rhs {rhs.shape} "
                     f"axis {r} has {rhs.shape[r]}.")
  return r


def _check_block_divisibility(k, n, recipe):
  """Fprop and Dgrad block K and N (Wgrad's token axis is padded inside the rule): check they divide."""
  sizes = {"K": k, "N": n}
  for gemm, role, dim in (("fprop", "lhs", "K"), ("fprop", "rhs", "K"), ("dgrad", "lhs", "N"), ("dgrad", "rhs", "N")):
    op = getattr(recipe.gemm(gemm), role)
    if not op.quantized or op.pad:
      continue
    b = op.fmt.block_size
    for d in (("K", "N") if op.block_2d else (dim,)):
      if sizes[d] % b:
        raise ValueError(f"{gemm} {role}: {op.fmt.name} blocks of {b} need {d} divisible by {b}; got {d}={sizes[d]} "
                         f"(weight [K, N] = [{k}, {n}]). Use a multiple of {b}, or keep this layer in bf16.")


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe, key=None):
  """A drop-in for `jax.lax.dot_general` whose GEMMs (forward and backward) are quantized by `recipe`.

  Args:
    lhs: activations [..., K] (any leading dims; tokens M = their product).
    rhs: weight [K, N], or [N, K] when `dimension_numbers` contract its axis 1.
    dimension_numbers: as for lax.dot_general; only a linear layer's contraction is accepted.
    precision: used only by unquantized recipes (quantized GEMMs accumulate in float32).
    preferred_element_type: output dtype; defaults to the promoted input dtype, as in lax.dot_general.
    recipe: a fp4jax.Recipe (or its name string).
    key: PRNG key, required when the recipe uses stochastic rounding or per-call RHT signs. One key per layer
      call; it is split per GEMM inside the rule.
  """
  recipe = recipes_lib.get_recipe(recipe)
  if not recipe.is_quantized:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  r = _canonical_weight_axes(lhs, rhs, dimension_numbers)
  if recipe.needs_key and key is None:
    raise ValueError(f"recipe {recipe.name!r} uses stochastic rounding or random RHT signs: pass key=.")
  if key is None:
    key = jax.random.key(0)  # unused by the rule's arithmetic; keeps one code path
  w_KxN = rhs if r == 0 else rhs.T
  k, n = w_KxN.shape
  _check_block_divisibility(k, n, recipe)
  x_MxK = lhs.reshape(-1, k)
  y_MxN = _qmatmul(x_MxK, w_KxN, key, recipe)
  out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  return y_MxN.reshape(*lhs.shape[:-1], n).astype(out_dtype)


def quantized_dot_general(recipe, key=None):
  """A function with lax.dot_general's signature that runs `recipe` (for flax's `dot_general=` arguments)."""

  def fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **unused):
    return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=recipe, key=key)

  return fn
