"""A linear layer's contraction in any layout, run as one quantized 2D GEMM [M, K] x [K, N] by fp4jax.dot_general.

Flax's LinearGeneral keeps kernels like [K, heads, head_dim] (q/k/v) or [heads, head_dim, D] (the attention output)
and Einsum takes an equation: both are linear layers once the contracted axes are flattened into K and the kernel's
other axes into N. Batched contractions (a kernel axis shared with the output, as in attention's q.k) are not, and
are refused: they have no weight to quantize along K and N.
"""

from __future__ import annotations

import math
import string

import jax
import jax.numpy as jnp

from fp4jax import explicit_axes
from fp4jax import recipes as recipes_lib
from fp4jax.dot_general import check_axes_in_range
from fp4jax.dot_general import check_layer_shape
from fp4jax.dot_general import dot_general as quantized_gemm


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe,
                       key=None, where: str = "dot_general", out_sharding=None):
  """lax.dot_general's result for a linear layer's contraction, its GEMMs quantized by `recipe`.

  `rhs` is the kernel; the contracted axes may sit anywhere in both operands. The output layout is lax's: lhs free
  axes then rhs free axes. `where` names the caller in error messages. `out_sharding` as for fp4jax.dot_general
  (operands over Explicit mesh axes run with the axes made Auto).
  """
  recipe = recipes_lib.get_recipe(recipe)
  if not recipe.is_quantized:  # exactly lax's GEMM, no reshapes
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)
  if explicit_axes.explicit_axes(lhs, rhs):  # the reshapes below split and merge sharded axes
    if out_sharding is None:
      out_sharding = explicit_axes.dot_general_sharding(lhs, rhs, dimension_numbers, preferred_element_type)
    run = lambda lhs, rhs, key: linear_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                                   recipe=recipe, key=key, where=where)
    return explicit_axes.run_auto(run, (lhs, rhs, key), out_sharding)
  (lc, rc), (lb, rb) = dimension_numbers
  if tuple(lb) or tuple(rb):
    raise ValueError(f"{where}: a batched contraction (dimension_numbers={dimension_numbers}) is not a linear "
                     f"layer; keep it in high precision.")
  check_axes_in_range(lc, lhs.ndim, "lhs contracting", dimension_numbers, where)
  check_axes_in_range(rc, rhs.ndim, "rhs contracting", dimension_numbers, where)
  lc = tuple(int(a) % lhs.ndim for a in lc)
  rc = tuple(int(a) % rhs.ndim for a in rc)
  if not lc or len(lc) != len(rc) or len(set(lc)) != len(lc) or len(set(rc)) != len(rc):
    raise ValueError(f"{where}: bad contracting dimensions {dimension_numbers} for lhs {lhs.shape}, rhs {rhs.shape}.")
  for a, b in zip(lc, rc):
    if lhs.shape[a] != rhs.shape[b]:
      raise ValueError(f"{where}: contraction sizes differ: lhs {lhs.shape} axis {a} vs rhs {rhs.shape} axis {b}.")
  lfree = [a for a in range(lhs.ndim) if a not in lc]
  rfree = [b for b in range(rhs.ndim) if b not in rc]
  k = math.prod(lhs.shape[a] for a in lc)
  free_shape_L = tuple(lhs.shape[a] for a in lfree)
  free_shape_R = tuple(rhs.shape[b] for b in rfree)
  x_xK = _moved(lhs, lfree + list(lc)).reshape(*free_shape_L, k)
  w_KxN = _moved(rhs, list(rc) + rfree).reshape(k, math.prod(free_shape_R))
  try:  # here, so that the error names the layer (Linen and Einsum layers are only seen at call time)
    check_layer_shape(*w_KxN.shape, recipe)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  y_xN = quantized_gemm(x_xK, w_KxN, (((x_xK.ndim - 1,), (0,)), ((), ())), precision, preferred_element_type,
                        recipe=recipe, key=key)
  y = y_xN.reshape(*free_shape_L, *free_shape_R)
  return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


