"""OutControl (TetraJet-v2): a linear layer's outlier input channels in MXFP8, the other channels in the recipe.

TetraJet-v2 (Chen et al., arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training,
olmo2-training/olmo/quantization_real/linear_mix.py and calibrate.py) records the L2 norm of every input channel
of a layer's activations x (channels = K, Fprop's contraction axis) over a short calibration window, then runs the
channels with the largest summed norms through an FP8 GEMM while the others stay in NVFP4. With the outlier set
I (k channels, `idx`) and the rest R, for y = x W:
  Fprop  y        = Q(x_R) @ Q(W_R)                    +  Q8(x[:, I] along K)   @ Q8(W[I, :] along K)
  Dgrad  dx[:, R] = the recipe's Dgrad of x_R,  dx[:, I] = Q8(dY along N)       @ Q8(W[I, :] along N)^T
  Wgrad  dW[R, :] = the recipe's Wgrad of W_R,  dW[I, :] = Q8(x[:, I] along M)^T @ Q8(dY along M)
where x_R and W_R are x and W with the outlier channels set to zero (so the recipe's GEMMs, RHT and block scales
see only the rest) and Q8 is MXFP8 (formats.MXFP8: E4M3 elements, E8M0 scale per 32, round to nearest; the
gathered k channels are zero-padded to whole blocks). As in the authors' linear_mix.py, Wgrad's MXFP8 activation is
re-quantized from the dequantized Fprop operand; here Dgrad's MXFP8 weight is too (re-blocked along N).

Differences from the authors' code: they gather the rest channels into a dense [M, K - k] tensor (so FP4 blocks
span channels that are not neighbours in x) and round k up to a multiple of 128 for their kernels; here the rest
keeps its positions with zeros in place of the outliers, and k is any count >= 1. Their Dgrad runs every channel in
FP4 (the outlier rows of W re-quantized from FP8); here the outlier columns of dx come from an MXFP8 GEMM, so the
outlier channels are in MXFP8 in all three GEMMs.

The statistics and the selection are `channel_sq_norms` and `select_channels`; the schedule that calls them during
training is fp4jax.pretrain.outcontrol.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import explicit_axes
from fp4jax import formats
from fp4jax import recipes as recipes_lib
from fp4jax.dot_general import (Operands, _canonical_weight_axes, _first_order_only, check_layer_key,
                                check_layer_shape, dgrad, fprop, layer_operands, rule_keys, wgrad)
from fp4jax.dot_general import cast_output
from fp4jax.dot_general import lax_output_dtype
from fp4jax.dot_general import dot_general as plain_dot_general
from fp4jax.gemm import f32_values as _values
from fp4jax.quantize import quantize

MXFP8 = formats.MXFP8()
_HIGHEST = jax.lax.Precision.HIGHEST


# --- calibration: statistics and selection ---------------------------------------------------------------------

def check_fraction(fraction: float) -> None:
  """Raises ValueError unless `fraction` is a number in [0, 1)."""
  if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 <= fraction < 1:
    raise ValueError(f"OutControl fraction must be a number in [0, 1); got {fraction!r}.")


def outlier_count(k_features: int, fraction: float) -> int:
  """k = ceil(fraction * K) outlier channels of a layer with K input features (0 when fraction is 0)."""
  check_fraction(fraction)
  if fraction == 0:
    return 0
  # 0.07 * 100 is 7.000000000000001 in floating point; yet any fraction > 0 selects at least one channel.
  k = max(1, math.ceil(fraction * k_features - 1e-9))
  if k >= k_features:
    raise ValueError(f"OutControl fraction {fraction} selects all {k_features} channels of a layer; use a smaller "
                     "fraction (the paper uses a few percent).")
  return k


def channel_sq_norms(x_xK: jax.Array) -> jax.Array:
  """Per input channel, the sum over all tokens of x^2 (float32 [K]); sqrt of it is the channel's L2 norm."""
  x = jax.lax.stop_gradient(x_xK).astype(jnp.float32)
  return jnp.sum(jnp.square(x).reshape(-1, x.shape[-1]), axis=0)


def select_channels(scores_K: jax.Array, k: int) -> jax.Array:
  """The k channels with the largest scores, largest first (ties: lower index first), as int32 [k].

  The authors' calibrate step sorts the summed norms the same way (torch.argsort descending); the order fixes how
  the gathered channels fall into MXFP8 blocks.
  """
  if scores_K.ndim != 1 or not 1 <= k < scores_K.shape[0]:
    raise ValueError(f"select_channels: need scores [K] and 1 <= k < K; got shape {scores_K.shape}, k={k}.")
  return jnp.argsort(-scores_K.astype(jnp.float32), stable=True)[:k].astype(jnp.int32)


# --- the split GEMMs ----------------------------------------------------------------------------------------------

