"""How the xla backend multiplies two GEMM operands: the GEMM mode ("auto", "bf16", "f32") and the GEMM itself.

"f32" multiplies the fully dequantized float32 values at HIGHEST precision (the reference). "bf16" multiplies code x
block scale in bfloat16, exact for FP4 (at most 6 significant bits), with float32 accumulation and the per-tensor
scales applied to the float32 output, as an FP4 GEMM does: its products are exact, so it equals a real FP4 GEMM up
to float32 summation order. "f32" rounds each dequantized element q * s_b * (amax / 2688) and each product to
float32, so the two modes differ by those roundings as well as the order, both within float32's error of the exact
GEMM (tests/fp4jax/test_gemm_mode.py bounds it). NVFP4 with double-block scales (TetraJet-v2) has an FP32 scale per
1x128 group along the contraction axis: "bf16" multiplies each group's codes x block scales in a GEMM of its own and
applies both operands' group scales to that partial product (`grouped_gemm`), as a block-scaled GEMM on tensor cores
does per k-block. Operands with no exact bfloat16 form (FP8 block scales, float32
arrays) take the "f32" path.
The custom_vjp rule (fp4jax.dot_general) runs its three GEMMs through `gemm`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp4jax import blocks
from fp4jax import division
from fp4jax import formats
from fp4jax import nvfp4
from fp4jax import recipes as recipes_lib
from fp4jax.qarray import QArray
from fp4jax.quantize import decoded_values, dequantize

_HIGHEST = jax.lax.Precision.HIGHEST


class Unit(NamedTuple):
  """A quantized operand as a GEMM reads it: `values` (the input's shape) times the float32 `factor` are its
  dequantized values. `factor` is a scalar, or for NVFP4 double-block scales one factor per 1x128 group along the
  blocked axis (`values`' shape with that axis cut to its group count; `group_axis`, `expand_factor`).
  bf16 mode: code x block scale in bfloat16 (`bf16_values`, `unit_values`); f32 mode: the dequantized float32 values
  and factor 1 (`f32_unit`). `unit_values` and `f32_unit` build it straight from a tensor, without packing codes;
  the rule multiplies operands it needs only for a GEMM this way."""

  values: jax.Array
  factor: jax.Array


GROUP = formats.DOUBLE_BLOCK_GROUP * formats.NVFP4().block_size  # elements per double-block group (128)


def group_axis(unit: Unit) -> int | None:
  """The axis a Unit's per-group factors run along (NVFP4 double-block); None for a scalar factor.

  It is the one axis where `factor` is shorter than `values`: a blocked axis of n >= 16 elements has
  ceil(n / 128) < n groups, and every other axis has `values`' length."""
  if jnp.ndim(unit.factor) == 0:
    return None
  axes = [i for i, (v, f) in enumerate(zip(unit.values.shape, unit.factor.shape)) if v != f]
  if jnp.ndim(unit.factor) != unit.values.ndim or len(axes) != 1 or unit.factor.shape[axes[0]] != -(
      -unit.values.shape[axes[0]] // GROUP):
    raise ValueError(f"a Unit's factor is a scalar or one per {GROUP}-element group along one axis of its values; "
                     f"got values {unit.values.shape} and factor {jnp.shape(unit.factor)}.")
  return axes[0]


def expand_factor(unit: Unit):
  """The Unit's factor broadcastable against its values: a scalar, or each group's repeated over its elements."""
  a = group_axis(unit)
  if a is None:
    return unit.factor
  block = tuple(GROUP if i == a else 1 for i in range(unit.values.ndim))
  return jax.lax.slice_in_dim(blocks.expand_blocks(unit.factor, block), 0, unit.values.shape[a], axis=a)


def f32_values(operand):
  """float32 values of an operand (dequantized if quantized)."""
  if isinstance(operand, QArray):
    return dequantize(operand, jnp.float32)
  if isinstance(operand, Unit):
    # (code x block scale) x group scale: dequantize's order for double-block scales, so the same bits.
    return operand.values.astype(jnp.float32) * expand_factor(operand)
  return operand.astype(jnp.float32)


def _unit_parts(fmt, scales, amax):
  """(fmt, scales, amax, factor) whose dequantized values are exact in bfloat16, times `factor` the operand's; or
  None where there is no such split (see bf16_values)."""
  poison = lambda f: jnp.where(jnp.all(jnp.isfinite(amax)), f, jnp.float32(jnp.nan))
  if isinstance(fmt, formats.NVFP4):
    # double_block: one amax per 1x128 group, so one factor per group (a non-finite one poisons them all, as
    # dequantize poisons the whole tensor). Dequantizing with amax = the format's global range (2688 for NVIDIA's
    # rule) multiplies by a global scale of exactly 1 and skips no other step.
    r = fmt.global_range
    # Poisoned before the division, so the NaN check joins the division's scalar kernel (NaN / r is NaN).
    return fmt, scales, jnp.full_like(amax, r), nvfp4.global_decode_scale(poison(amax), r)
  if isinstance(fmt, formats.MXFP4):  # code x 2^e, and Tseng's 4/3 ("tseng") as the per-tensor factor
    return formats.MXFP4(), scales, amax, jnp.float32(fmt.tensor_factor)  # every rule stores the same E8M0 scales
  if jnp.ndim(scales) == 0:  # FP8 with per-tensor scaling
    return fmt, jnp.ones_like(scales), amax, poison(scales.astype(jnp.float32))
  return None


def bf16_values(operand):
  """A Unit (bfloat16 values, float32 factor per tensor or per 1x128 group) with values * expand_factor(unit) ==
  f32_values(operand) bit for bit, or None if there is no exact one.

  NVFP4: E2M1 code x E4M3 block scale (<= 2 x 4 significant bits) and the factor amax / R (R = the format's global
  range, 2688 for NVIDIA's rule), with double_block one factor per 1x128 group (a Unit whose factor is per group:
  values * expand_factor(unit)); MXFP4: code x 2^e and 1; FP8 with one tensor scale: the E4M3 code and that scale.
  FP8's float32 block scales and float32 operands have no exact bfloat16 form. A non-finite amax makes the factor
  NaN, as dequantize poisons the whole tensor.
  """
  if isinstance(operand, Unit):  # an f32_unit (float32 values) has no bfloat16 form either
    return operand if operand.values.dtype == jnp.bfloat16 else None
  if not isinstance(operand, QArray):
    return Unit(operand, jnp.float32(1.0)) if operand.dtype == jnp.bfloat16 else None
  parts = _unit_parts(operand.fmt, operand.scales, operand.amax)
  if parts is None:
    return None
  fmt, scales, amax, factor = parts
  unit = dataclasses.replace(operand, fmt=fmt, scales=scales, amax=amax)
  return Unit(dequantize(unit, jnp.bfloat16), factor)


def unit_values(x, fmt, **quantize_kwargs) -> Unit | None:
  """bf16_values(quantize(x, fmt, **quantize_kwargs)) bit for bit, computed from the quantizer's element values and
  float32 block scales instead of packed codes and stored scales (3-7x faster for 16x16 weight blocks on XLA:CPU);
  None where bf16_values would be."""
  fmt = formats.get_format(fmt)
  # Decided from the format, before quantizing, so that a caller falling back to another form quantizes once:
  # FP8 is left to f32_unit.
  if not fmt.is_fp4:
    return None
  values, amax = decoded_values(x, fmt, dtype=jnp.bfloat16, tensor_decode=False, **quantize_kwargs)
  factor = _unit_parts(fmt, None, amax)[3]
  # As in bf16_values: a non-finite amax poisons NVFP4's factor (its values decode with amax = R), and MXFP4's
  # values (they decode with its own amax; its factor is a constant).
  if isinstance(fmt, formats.MXFP4):
    values = jnp.where(jnp.all(jnp.isfinite(amax)), values, jnp.bfloat16(jnp.nan))
  return Unit(values, factor)


def f32_unit(x, fmt, **quantize_kwargs) -> Unit:
  """f32_values(quantize(x, fmt, **quantize_kwargs)) bit for bit, as a Unit with factor 1, computed from the
  quantizer's element values and float32 block scales instead of packed codes (any format): what an "f32"-mode GEMM
  reads."""
  return Unit(decoded_values(x, fmt, dtype=jnp.float32, **quantize_kwargs)[0], jnp.float32(1.0))


# CPU flags under which XLA:CPU's bf16 x bf16 -> float32 dots were measured faster than float32 HIGHEST ones in the
# train step (AVX-512: ~15% per quantized layer; AMD Zen 4 with avx512_bf16: the `small` nvfp4 step 1.15-1.27x the
# bf16 recipe's in "bf16" mode against 1.25-1.30x in "f32"). On AVX2 without them (AMD Zen 3) float32 is faster:
# 1.17-1.21x in "f32" mode against 1.27-1.33x in "bf16" (benchmarks/RESULTS.md).
BF16_FAST_CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
  """The host CPU's feature flags, from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.split(":", 1)[0].strip() in ("flags", "Features"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def auto_gemm_mode(backend: str, flags=frozenset()) -> str:
  """What "auto" means on `backend` ("cpu", "gpu", "tpu", ...) with CPU feature `flags`.

  "bf16" on accelerators (tensor cores and the MXU multiply bf16 many times faster than float32) and on CPUs with
  one of BF16_FAST_CPU_FLAGS; "f32" on other CPUs, where XLA:CPU's bf16 dots are the slower ones (measured on AVX2)
  or were never measured (ARM): the float32 reference is then also the faster or the safe choice.
  """
  if backend != "cpu":
    return "bf16"
  return "bf16" if any(f in flags for f in BF16_FAST_CPU_FLAGS) else "f32"


def resolve_gemm_mode(recipe: recipes_lib.Recipe) -> str:
  """The recipe's GEMM mode, with "auto" resolved for this machine (`auto_gemm_mode`).

  "bf16" multiplies exact products and differs from the float32 reference ("f32", which rounds each decoded element
  and product) within float32 rounding: the summation order and those roundings. Pass gemm_mode="f32" for runs that
  must reproduce float32-GEMM results bit for bit on every machine (golden losses, stored results), and
  gemm_mode="bf16" to run the bf16 path on any.
  """
  if recipe.gemm_mode != "auto":
    return recipe.gemm_mode
  return auto_gemm_mode(jax.default_backend(), cpu_flags())


def unquantized_output_dtype(recipe: recipes_lib.Recipe, dtype) -> jnp.dtype:
  """The output dtype a layer asks of an unquantized recipe's GEMM of `dtype` operands.

  The output's dtype is the cotangent's in the backward, so it decides the operands of Dgrad and Wgrad: `dtype`
  (bf16 x bf16 products with float32 accumulation, as nnx.Linear(dtype=bfloat16) does) where gemm_mode resolves to
  "bf16" on an accelerator, or is "bf16"; float32 (the output cast to `dtype` after) on CPUs under "auto" and with
  "f32". On a GPU a float32 backward runs on TF32 or float32 units, which made the BF16 baseline of the train-step
  benchmarks slower than a BF16 step is. XLA:CPU ran the float32 backward faster here (0.84x), and it keeps the bits
  of the runs recorded before.
  """
  bf16 = recipe.gemm_mode == "bf16" or (recipe.gemm_mode == "auto" and jax.default_backend() != "cpu")
  return jnp.dtype(dtype) if bf16 else jnp.dtype(jnp.float32)


def scale_output(out, fa, fb):
  """(out * fa) * fb: the bf16-unit GEMM's output times both operands' factors (amax / 2688 for NVFP4).

  Two products, not out * (fa * fb): fa * fb of two tiny or huge factors may over/underflow. Where out * fa
  overflows although the result fits (a huge activation amax against a small weight amax: |y| above about
  FLT_MAX * amax_w / 2688), the factors are applied the other way round; everywhere else the bits are those of
  (out * fa) * fb.
  """
  t = out * fa
  return jnp.where(jnp.isinf(t) & jnp.isfinite(out), (out * fb) * fa, t * fb)


def _group_slices(unit: Unit, axis: int, k: int):
  """(values, factor) of each GROUP-element slice of `unit` along `axis`; the factor is that group's, or the
  scalar, shaped to broadcast over the slice's GEMM output once the contracted axis is dropped."""
  g_axis = group_axis(unit)
  if g_axis is not None and g_axis != axis:
    raise ValueError(f"a Unit's per-group factors must run along the contracted axis {axis}; they run along "
                     f"{g_axis} (values {unit.values.shape}).")
  for g, start in enumerate(range(0, k, GROUP)):
    values = jax.lax.slice_in_dim(unit.values, start, min(start + GROUP, k), axis=axis)
    factor = unit.factor if g_axis is None else jax.lax.index_in_dim(unit.factor, g, axis=axis, keepdims=False)
    yield values, factor


def grouped_gemm(a: Unit, b: Unit, contract):
  """a . b for Units with per-group factors along the contracted axes (NVFP4 double-block), 2-D operands.

  For each 128-element group of the contraction: the exact bfloat16 products summed in float32, times a's factor
  for that group (per row of the output) and b's (per column), added to the running float32 sum, group by group.
  A block-scaled GEMM on tensor cores applies scales per k-block the same way (DeepSeek-V3's FP8 GEMMs do so per
  1x128 block). A scalar factor (a Unit without groups) applies to every group.
  """
  ca, cb = contract
  if a.values.ndim != 2 or b.values.ndim != 2:
    raise ValueError(f"grouped_gemm multiplies 2-D operands; got {a.values.shape} and {b.values.shape}.")
  k = a.values.shape[ca]
  if b.values.shape[cb] != k:
    raise ValueError(f"contracted axes differ in length: {a.values.shape}[{ca}] and {b.values.shape}[{cb}].")
  dims = (((ca,), (cb,)), ((), ()))
  out = None
  for (av, fa), (bv, fb) in zip(_group_slices(a, ca, k), _group_slices(b, cb, k)):
    part = jax.lax.dot_general(av, bv, dims, preferred_element_type=jnp.float32)
    fa, fb = division.computed_once(fa, fb)  # quotients: not recomputed per output element off the CPU
    part = scale_output(part, fa[:, None] if jnp.ndim(fa) else fa, fb[None, :] if jnp.ndim(fb) else fb)
    out = part if out is None else out + part
  return out


def gemm(a, b, contract, recipe):
  """a . b contracting axes `contract` = (a_axis, b_axis), float32 accumulation, in the recipe's GEMM mode."""
  if recipe.backend == "pallas" and isinstance(a, QArray) and isinstance(b, QArray):
    from fp4jax import backends  # pylint: disable=g-import-not-at-top
    out = backends.pallas_gemm(a, b, contract)
    if out is not None:
      return out
  dims = (((contract[0],), (contract[1],)), ((), ()))
  if resolve_gemm_mode(recipe) == "bf16":
    av, bv = bf16_values(a), bf16_values(b)
    if av is not None and bv is not None and (group_axis(av) is not None or group_axis(bv) is not None):
      # Per-group factors: grouped GEMMs, except where XLA:CPU would widen them to float32 anyway (below); there
      # one float32 GEMM on the dequantized values was faster than a float32 GEMM per group (RESULTS.md).
      if contract[0] == av.values.ndim - 1 or jax.default_backend() != "cpu":
        return grouped_gemm(av, bv, contract)
    elif av is not None and bv is not None:
      if contract[0] != av[0].ndim - 1 and jax.default_backend() == "cpu":
        # XLA:CPU has no bf16 x bf16 -> f32 kernel for an lhs contracted on its first axis once vmap gives the rhs
        # a second free axis (Wgrad under vmap): that fails at run time ("Unsupported element type for DotThunk").
        # Unbatched, XLA:CPU widens this form to float32 itself; widening here (exact) does it in every case.
        out = jax.lax.dot_general(av[0].astype(jnp.float32), bv[0].astype(jnp.float32), dims, precision=_HIGHEST,
                                  preferred_element_type=jnp.float32)
      else:
        out = jax.lax.dot_general(av[0], bv[0], dims, preferred_element_type=jnp.float32)
      fa, fb = division.computed_once(av[1], bv[1])  # quotients: not recomputed per output element off the CPU
      return scale_output(out, fa, fb)
  return jax.lax.dot_general(f32_values(a), f32_values(b), dims, precision=_HIGHEST, preferred_element_type=jnp.float32)
