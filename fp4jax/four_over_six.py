"""Per-block choice between candidate scalings: Four Over Six (arXiv 2512.02010).

NVFP4's grid is coarse near its top (4 -> 6), so mapping a block's max to 6 can leave the block's other values badly
rounded; mapping it to 4 instead (a 1.5x larger block scale) gives those values a finer grid at the cost of
resolution at the top. Four Over Six quantizes each block both ways and keeps the candidate whose dequantized values
are closer to the input (mit-han-lab/fouroversix, src/fouroversix/quantize/pytorch/reference.py, `select_fouroversix`).

The block error is a float32 reduction in a fixed order (pairwise halving over the block's elements laid out row
major), so the choice is reproducible bit for bit: XLA does not reassociate float additions. It does contract a
multiply feeding an add into one fused multiply-add (XLA:CPU on FMA hardware, and GPUs) once both sit in one fusion,
which skips the product's rounding: under an outer jit, deq - x and the first sum of squares came out rounded once
instead of twice, breaking the frequent exact ties between the candidates (both map the block max to the same
value) the other way than eagerly. `rounded` puts an integer operation between each product and its sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax import blocks
from fp4jax import division
from fp4jax import grids

SELECT_METRICS = ("mse", "mae", "absmax")


def pairwise(t, op):
  """Reduces the trailing axis by halving: t[..., :h] op t[..., h:] until one element is left (length 2^k).

  The last halving is a reduction over an axis of two (`op` in {jnp.add, jnp.maximum}; the same bits as l op r,
  since l op r == r op l and the operands are never -0 or below -inf's identity). Written with slices only, XLA:CPU
  fused the whole tree into every per-element consumer and recomputed each block's sum once per element (4/6 ~5x
  slower than plain NVFP4); a reduction stays its own fusion. Only one: XLA merges consecutive reductions into one,
  whose summation order is its own.
  """
  reduce = {jnp.add: jnp.sum, jnp.maximum: jnp.max}[op]
  while t.shape[-1] > 2:
    if t.shape[-1] % 2:
      raise ValueError(f"block of {t.shape[-1]} elements: the pairwise reduction needs a power of two.")
    h = t.shape[-1] // 2
    t = op(t[..., :h], t[..., h:])
  if t.shape[-1] == 2:
    t = reduce(t, axis=-1, keepdims=True)
  return t[..., 0]


def rounded(v, zero):
  """float32 `v` unchanged, its bits OR'd with the uint32 `zero` (a runtime 0 no compiler can prove is 0).

  An optimization barrier does not help (XLA:CPU drops it before fusion) nor does reduce_precision(v, 8, 23) (a
  no-op, removed); integer bit operations are opaque to both XLA's simplifier and LLVM, so the product is rounded
  to float32 before the addition that consumes it.
  """
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32) | zero
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def block_reduce(a, block, op):
  """Per-block `op`-reduction (jnp.add or jnp.maximum) of `a` by pairwise halving over each block's elements laid
  out row major (a 2D tile's rows halve first, then its columns), with the blocks' shape; computed in a kernel of
  its own (`division.computed_apart`: XLA would otherwise recompute a sum in every element of a reader).

  The halvings run where the blocked axes lie, so each stage reads whole rows, except along the array's minor axis:
  there the block's 16 elements are 16 slices, which XLA:CPU reads from memory (it fuses a producer into at most 15
  differently indexed users, so the elementwise work before them is one vectorised pass). Halving along the minor
  axis instead made loops of width 8 down to 2 that recomputed that work per slice, and gathering each block on one
  axis first read it with stride 16: 4/6's `small` train step took 4.0x bf16's. The order is the same in every form.
  """
  for b in block:
    if b & (b - 1):
      raise ValueError(f"block of {b} elements along an axis: the pairwise reduction needs a power of two.")
  split, inner = blocks.split_blocks(a.shape, block)
  t = a.reshape(split)
  for axis in inner:
    terms = ([jax.lax.index_in_dim(t, j, axis=axis) for j in range(t.shape[axis])] if axis == t.ndim - 1 else
             [t])
    while len(terms) > 1 or terms[0].shape[axis] > 1:
      if len(terms) > 1:
        h = len(terms) // 2
        terms = [op(terms[j], terms[j + h]) for j in range(h)]
      else:
        h = terms[0].shape[axis] // 2
        terms = [op(jax.lax.slice_in_dim(terms[0], 0, h, axis=axis),
                    jax.lax.slice_in_dim(terms[0], h, 2 * h, axis=axis))]
    t = terms[0]
  return division.computed_apart(t.reshape([t.shape[i] for i in range(t.ndim) if i not in inner]))


def block_error(err, block, metric: str, zero):
  """Per-block error of float32 differences `err` (dequantized - input), with the scales' shape.

  "mse": sum of squares, "mae": sum of |err|, "absmax": max |err| (NaN-propagating), all float32. `zero` is a runtime
  uint32 0 (see `rounded`): the squares are rounded before they are summed, under any jit.
  """
  if metric == "mse":
    return block_reduce(rounded(err * err, zero), block, jnp.add)
  if metric == "mae":
    return block_reduce(jnp.abs(err), block, jnp.add)
  if metric == "absmax":
    return block_reduce(jnp.abs(err), block, jnp.maximum)
  raise ValueError(f"select must be one of {SELECT_METRICS}; got {metric!r}.")


def choose(x32, candidates, block, metric, round_fn, decode_fn, expand_fn, select_round_fn=None, amax_b=None):
  """Rounds `x32` under each candidate scaling and keeps, per block, the one with the smallest error.

  Args:
    x32: the float32 tensor (padded to whole blocks).
    candidates: formats.Scaling per candidate, in preference order: a later one wins only if strictly better
      (so ties, and NaN errors, keep the first).
    block: the block shape.
    metric: "mse", "mae" or "absmax".
    round_fn: y -> element values on the E2M1 grid (the operand's rounding, same random bits for every candidate).
    decode_fn: (values, scaling) -> dequantized float32 values before the tensor's non-finite check.
    expand_fn: per-block array -> repeated over each block (x32's shape).
    select_round_fn: if given, the errors are measured on its rounding (round-to-nearest), and `round_fn` then
      rounds the chosen scaling only: a choice that does not depend on `round_fn`'s random bits.
    amax_b: the block amaxes (the scales' shape); if given, each block's values and input are scaled by the power
      of two 2^-floor(log2 amax_b) before the error is measured (exact), so that the errors' squares and sums
      neither overflow (|x| above ~1e19: every error inf) nor underflow (below ~1e-19: every error 0), which made
      both candidates tie and 4/6 fall back to "6" on every block of a huge or tiny tensor.

  Returns:
    (element values, chosen stored scales, chosen per-block decode factors (a tuple), chosen candidate per block).
  """
  # Block decode scales are never negative (NaN < 0 is False), which XLA cannot know: a runtime 0 for `rounded`.
  zero = jnp.any(candidates[0].decode[0] < 0).astype(jnp.uint32)
  judge = select_round_fn or round_fn
  if amax_b is None:
    unit, x_unit = None, x32
  else:  # each product is exact, so the rounding of the difference and the candidates' order keep their bits
    # Once per block: XLA fused this bit arithmetic into every element's loop (~25 operations per element).
    unit = expand_fn(division.computed_apart(grids.pow2(-jnp.clip(grids.exponent_of(amax_b), -126, 126))))
    x_unit = x32 * unit
  best = None
  for i, sc in enumerate(candidates):
    (encode,) = sc.encode
    values = judge(x32 * expand_fn(encode))
    deq = rounded(decode_fn(values, sc), zero)
    err = block_error((deq if unit is None else deq * unit) - x_unit, block, metric, zero)
    if best is None:
      best = (values, sc.stored, sc.decode, jnp.zeros(err.shape, jnp.int32), err, encode)
      continue
    better = err < best[4]
    wide = expand_fn(better)
    decode = tuple(jnp.where(better, new, old) for new, old in zip(sc.decode, best[2]))
    best = (jnp.where(wide, values, best[0]), jnp.where(better, sc.stored, best[1]), decode,
            jnp.where(better, jnp.int32(i), best[3]), jnp.where(better, err, best[4]),
            jnp.where(better, encode, best[5]))
  if select_round_fn is not None:  # the operand's own rounding, of the chosen scaling only
    best = (round_fn(x32 * expand_fn(best[5])),) + best[1:]
  return best[:4]