class SplitOperands(NamedTuple):
  """Operands of a split layer: `rest` (dot_general.Operands of x and W with the outlier channels zeroed), the
  MXFP8 operands x8 [M, k] and w8 [k, N] (blocks along k) for Fprop (the gathered channels unquantized when the
  recipe's Fprop is high precision: a forward-only late switch), w8_dgrad [k, N] (blocks along N) and x8_wgrad
  [M, k] (blocks along M) for the backward (None without `backward`)."""

  rest: Operands
  x8: Any
  w8: Any
  w8_dgrad: Any = None
  x8_wgrad: Any = None


def _check_idx(idx, k_features):
  """A clear error for indices of the wrong kind; known (untraced) ones must also be distinct and in [0, K)."""
  if idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer) or not 1 <= idx.shape[0] < k_features:
    raise ValueError(f"OutControl: outlier indices must be an integer array [k] with 1 <= k < K={k_features}; got "
                     f"{idx.dtype} {idx.shape}.")
  try:
    values = [int(i) for i in np.asarray(idx).tolist()]
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced: distinct by construction when select_channels chose them
  bad = [i for i in values if not 0 <= i < k_features]
  if bad:
    raise ValueError(f"OutControl: outlier indices must lie in [0, K={k_features}); got {bad}.")
  if len(set(values)) != len(values):
    raise ValueError(f"OutControl: outlier indices must be distinct channels; got {values} (a repeated channel "
                     "would be counted once per repeat).")


def _poison_unless_distinct(idx_k, k_features, *arrays):
  """`arrays` as they are where the indices are distinct channels in [0, K), else all NaN: traced indices cannot be
  refused, and a repeated one would be counted once per repeat in the forward but once in the backward."""
  s = jnp.sort(idx_k)
  ok = jnp.all((s >= 0) & (s < k_features)) & jnp.all(s[1:] != s[:-1])
  return tuple(jnp.where(ok, a, jnp.asarray(jnp.nan, a.dtype)) for a in arrays)


def _mxfp8(a, axis):
  return quantize(a, MXFP8, axis=axis, pad=True)


def _gemm8(a, b, contract):
  """float32 GEMM of two MXFP8 operands' values (exact products, float32 accumulation)."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(_values(a), _values(b), dims, precision=_HIGHEST,
                             preferred_element_type=jnp.float32)


def split_operands(x_MxK, w_KxN, idx_k, recipe: recipes_lib.Recipe, key, *, backward: bool = True,
                   unit: bool = False) -> SplitOperands:
  """Quantizes x and W for the split GEMMs: the rest by `recipe`, the outlier channels `idx_k` in MXFP8.
  `unit`: the rest's GEMM-only operands in their bf16 form (dot_general.layer_operands), as the rule takes them."""
  _check_idx(idx_k, x_MxK.shape[1])
  keep = jnp.ones((x_MxK.shape[1],), bool).at[idx_k].set(False)
  x_rest = jnp.where(keep[None, :], x_MxK, jnp.zeros((), x_MxK.dtype))
  w_rest = jnp.where(keep[:, None], w_KxN, jnp.zeros((), w_KxN.dtype))
  rest = layer_operands(x_rest, w_rest, recipe, key, backward=backward, unit=unit)
  x_I, w_I = jnp.take(x_MxK, idx_k, axis=1), jnp.take(w_KxN, idx_k, axis=0)
  x_I, w_I = _poison_unless_distinct(idx_k, x_MxK.shape[1], x_I, w_I)
  if recipe.fprop.lhs.quantized or recipe.fprop.rhs.quantized:
    x8, w8 = _mxfp8(x_I, axis=1), _mxfp8(w_I, axis=0)
    x_src, w_src = _values(x8), _values(w8)  # the backward re-quantizes the Fprop operands (linear_mix.py)
  else:  # a forward switched to BF16 (`switch="forward"`): the outlier channels' Fprop is high precision too
    x8, w8 = x_I, w_I.astype(x_MxK.dtype)  # as layer_operands casts the weight of a high-precision Fprop
    x_src, w_src = x_I, w_I
  if not backward:
    return SplitOperands(rest, x8, w8)
  return SplitOperands(rest, x8, w8, _mxfp8(w_src, axis=1), _mxfp8(x_src, axis=0))


def split_fprop(ops: SplitOperands, recipe: recipes_lib.Recipe):
  """y [M, N] float32: the recipe's Fprop of the rest plus the MXFP8 GEMM of the outlier channels."""
  return fprop(ops.rest, recipe) + _gemm8(ops.x8, ops.w8, (1, 0))