def _moved(x, order):
  return x if list(order) == list(range(x.ndim)) else jnp.transpose(x, order)


def einsum_as_dot_general(equation: str, lhs_ndim: int, rhs_ndim: int):
  """(dimension_numbers, output permutation) of a linear-layer einsum "input,kernel->output", else ValueError.

  A linear layer: every kernel axis is either contracted with an input axis (and absent from the output) or kept in
  the output; every input axis is contracted or kept; nothing is summed away on one side only or shared as a batch
  axis. An ellipsis may stand for leading input axes (and the matching output axes), never for kernel axes.
  """
  eq = equation.replace(" ", "")
  if eq.count("->") != 1 or eq.split("->")[0].count(",") != 1:
    raise ValueError(f"einsum {equation!r}: expected 'input,kernel->output'.")
  ins, out = eq.split("->")
  lhs, rhs = ins.split(",")
  if "..." in rhs:
    raise ValueError(f"einsum {equation!r}: an ellipsis in the kernel is not a linear layer's layout.")
  spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in eq]
  if "..." in lhs:
    fill = "".join(spare[:lhs_ndim - (len(lhs) - 3)])
    lhs, out = lhs.replace("...", fill), out.replace("...", fill)
  if len(lhs) != lhs_ndim or len(rhs) != rhs_ndim:
    raise ValueError(f"einsum {equation!r} does not match operands of rank {lhs_ndim} and {rhs_ndim}.")
  for name, term in (("input", lhs), ("kernel", rhs), ("output", out)):
    if len(set(term)) != len(term) or (term and not term.isalpha()):
      raise ValueError(f"einsum {equation!r}: the {name} term {term!r} repeats an axis or has a bad character.")
  contracted = [c for c in rhs if c in lhs]
  batch = [c for c in contracted if c in out]
  summed = [c for c in lhs + rhs if c not in out and not (c in lhs and c in rhs)]
  extra = [c for c in out if c not in lhs and c not in rhs]
  if batch or summed or extra or not contracted:
    why = (f"axes {batch} are shared by input, kernel and output (a batched contraction)" if batch else
           f"axes {summed} are summed away on one side" if summed else
           f"output axes {extra} come from neither operand" if extra else "nothing is contracted")
    raise ValueError(f"einsum {equation!r} is not a linear layer: {why}.")
  lc = tuple(lhs.index(c) for c in contracted)
  rc = tuple(rhs.index(c) for c in contracted)
  produced = [c for c in lhs if c not in contracted] + [c for c in rhs if c not in contracted]
  return ((lc, rc), ((), ())), tuple(produced.index(c) for c in out)


def linear_einsum(equation, lhs, rhs, precision=None, preferred_element_type=None, *, recipe, key=None,
                  where: str = "einsum", out_sharding=None):
  """jnp.einsum(equation, lhs, rhs) for a linear-layer equation, its GEMMs quantized by `recipe`. `out_sharding` as
  for jnp.einsum (nnx.Einsum passes its call's), with operands over Explicit mesh axes as for linear_dot_general."""
  try:
    dims, perm = einsum_as_dot_general(equation, lhs.ndim, rhs.ndim)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  if explicit_axes.explicit_axes(lhs, rhs):  # the output transpose too runs with the axes made Auto
    if out_sharding is None:
      out_sharding = jax.eval_shape(
          lambda a, b: jnp.einsum(equation, a, b, preferred_element_type=preferred_element_type), lhs, rhs).sharding
    run = lambda lhs, rhs, key: linear_einsum(equation, lhs, rhs, precision, preferred_element_type,
                                              recipe=recipe, key=key, where=where)
    return explicit_axes.run_auto(run, (lhs, rhs, key), out_sharding)
  y = _moved(linear_dot_general(lhs, rhs, dims, precision, preferred_element_type, recipe=recipe, key=key,
                                where=where), perm)
  return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)
