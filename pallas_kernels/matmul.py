"""FP4 GEMM kernel: packed E2M1 operands with E4M3 (NVFP4) or E8M0 (MXFP4) block scales, dequantized in-kernel.

`fp4_matmul(a, b)` computes dequantize(a) @ dequantize(b) in float32 without materialising either operand:
each K step loads packed code tiles and scale tiles, decodes code * block scale into bf16 (exact: at most 6
significant bits and within bf16's range), runs a bf16 dot with float32 accumulation, and the epilogue multiplies
by the per-tensor decode scales (amax_a / 2688) * (amax_b / 2688) (1 for MXFP4 operands). This is the Hopper
emulation of the NVFP4 GEMM; on GPUs with compute capability >= 10 and `jax.nn.scaled_matmul` present, NVFP4 x
NVFP4 GEMMs with 1x16 blocks go to the native block-scaled MMA instead (`blackwell_matmul`).

Operands (2D QArrays; `contract=(ca, cb)` names the contraction axis of each, default (1, 0) = a [M, K] @ b [K, N]):
  * 1x16 (NVFP4) / 1x32 (MXFP4) blocks must run along the contraction axis (QArray.axis == contraction axis):
    a [M, K] blocked along 1, or a [K, M] blocked along 0 (contract=(0, .)); b [K, N] blocked along 0, or
    b [N, K] blocked along 1 (contract=(., 1)).
  * 2D-blocked (16x16 / 32x32) operands may be packed along either axis, so the Fprop weight's codes serve Dgrad
    unchanged (the "exact transpose" of the spec): the element's block scale is its tile's.
  * NVFP4 and MXFP4 operands may be mixed. Padded QArrays (pad=True) are accepted; the output is cropped.
Shapes that are not multiples of the tile are zero-padded (codes and scales) in XLA before the kernel and the
output is cropped; pass `tiles` to avoid that copy. Code 0 decodes to 0 whatever its scale, so padding is exact.
NaN/inf: a non-finite amax of either operand makes the whole output NaN, like dequantize-then-matmul.

When both operands are packed along the contraction axis (Fprop, Wgrad), each K step is two dots over the even and
the odd contraction indices (low and high nibbles), so codes are never interleaved in registers; otherwise (Dgrad
with the reused 2D weight) the nibbles are joined into natural order first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fp4jax import formats
from fp4jax import nvfp4
from fp4jax.qarray import QArray
from pallas_kernels import numerics
from pallas_kernels import platform

MIN_TILE_MN, MIN_TILE_K = 16, 32


@dataclasses.dataclass(frozen=True)
class Operand:
  """Static description of one stored operand (codes [R, C/2] or [R/2, C], scales [R/br, C/bc])."""
  contract: int  # stored axis that is contracted
  pack_axis: int  # stored axis the nibbles are packed along
  block: tuple[int, int]  # (br, bc) scaling block in stored orientation
  kind: str  # "nvfp4" | "mxfp4"

  def stored_dims(self, nk: int, kk: int) -> tuple[int, int]:
    """Logical (rows, cols) of a stored tile with `nk` non-contracted and `kk` contracted elements."""
    return (kk, nk) if self.contract == 0 else (nk, kk)

  def codes_dims(self, nk: int, kk: int) -> tuple[int, int]:
    r, c = self.stored_dims(nk, kk)
    return (r // 2, c) if self.pack_axis == 0 else (r, c // 2)

  def scales_dims(self, nk: int, kk: int) -> tuple[int, int]:
    r, c = self.stored_dims(nk, kk)
    return (r // self.block[0], c // self.block[1])


def _scale_values(scale_u8, op: Operand):
  bits = scale_u8.astype(jnp.int32)
  return numerics.e4m3_value(bits) if op.kind == "nvfp4" else numerics.e8m0_value(bits)


def _expand(scale, block, shape):
  """Per-block values [R/br, C/bc] broadcast to a [R, C] tile."""
  nr, nc = scale.shape
  return jnp.broadcast_to(scale.reshape(nr, 1, nc, 1), (nr, block[0], nc, block[1])).reshape(shape)


def _decode_halves(codes_u8, scale_u8, op: Operand):
  """(even, odd) halves of a tile packed along its contraction axis, as bf16 code * block scale, stored orientation.

  Low nibbles hold the even contraction indices and high nibbles the odd ones, and a dot product does not care
  how its terms are ordered: a . b = a_even . b_even + a_odd . b_odd. So no interleaving is needed. Within a half,
  a block of 16 (or 32) contraction indices spans 8 (or 16) positions.
  """
  c = codes_u8.astype(jnp.int32)
  block = list(op.block)
  block[op.pack_axis] //= 2
  scale = _expand(_scale_values(scale_u8, op), block, c.shape)
  return tuple((numerics.e2m1_value(h) * scale).astype(jnp.bfloat16) for h in (c & 15, c >> 4))


def _decode_natural(codes_u8, scale_u8, op: Operand):
  """bf16 tile in natural element order, and its contraction axis: nibbles are joined along the packed axis.

  When the packed axis is the stored row axis the tile comes out transposed (the dot takes either orientation).
  """
  c = codes_u8.astype(jnp.int32)
  lo, hi = c & 15, c >> 4
  scale, block, contract = _scale_values(scale_u8, op), op.block, op.contract
  if op.pack_axis == 0:
    lo, hi, scale, block, contract = lo.T, hi.T, scale.T, block[::-1], 1 - contract
  r, half = lo.shape
  codes = jnp.stack([lo, hi], axis=-1).reshape(r, 2 * half)
  values = numerics.e2m1_value(codes) * _expand(scale, block, codes.shape)
  return values.astype(jnp.bfloat16), contract


def _load(ref, op: Operand, k_len: int, k_step):
  """Loads the k-th slice (length k_len along the stored contraction axis) of a full-K block ref."""
  idx = [slice(None), slice(None)]
  idx[op.contract] = pl.ds(pl.multiple_of(k_step * k_len, k_len), k_len)
  return ref[tuple(idx)]


def _dot(a, a_k, b, b_k):
  return jax.lax.dot_general(a, b, (((a_k,), (b_k,)), ((), ())), preferred_element_type=jnp.float32)


def _matmul_kernel(a_codes_ref, a_scales_ref, b_codes_ref, b_scales_ref, g_ref, out_ref, *, a: Operand, b: Operand,
                   tiles: tuple[int, int, int], k_steps: int):
  bm, bn, bk = tiles
  split_k = a.pack_axis == a.contract and b.pack_axis == b.contract

  def load(codes_ref, scales_ref, op, k):
    code_len = bk // 2 if op.pack_axis == op.contract else bk
    return _load(codes_ref, op, code_len, k), _load(scales_ref, op, bk // op.block[op.contract], k)

  def body(k, acc):
    a_tiles, b_tiles = load(a_codes_ref, a_scales_ref, a, k), load(b_codes_ref, b_scales_ref, b, k)
    if split_k:
      (a_even, a_odd), (b_even, b_odd) = _decode_halves(*a_tiles, a), _decode_halves(*b_tiles, b)
      return acc + _dot(a_even, a.contract, b_even, b.contract) + _dot(a_odd, a.contract, b_odd, b.contract)
    a_tile, a_k = _decode_natural(*a_tiles, a)
    b_tile, b_k = _decode_natural(*b_tiles, b)
    return acc + _dot(a_tile, a_k, b_tile, b_k)

  acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), jnp.float32))
  out_ref[...] = acc * g_ref[0]


def matmul_call(a_codes, a_scales, b_codes, b_scales, g, a: Operand, b: Operand, m: int, n: int, k: int,
                tiles: tuple[int, int, int], *, interpret: bool, num_warps: int | None = None, num_stages: int = 3):
  """The pallas_call on already-padded operands (m, n, k multiples of the tiles); scales as uint8 bits."""
  bm, bn, bk = tiles
  if num_warps is None:  # the in-register dequantization of two tiles needs more threads on large tiles
    num_warps = 8 if bm * bn >= 128 * 128 else 4

  def spec(op: Operand, dims, nk_tile, by_row):
    block = list(dims)
    block[1 - op.contract] = nk_tile
    if op.contract == 0:
      return pl.BlockSpec(tuple(block), (lambda i, j: (0, i)) if by_row else (lambda i, j: (0, j)))
    return pl.BlockSpec(tuple(block), (lambda i, j: (i, 0)) if by_row else (lambda i, j: (j, 0)))

  a_code_nk = a.codes_dims(bm, bk)[1 - a.contract]
  a_scale_nk = a.scales_dims(bm, bk)[1 - a.contract]
  b_code_nk = b.codes_dims(bn, bk)[1 - b.contract]
  b_scale_nk = b.scales_dims(bn, bk)[1 - b.contract]
  kernel = functools.partial(_matmul_kernel, a=a, b=b, tiles=tiles, k_steps=k // bk)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // bm, n // bn),
      in_specs=[spec(a, a_codes.shape, a_code_nk, True), spec(a, a_scales.shape, a_scale_nk, True),
                spec(b, b_codes.shape, b_code_nk, False), spec(b, b_scales.shape, b_scale_nk, False),
                pl.BlockSpec((1,), lambda i, j: (0,))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=platform.compiler_params(num_warps=num_warps, num_stages=num_stages),
      name="fp4_matmul",
  )(a_codes, a_scales, b_codes, b_scales, g)


# --- public wrapper ----------------------------------------------------------------------------------------------

def _operand(q: QArray, contract: int, name: str) -> Operand:
  if not isinstance(q, QArray):
    raise ValueError(f"fp4_matmul: {name} must be an fp4jax.QArray; got {type(q).__name__}.")
  if isinstance(q.fmt, formats.NVFP4):
    kind = "nvfp4"
  elif isinstance(q.fmt, formats.MXFP4):
    kind = "mxfp4"
  else:
    raise ValueError(f"fp4_matmul: {name} must be NVFP4 or MXFP4; got {q.fmt.name}.")
  if q.ndim != 2:
    raise ValueError(f"fp4_matmul: {name} must be 2D; got shape {q.shape} (reshape leading dims first).")
  if contract not in (0, 1):
    raise ValueError(f"fp4_matmul: contraction axis of {name} must be 0 or 1; got {contract}.")
  bs = q.fmt.block_size
  if q.block_2d:
    block = (bs, bs)
  else:
    if q.axis != contract:
      raise ValueError(f"fp4_matmul: {name} has 1D blocks along axis {q.axis} but is contracted along axis "
                       f"{contract}; 1D blocks must run along the contraction axis (quantize with axis={contract}).")
    block = (bs, 1) if contract == 0 else (1, bs)
  return Operand(contract=contract, pack_axis=q.axis, block=block, kind=kind)


def _global_scale(q: QArray):
  g = nvfp4.global_decode_scale(q.amax) if isinstance(q.fmt, formats.NVFP4) else jnp.float32(1.0)
  return jnp.where(jnp.isfinite(q.amax), g, jnp.nan)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
  return min(max(lo, 1 << max(n - 1, 0).bit_length()), hi)


def default_tiles(m: int, n: int, k: int, interpret: bool) -> tuple[int, int, int]:
  """(BM, BN, BK): powers of two; compiled: 128x128x64 for large GEMMs, narrower N tiles for skinny M."""
  if interpret:  # few grid steps: each costs ~1 ms of Python
    return _pow2_at_least(m, MIN_TILE_MN, 512), _pow2_at_least(n, MIN_TILE_MN, 512), _pow2_at_least(k, MIN_TILE_K, 512)
  bm = _pow2_at_least(m, MIN_TILE_MN, 128)
  bn = 64 if bm <= 64 else 128
  return bm, _pow2_at_least(n, MIN_TILE_MN, bn), _pow2_at_least(k, MIN_TILE_K, 64)


def _pad_operand(q: QArray, op: Operand, nk_to: int, k_to: int):
  """Zero-pads codes and scale bits so the operand is nk_to x k_to (logical, non-contracted x contracted)."""
  rows, cols = op.stored_dims(nk_to, k_to)
  code_dims = (rows // 2, cols) if op.pack_axis == 0 else (rows, cols // 2)
  scale_dims = (rows // op.block[0], cols // op.block[1])
  bits = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)

  def pad(x, dims):
    widths = [(0, d - s) for s, d in zip(x.shape, dims)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x

  return pad(q.codes, code_dims), pad(bits, scale_dims)


def fp4_matmul(a: QArray, b: QArray, *, contract: tuple[int, int] = (1, 0), interpret: bool | None = None,
               tiles: tuple[int, int, int] | None = None, use_blackwell: bool | None = None) -> jax.Array:
  """float32 dequantize(a) @ dequantize(b) (contracting a's axis contract[0] with b's contract[1]) -> [M, N].

  Args:
    a, b: 2D NVFP4 or MXFP4 QArrays (see the module docstring for the accepted layouts).
    contract: contraction axis of a and of b; (1, 0): a [M, K] @ b [K, N]; (1, 1): b given as [N, K].
    interpret: None = interpret mode on CPU, compiled on GPU (RuntimeError if the GPU cannot run the kernels).
    tiles: (BM, BN, BK) powers of two (BM, BN >= 16, BK >= 32 and a multiple of the block sizes); None picks.
    use_blackwell: None = native block-scaled MMA (jax.nn.scaled_matmul) when the GPU has compute capability
      >= 10 and both operands are NVFP4 with 1D blocks; False = always the Pallas kernel.
  """
  op_a, op_b = _operand(a, contract[0], "a"), _operand(b, contract[1], "b")
  m, k = a.shape[1 - op_a.contract], a.shape[op_a.contract]
  n, k_b = b.shape[1 - op_b.contract], b.shape[op_b.contract]
  if k != k_b:
    raise ValueError(f"fp4_matmul: contraction lengths differ: a {a.shape} axis {op_a.contract} vs "
                     f"b {b.shape} axis {op_b.contract}.")
  m_out, n_out = a.orig_shape[1 - op_a.contract], b.orig_shape[1 - op_b.contract]
  if a.orig_shape[op_a.contract] != b.orig_shape[op_b.contract]:
    raise ValueError(f"fp4_matmul: unpadded contraction lengths differ: {a.orig_shape} vs {b.orig_shape}.")
  interpret = platform.resolve_interpret(interpret)
  g = jnp.reshape(_global_scale(a) * _global_scale(b), (1,)).astype(jnp.float32)

  if use_blackwell is None:
    use_blackwell = not interpret and platform.use_blackwell_path()
  if use_blackwell and op_a.kind == op_b.kind == "nvfp4" and not a.block_2d and not b.block_2d:
    out = blackwell_matmul(a, b, op_a, op_b) * g[0]
    return out[:m_out, :n_out]

  bm, bn, bk = tiles or default_tiles(m, n, k, interpret)
  for t, lo, name in ((bm, MIN_TILE_MN, "BM"), (bn, MIN_TILE_MN, "BN"), (bk, MIN_TILE_K, "BK")):
    if t < lo or t & (t - 1):
      raise ValueError(f"fp4_matmul: tile {name}={t} must be a power of two >= {lo}.")
  for op, q in ((op_a, a), (op_b, b)):
    if bk % op.block[op.contract] or (q.block_2d and (bm if op is op_a else bn) % q.fmt.block_size):
      raise ValueError(f"fp4_matmul: tiles {(bm, bn, bk)} must be multiples of the {q.fmt.name} block size "
                       f"{q.fmt.block_size} along blocked axes.")
  mp, np_, kp = -(-m // bm) * bm, -(-n // bn) * bn, -(-k // bk) * bk
  a_codes, a_scales = _pad_operand(a, op_a, mp, kp)
  b_codes, b_scales = _pad_operand(b, op_b, np_, kp)
  out = matmul_call(a_codes, a_scales, b_codes, b_scales, g, op_a, op_b, mp, np_, kp, (bm, bn, bk),
                    interpret=interpret)
  return out[:m_out, :n_out]


def blackwell_operand(q: QArray, op: Operand):
  """([1, rows, K] float4_e2m1fn values, [1, rows, K/16] E4M3 scales) for jax.nn.scaled_matmul (exact repack)."""
  from fp4jax import grids  # pylint: disable=g-import-not-at-top
  values = grids.e2m1_decode(q.unpacked_codes())  # E2M1 values as float32: exact in float4_e2m1fn
  scales = q.scales
  if op.contract == 0:  # scaled_matmul contracts the last axis
    values, scales = values.T, scales.T
  return values.astype(jnp.float4_e2m1fn)[None], scales[None]


def blackwell_matmul(a: QArray, b: QArray, op_a: Operand, op_b: Operand) -> jax.Array:
  """NVFP4 x NVFP4 (1D blocks) through jax.nn.scaled_matmul: cuDNN's block-scaled FP4 MMA on compute capability
  >= 10. Returns the product before the per-tensor scales. Lowers on any machine; runs only on such GPUs."""
  lhs, lhs_scales = blackwell_operand(a, op_a)
  rhs, rhs_scales = blackwell_operand(b, op_b)
  return jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32)[0]