def split_dgrad(dy_MxN, ops: SplitOperands, idx_k, recipe: recipes_lib.Recipe, key, compute_dtype, unit=False):
  """dx [M, K] float32: the recipe's Dgrad on the rest channels, the MXFP8 Dgrad on the outlier columns."""
  dx_rest, _ = dgrad(dy_MxN, ops.rest.w_dgrad, recipe, key, compute_dtype, ops.rest.x_mask, unit=unit)
  dx8 = _gemm8(_mxfp8(dy_MxN, axis=1), ops.w8_dgrad, (1, 1))
  return dx_rest.at[:, idx_k].set(dx8)  # the outlier columns come from the MXFP8 GEMM alone


def split_wgrad(dy_MxN, ops: SplitOperands, idx_k, recipe: recipes_lib.Recipe, key, compute_dtype, unit=False):
  """dW [K, N] float32: the recipe's Wgrad on the rest rows, the MXFP8 Wgrad on the outlier rows."""
  dw_rest, _ = wgrad(dy_MxN, ops.rest.x_wgrad, recipe, key, compute_dtype, ops.rest.w_mask, unit=unit)
  dw8 = _gemm8(ops.x8_wgrad, _mxfp8(dy_MxN, axis=0), (0, 0))
  return dw_rest.at[idx_k, :].set(dw8)  # the outlier rows come from the MXFP8 GEMM alone


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _split_matmul(x_MxK, w_KxN, idx_k, key, recipe):
  return split_fprop(split_operands(x_MxK, w_KxN, idx_k, recipe, key, backward=False, unit=True), recipe)


def _split_matmul_fwd(x_MxK, w_KxN, idx_k, key, recipe):
  x_MxK, w_KxN = _first_order_only((x_MxK, w_KxN))  # as fp4jax.dot_general's rule: no silent second derivatives
  key = rule_keys(recipe, key)
  ops = split_operands(x_MxK, w_KxN, idx_k, recipe, key, unit=True)
  # Fprop-only operands are not needed again: keep the backward's residuals only.
  residuals = (ops._replace(rest=ops.rest._replace(x_fprop=None, w_fprop=None), x8=None, w8=None), idx_k, key,
               jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype))
  return split_fprop(ops, recipe), residuals


def _split_matmul_bwd(recipe, residuals, dy_MxN):
  dy_MxN, residuals = _first_order_only((dy_MxN, residuals))
  ops, idx_k, key, x_proto, w_proto = residuals
  dx = split_dgrad(dy_MxN, ops, idx_k, recipe, key, x_proto.dtype, unit=True)
  dw = split_wgrad(dy_MxN, ops, idx_k, recipe, key, x_proto.dtype, unit=True)
  return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype), None, None


_split_matmul.defvjp(_split_matmul_fwd, _split_matmul_bwd)
_split_matmul_jit = jax.jit(_split_matmul, static_argnums=(4,))  # as dot_general's rule: one compile when eager


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe, key=None,
                outliers=None, out_sharding=None):
  """fp4jax.dot_general with OutControl: the input channels `outliers` (int array [k]) run in MXFP8.

  outliers=None (or an unquantized recipe) is exactly fp4jax.dot_general. The indices are distinct channels of the
  contraction axis K; k is static. Known indices that repeat or leave [0, K) are refused; traced ones that do make
  the output and gradients NaN. `out_sharding` as for fp4jax.dot_general.
  """
  recipe = recipes_lib.get_recipe(recipe)
  if outliers is None or not recipe.is_quantized:
    return plain_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, recipe=recipe, key=key,
                             out_sharding=out_sharding)
  if key is not None:
    check_layer_key(key, "key")
  r = _canonical_weight_axes(lhs, rhs, dimension_numbers)
  if recipe.needs_key and key is None:
    raise ValueError(f"recipe {recipe.name!r} uses stochastic rounding or random RHT signs: pass key=.")
  key = jax.random.key(0) if key is None else key
  k, n = (rhs.shape if r == 0 else rhs.shape[::-1])
  check_layer_shape(k, n, recipe)
  outliers = jnp.asarray(outliers)
  _check_idx(outliers, k)
  out_dtype = preferred_element_type or lax_output_dtype(lhs, rhs, dimension_numbers)
  if lhs.size == 0 or rhs.size == 0:  # nothing to quantize (an empty batch): lax's result, as fp4jax.dot_general
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=out_dtype,
                               out_sharding=out_sharding)

  def gemm(lhs, rhs, outliers, key):
    lhs, rhs, _, _ = explicit_axes.vary_alike(lhs, rhs, outliers, key)  # as fp4jax.dot_general's, in shard_map
    w_KxN = rhs if r == 0 else rhs.T
    y_MxN = _split_matmul_jit(lhs.reshape(-1, k), w_KxN, outliers, key, recipe)
    return cast_output(y_MxN.reshape(*lhs.shape[:-1], n), jnp.dtype(out_dtype))

  return explicit_axes.run_gemm(gemm, (lhs, rhs, outliers, key), lhs, rhs, dimension_numbers, out_dtype,
                                out_sharding)
