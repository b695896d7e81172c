"""Kernel backends for the quantized GEMMs. fp4jax reaches `pallas_kernels` only here, imported lazily, when a
recipe says `backend="pallas"`; anything the kernels do not cover runs on the XLA path after one warning.
"""

from __future__ import annotations

import functools
import warnings

from fp4jax import formats


@functools.lru_cache(maxsize=None)
def _kernels():
  try:
    import pallas_kernels  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError("recipe backend='pallas' needs the pallas_kernels package; install fp4jax from its source tree "
                     "(pip install -e .).") from e
  return pallas_kernels


@functools.lru_cache(maxsize=None)
def _fallback(reason: str) -> None:
  warnings.warn(f"fp4jax backend='pallas': {reason}; using the XLA path for it.", stacklevel=3)


def pallas_quantize(x, cfg, *, axis: int, recipe, key, signs):
  """The fused Pallas NVFP4 quantizer (with the RHT fused in), or None if not covered."""
  if not isinstance(cfg.fmt, formats.NVFP4):
    _fallback(f"the quantize kernel is NVFP4-only (got {cfg.fmt.name})")
    return None
  if not cfg.fmt.is_default:
    _fallback(f"the quantize kernel has NVIDIA's scale rules only (got {cfg.fmt.label})")
    return None
  return _kernels().quantize_nvfp4(x, axis=axis, block_2d=cfg.block_2d, rounding=cfg.rounding, key=key,
                                   rht_size=recipe.rht_size if cfg.rht else None, rht_signs=signs,
                                   random_bits=recipe.random_bits, pad=cfg.pad)


def pallas_gemm(a, b, contract):
  """float32 product of two 2D FP4 QArrays on the Pallas GEMM kernel, or None if not covered."""
  if not (a.fmt.is_fp4 and b.fmt.is_fp4) or a.ndim != 2 or b.ndim != 2:
    _fallback("the GEMM kernel takes 2D NVFP4/MXFP4 operands")
    return None
  if not all(getattr(q.fmt, "is_default", True) for q in (a, b)):
    # The kernel decodes NVFP4 with NVIDIA's tensor scale amax / 2688; other scale rules decode differently.
    _fallback("the GEMM kernel decodes NVIDIA's NVFP4 scales only")
    return None
  return _kernels().fp4_matmul(a, b, contract=contract)
