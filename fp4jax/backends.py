"""Kernel backends for the quantized GEMMs. fp4jax reaches `pallas_kernels` only here, imported lazily, when a
recipe says `backend="pallas"`; anything the kernels do not cover runs on the XLA path after one warning.

GEMM dispatch. On a GPU the fused Pallas FP4 GEMM wins where the GEMM is memory-bound (few tokens: it streams the
packed weight, 0.5625 B/element) and loses where it is compute-bound (its in-register decode is ALU work beside
the tensor cores), where decoding once and running a bf16 GEMM on the XLA path is faster. Which shapes go where is
a measurement, kept as data: `GEMM_ROUTES`, filled from `benchmarks/gpu.sh` (its `gemm` section prints the rows).
Until a GPU run fills it the table is empty and every covered GEMM of a `backend="pallas"` recipe runs on Pallas.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax

from fp4jax import formats


@dataclasses.dataclass(frozen=True)
class GemmRoute:
  """One measured dispatch rule: on devices whose kind starts with `device_kind`, a GEMM whose smallest dimension
  (min of M, N, K) is at most `max_min_dim` runs on `backend`. Rows are tried in order; the first match wins."""
  device_kind: str  # e.g. "NVIDIA H200"
  max_min_dim: int
  backend: str  # "pallas" or "xla"
  source: str  # the run that measured it (benchmark, date, jax version)

  def __post_init__(self):
    if self.backend not in ("pallas", "xla"):
      raise ValueError(f"GemmRoute.backend must be 'pallas' or 'xla'; got {self.backend!r}.")
    if self.max_min_dim < 1:
      raise ValueError(f"GemmRoute.max_min_dim must be >= 1; got {self.max_min_dim}.")


# Empty. The first H200 run (benchmarks/RESULTS.md, 2026-12-04) proposed Pallas up to min(M,N,K) = 128 and xla above;
# not installed until the Pallas backend's training step matches the xla path's there.
GEMM_ROUTES: tuple[GemmRoute, ...] = ()


def choose_gemm_backend(m: int, n: int, k: int, device_kind: str, routes=None) -> str:
  """'pallas' or 'xla' for an [M, K] x [K, N] FP4 GEMM on `device_kind` by `routes` (default GEMM_ROUTES);
  'pallas' when no row matches (the recipe asked for it)."""
  smallest = min(m, n, k)
  for route in GEMM_ROUTES if routes is None else routes:
    if device_kind.startswith(route.device_kind) and smallest <= route.max_min_dim:
      return route.backend
  return "pallas"


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


def _in_shard_map() -> bool:
  """Whether this is traced inside jax.shard_map (some mesh axis is Manual)."""
  return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


_SHARD_MAP = ("inside jax.shard_map, whose manual mesh axes the kernels do not declare their outputs' variation "
              "over")


def pallas_quantize(x, cfg, *, axis: int, recipe, key, signs, with_mask: bool = False):
  """The fused Pallas NVFP4 quantizer (with the RHT fused in), or None if not covered."""
  if _in_shard_map():
    _fallback(_SHARD_MAP)
    return None
  if not isinstance(cfg.fmt, formats.NVFP4):
    _fallback(f"the quantize kernel is NVFP4-only (got {cfg.fmt.name})")
    return None
  rules = _kernels().quantize.SUPPORTED_SCALE_RULES
  if cfg.fmt.scale_rule not in rules:
    _fallback(f"the quantize kernel has the scale rules {rules} only (got {cfg.fmt.label})")
    return None
  if cfg.fmt.scale_rule in ("4over6", "eden") and cfg.fmt.double_block:
    _fallback(f"the quantize kernel's 4/6 and MS-EDEN take one tensor amax, not double-block scales (got "
              f"{cfg.fmt.label})")
    return None
  if cfg.fmt.scale_rule == "eden" and cfg.rounding == "stochastic" and recipe.sr_bits != "hash":
    _fallback(f"the quantize kernel rounds MS-EDEN's scales on the hash generator's bits only (got sr_bits="
              f"{recipe.sr_bits!r})")
    return None
  if with_mask:
    _fallback("the quantize kernel returns no clip mask (clip_mask=True: QuEST's masked straight-through gradient)")
    return None
  return _kernels().quantize_nvfp4(x, axis=axis, block_2d=cfg.block_2d, rounding=cfg.rounding,
                                   key=key if cfg.rounding == "stochastic" else None,  # a key is for SR only
                                   rht_size=recipe.rht_size if cfg.rht else None, rht_signs=signs,
                                   random_bits=recipe.random_bits, pad=cfg.pad, sr_bits=recipe.sr_bits,
                                   fmt=cfg.fmt)


def gemm_dims(a, b, contract) -> tuple[int, int, int]:
  """(M, N, K) of a . b contracting a's axis contract[0] with b's contract[1] (2D operands)."""
  return a.shape[1 - contract[0]], b.shape[1 - contract[1]], a.shape[contract[0]]


def pallas_gemm(a, b, contract, *, routes=None):
  """float32 product of two 2D FP4 QArrays on the Pallas GEMM kernel, or None if not covered or if the measured
  dispatch table (`routes`, default GEMM_ROUTES) sends this shape on this GPU to the XLA path."""
  if not (a.fmt.is_fp4 and b.fmt.is_fp4) or a.ndim != 2 or b.ndim != 2:
    _fallback("the GEMM kernel takes 2D NVFP4/MXFP4 operands")
    return None
  if _in_shard_map():
    _fallback(_SHARD_MAP)
    return None
  if jax.default_backend() == "gpu":
    if choose_gemm_backend(*gemm_dims(a, b, contract), jax.devices()[0].device_kind, routes) == "xla":
      return None  # a measured choice, not a gap: no warning
  return _kernels().fp4_matmul(a, b, contract=contract)
