"""FP4 GEMM kernel: packed E2M1 operands with E4M3 (NVFP4) or E8M0 (MXFP4) block scales, decoded in-kernel.

`fp4_matmul(a, b)` computes dequantize(a) @ dequantize(b) in float32 without materialising either operand. Each
program owns one (BM, BN) output tile and one K split; per K step it loads the packed code and scale tiles of
both operands, decodes each tile once into bf16 (code * block scale: exact, at most 6 significant bits) and runs a
bf16 dot with float32 accumulation, so every decoded element feeds BN (or BM) outputs. The epilogue multiplies by
the per-tensor decode scales amax_a / 2688 and amax_b / 2688 (1 for MXFP4 operands; amax / R with the format's
own range R for NVFP4's 4/6, 16/17 and MS-EDEN rules, 4/3 for MXFP4's Tseng rule) one at a time, as the XLA path's
gemm.scale_output does, so two tiny or huge amaxes do not under- or overflow their product. This is the Hopper
emulation of the FP4 GEMM; on GPUs with compute capability >= 10 and `jax.nn.scaled_matmul` present, NVFP4 x
NVFP4 GEMMs with 1x16 blocks go to the native block-scaled MMA instead (`blackwell_matmul`).

Cost model (estimates until the GPU run measures them). The decode is bit placement (numerics.e2m1_scaled: 5
integer ops, a half -> float conversion, one multiply by the block scale, a bf16 conversion), ~9 ALU ops per element
against ~22 for a compare-chain decode. A program decodes (BM + BN) * BK elements per BM * BN * BK multiply-adds:
9/64 ~ 0.14 ALU ops per MAC at 128x128 tiles, 0.105 at 128x256. An H100/H200 SM retires ~2048 bf16 MACs per clock
on its tensor cores but 128 float32 (64 int32) ALU ops, ~0.06 per MAC, so a fused decode stays ALU-bound at roughly
0.4-0.6x bf16 on compute-bound shapes however it is tiled; there, decoding each operand once (a memory-bound pass)
and running a bf16 GEMM is the better plan, and fp4jax.backends dispatches between the two by a measured table.
Skinny GEMMs (small M) are memory-bound: the kernel streams 0.5625 B/element of the packed weight against 2 B for a
bf16 GEMM (4.5 for decode-then-GEMM), and split-K (grid axis 3) keeps every SM loading: that is where it wins.

Operands (2D QArrays; `contract=(ca, cb)` names the contraction axis of each, default (1, 0) = a [M, K] @ b [K, N]):
  * 1x16 (NVFP4) / 1x32 (MXFP4) blocks must run along the contraction axis (QArray.axis == contraction axis):
    a [M, K] blocked along 1, or a [K, M] blocked along 0 (contract=(0, .)); b [K, N] blocked along 0, or
    b [N, K] blocked along 1 (contract=(., 1)).
  * 2D-blocked (16x16 / 32x32) operands may be packed along either axis, so the Fprop weight's codes serve Dgrad
    unchanged (the "exact transpose" of the paper): the element's block scale is its tile's.
  * NVFP4 and MXFP4 operands may be mixed. Padded QArrays (pad=True) are accepted; the output is cropped.
Shapes that are not multiples of the tile (or of BK * split_k along K) are zero-padded (codes and scales) in XLA
before the kernel and the output is cropped; code 0 decodes to 0 whatever its scale, so padding is exact.
NaN/inf: a non-finite amax of either operand makes the whole output NaN, like dequantize-then-matmul.

NVFP4 double-block operands (TetraJet-v2: one FP32 scale per 1x128 group of the contraction, `NVFP4(double_block=
True)`) have no per-tensor factor for the epilogue. With either operand so scaled, each K step covers exactly one
group (BK = 128): its float32 partial product is multiplied by a's group factor (one per output row) and b's (one
per output column), one at a time as gemm.scale_output does, and added to the accumulator. That is what the XLA
path's gemm.grouped_gemm computes with one GEMM per group, and what block-scaled FP8 GEMMs do per k-block
(DeepSeek-V3's 1x128 scales); here it is one kernel. An operand without groups gets its tensor factor per step.

When both operands are packed along the contraction axis (Fprop, Wgrad), each K step is two dots over the even and
the odd contraction indices (low and high nibbles), so codes are never interleaved in registers; otherwise (Dgrad
with the reused 2D weight) the nibbles are joined into natural order first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from fp4jax import formats
from fp4jax import gemm as gemm_lib
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
  grouped: bool = False  # NVFP4 double-block: one FP32 decode factor per 1x128 group of the contraction

  def stored_dims(self, nk: int, kk: int) -> tuple[int, int]:
    """Logical (rows, cols) of a stored tile with `nk` non-contracted and `kk` contracted elements."""
    return (kk, nk) if self.contract == 0 else (nk, kk)

  def codes_dims(self, nk: int, kk: int) -> tuple[int, int]:
    """Shape of a stored tile's codes (as stored_dims, two per byte along pack_axis)."""
    r, c = self.stored_dims(nk, kk)
    return (r // 2, c) if self.pack_axis == 0 else (r, c // 2)

  def scales_dims(self, nk: int, kk: int) -> tuple[int, int]:
    """Shape of a stored tile's block scales (as stored_dims, one per block)."""
    r, c = self.stored_dims(nk, kk)
    return (r // self.block[0], c // self.block[1])

  def factors_dims(self, nk: int, kk: int) -> tuple[int, int]:
    """Per-group decode factors (one per GROUP contraction elements) of a stored tile."""
    return self.stored_dims(nk, kk // gemm_lib.GROUP)


def _scale_values(scale_u8, op: Operand):
  """Block scales as float32; NVFP4's carry the E2M1 half-decode gain 2^14 (E4M3 * 2^14 cannot overflow)."""
  bits = scale_u8.astype(jnp.int32)
  if op.kind == "nvfp4":
    return numerics.e4m3_value(bits) * numerics.E2M1_HALF_GAIN
  return numerics.e8m0_value(bits)


def _decode(nibbles, scale, op: Operand):
  """bf16 code * block scale (exact: at most 6 significant bits), decoded by bit placement (numerics.e2m1_scaled)."""
  return numerics.e2m1_scaled(nibbles, scale, gain_in_scale=op.kind == "nvfp4").astype(jnp.bfloat16)


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
  return _decode(c, scale, op), _decode(c >> 4, scale, op)  # e2m1_half_bits reads the low nibble only


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
  return _decode(codes, _expand(scale, block, codes.shape), op), contract


def _load(ref, op: Operand, k_len: int, k_step):
  """Loads the k-th slice (length k_len along the stored contraction axis) of a K-block ref."""
  idx = [slice(None), slice(None)]
  idx[op.contract] = pl.ds(pl.multiple_of(k_step * k_len, k_len), k_len)
  return ref[tuple(idx)]


def _dot(a, a_k, b, b_k):
  return jax.lax.dot_general(a, b, (((a_k,), (b_k,)), ((), ())), preferred_element_type=jnp.float32)


def _group_factor(factor_ref, op: Operand, k_step, out_axis: int):
  """The k-th group's decode factors of one operand tile, shaped to broadcast over the output tile: [BM, 1] for a
  (out_axis 0, one per output row), [1, BN] for b (out_axis 1, one per output column)."""
  f = _load(factor_ref, op, 1, k_step)  # [n, 1] when the stored contraction axis is 1, else [1, n]
  return f if (1 - op.contract) == out_axis else f.T


def _matmul_kernel(*refs, a: Operand, b: Operand, tiles: tuple[int, int, int], k_steps: int, grouped: bool):
  """One (BM, BN) output tile over one split's K range: per K step each operand tile is decoded once, then dotted.

  grouped: a K step is one 1x128 group; its partial product gets both operands' group factors before it is summed.
  Otherwise the per-tensor factors (g_ref) scale the sum once, in the epilogue."""
  a_codes_ref, a_scales_ref, b_codes_ref, b_scales_ref, *factor_refs, out_ref = refs
  bm, bn, bk = tiles
  halves = a.pack_axis == a.contract and b.pack_axis == b.contract

  def load(codes_ref, scales_ref, op, k):
    code_len = bk // 2 if op.pack_axis == op.contract else bk
    return _load(codes_ref, op, code_len, k), _load(scales_ref, op, bk // op.block[op.contract], k)

  def product(k):
    a_tiles, b_tiles = load(a_codes_ref, a_scales_ref, a, k), load(b_codes_ref, b_scales_ref, b, k)
    if halves:
      (a_even, a_odd), (b_even, b_odd) = _decode_halves(*a_tiles, a), _decode_halves(*b_tiles, b)
      return _dot(a_even, a.contract, b_even, b.contract), _dot(a_odd, a.contract, b_odd, b.contract)
    a_tile, a_k = _decode_natural(*a_tiles, a)
    b_tile, b_k = _decode_natural(*b_tiles, b)
    return (_dot(a_tile, a_k, b_tile, b_k),)

  def body(k, acc):
    parts = product(k)
    if not grouped:
      for part in parts:
        acc = acc + part
      return acc
    a_factor_ref, b_factor_ref = factor_refs
    part = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    fa, fb = _group_factor(a_factor_ref, a, k, 0), _group_factor(b_factor_ref, b, k, 1)
    return acc + gemm_lib.scale_output(part, fa, fb)

  acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), jnp.float32))
  if grouped:
    out_ref[...] = acc
  else:
    (g_ref,) = factor_refs
    out_ref[...] = gemm_lib.scale_output(acc, g_ref[0], g_ref[1])


def matmul_call(a_codes, a_scales, b_codes, b_scales, g, a: Operand, b: Operand, m: int, n: int, k: int,
                tiles: tuple[int, int, int], *, split_k: int = 1, interpret: bool, num_warps: int | None = None,
                num_stages: int = 3):
  """The pallas_call on already-padded operands (m, n multiples of BM, BN; k of BK * split_k); scales as uint8;
  g: float32 [2], the two per-tensor decode factors; or, if either operand is grouped (then BK = GROUP), a pair
  (a's, b's) of float32 per-group factors in stored orientation (Operand.factors_dims of the whole operand).

  Grid (M/BM, N/BN, split_k): split s sums K range [s K/split_k, (s+1) K/split_k) into out[s]; the splits are
  added in XLA (float32). Splitting K gives skinny (small-M) GEMMs enough programs to keep every SM loading.
  """
  bm, bn, bk = tiles
  kc = k // split_k
  if num_warps is None:  # the in-register decode of two tiles needs more threads on large tiles
    num_warps = 8 if bm * bn >= 128 * 128 else 4

  def spec(op: Operand, block, by_row):
    """block: one program's (non-contracted tile x one split's K) slab of codes or scales, stored orientation."""
    nk = (lambda i, j: i) if by_row else (lambda i, j: j)
    if op.contract == 0:
      return pl.BlockSpec(block, lambda i, j, s: (s, nk(i, j)))
    return pl.BlockSpec(block, lambda i, j, s: (nk(i, j), s))

  grouped = a.grouped or b.grouped
  if grouped:  # fp4_matmul has checked BK = GROUP
    factor_specs, factors = [spec(a, a.factors_dims(bm, kc), True), spec(b, b.factors_dims(bn, kc), False)], g
  else:
    factor_specs, factors = [pl.BlockSpec((2,), lambda i, j, s: (0,))], (g,)
  kernel = functools.partial(_matmul_kernel, a=a, b=b, tiles=tiles, k_steps=kc // bk, grouped=grouped)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((split_k, m, n), jnp.float32),
      grid=(m // bm, n // bn, split_k),
      in_specs=[spec(a, a.codes_dims(bm, kc), True), spec(a, a.scales_dims(bm, kc), True),
                spec(b, b.codes_dims(bn, kc), False), spec(b, b.scales_dims(bn, kc), False), *factor_specs],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
      interpret=interpret,
      compiler_params=platform.compiler_params(num_warps=num_warps, num_stages=num_stages),
      name="fp4_matmul",
  )(a_codes, a_scales, b_codes, b_scales, *factors)
  return out[0] if split_k == 1 else jnp.sum(out, axis=0)


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
  return Operand(contract=contract, pack_axis=q.axis, block=block, kind=kind,
                 grouped=bool(getattr(q.fmt, "double_block", False)))


def _global_scale(q: QArray):
  """The operand's decode factor after code x block scale: amax / R for NVFP4 (R = 2688 for NVIDIA's rule, the
  format's `global_range` for 4/6, 16/17 headroom and MS-EDEN; with double_block one per 1x128 group, stored
  orientation), MXFP4's tensor factor (4/3 for Tseng's rule, else 1). A non-finite amax anywhere makes it all NaN,
  as dequantize poisons the whole tensor."""
  if isinstance(q.fmt, formats.NVFP4):
    g = nvfp4.global_decode_scale(q.amax, q.fmt.global_range)
  else:
    g = jnp.float32(q.fmt.tensor_factor)
  return jnp.where(jnp.all(jnp.isfinite(q.amax)), g, jnp.nan)


def _group_factors(q: QArray, op: Operand, nk_to: int, k_to: int):
  """float32 decode factors per 1x128 group, stored orientation, for an nk_to x k_to (padded) operand: the group
  amaxes' for a double-block operand, its tensor factor repeated otherwise. Padded groups get 1 (their codes are 0)."""
  dims = op.factors_dims(nk_to, k_to)
  f = _global_scale(q).astype(jnp.float32)
  if not op.grouped:
    return jnp.broadcast_to(f, dims)
  return jnp.pad(f, [(0, d - s) for s, d in zip(f.shape, dims)], constant_values=1.0)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
  return min(max(lo, 1 << max(n - 1, 0).bit_length()), hi)


def default_tiles(m: int, n: int, k: int, interpret: bool) -> tuple[int, int, int]:
  """(BM, BN, BK), powers of two. Interpret mode: few, large tiles (~1 ms of Python per grid step). Compiled:
  128x128 output tiles with BK=128 (each decoded operand tile feeds 128 outputs per element; a long K step
  amortises the loop); skinny M (memory-bound): BM=M, BN=64 and BK=256 so each program streams long B slabs.
  Starting points only: benchmarks/gpu/gemm.py times the variants on the GPU."""
  if interpret:
    return _pow2_at_least(m, MIN_TILE_MN, 512), _pow2_at_least(n, MIN_TILE_MN, 512), _pow2_at_least(k, MIN_TILE_K, 512)
  bm = _pow2_at_least(m, MIN_TILE_MN, 128)
  if bm <= 32:
    return bm, _pow2_at_least(n, MIN_TILE_MN, 64), _pow2_at_least(k, MIN_TILE_K, 256)
  return bm, _pow2_at_least(n, MIN_TILE_MN, 128), _pow2_at_least(k, MIN_TILE_K, 128)


def default_split_k(m: int, n: int, k: int, tiles: tuple[int, int, int], interpret: bool,
                    cores: int | None = None) -> int:
  """Splits of K (a power of two) so a GEMM with few output tiles still gives every SM work: double while the
  programs stay under two per SM, each split keeps >= 2 K steps, and no K padding is added. 1 in interpret mode."""
  if interpret:
    return 1
  cores = cores or platform.core_count()
  bm, bn, bk = tiles
  programs = -(-m // bm) * -(-n // bn)
  k_steps = -(-k // bk)
  split = 1
  while programs * split * 2 <= 2 * cores and k_steps % (split * 2) == 0 and k_steps // (split * 2) >= 2:
    split *= 2
  return split


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
               tiles: tuple[int, int, int] | None = None, split_k: int | None = None,
               use_blackwell: bool | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> jax.Array:
  """float32 dequantize(a) @ dequantize(b) (contracting a's axis contract[0] with b's contract[1]) -> [M, N].

  Args:
    a, b: 2D NVFP4 or MXFP4 QArrays (see the module docstring for the accepted layouts).
    contract: contraction axis of a and of b; (1, 0): a [M, K] @ b [K, N]; (1, 1): b given as [N, K].
    interpret: None = interpret mode on CPU, compiled on GPU (RuntimeError if the GPU cannot run the kernels).
    tiles: (BM, BN, BK) powers of two (BM, BN >= 16, BK >= 32 and a multiple of the block sizes; BK = 128 with a
      double-block operand); None picks.
    split_k: number of K splits (any int >= 1; partial products summed in float32); None picks (a power of two;
      1 in interpret mode).
    num_warps, num_stages: Triton launch parameters; None picks (8 warps on >= 128x128 tiles, 3 stages).
    use_blackwell: None = native block-scaled MMA (jax.nn.scaled_matmul) when the GPU has compute capability
      >= 10 and both operands are NVFP4 with 1D blocks and no 1x128 group scales; False = always the Pallas kernel.
  """
  if not (isinstance(contract, (tuple, list)) and len(contract) == 2):
    raise ValueError(f"fp4_matmul: contract is (a's contraction axis, b's), e.g. (1, 0); got {contract!r}.")
  op_a, op_b = _operand(a, contract[0], "a"), _operand(b, contract[1], "b")
  m, k = a.shape[1 - op_a.contract], a.shape[op_a.contract]
  n, k_b = b.shape[1 - op_b.contract], b.shape[op_b.contract]
  if a.orig_shape[op_a.contract] != b.orig_shape[op_b.contract]:
    raise ValueError(f"fp4_matmul: contraction lengths differ: a {a.orig_shape} axis {op_a.contract} vs "
                     f"b {b.orig_shape} axis {op_b.contract}.")
  k = max(k, k_b)  # operands padded to different block multiples (pad=True): both are zero-padded to one K
  m_out, n_out = a.orig_shape[1 - op_a.contract], b.orig_shape[1 - op_b.contract]
  interpret = platform.resolve_interpret(interpret)
  grouped = op_a.grouped or op_b.grouped

  if use_blackwell is None:
    use_blackwell = not interpret and platform.use_blackwell_path()
  if use_blackwell and op_a.kind == op_b.kind == "nvfp4" and not a.block_2d and not b.block_2d and not grouped:
    # Both factors, applied one at a time (gemm.scale_output): their product under- or overflows float32 for amaxes
    # near 1e-19 or 1e22 where the GEMM's outputs do not (all zeros or all inf/NaN before).
    out = gemm_lib.scale_output(blackwell_matmul(a, b, op_a, op_b), _global_scale(a), _global_scale(b))
    return out[:m_out, :n_out]

  if tiles is not None and not (isinstance(tiles, (tuple, list)) and len(tiles) == 3 and all(
      isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tiles)):
    raise ValueError(f"fp4_matmul: tiles must be None or (BM, BN, BK), three int powers of two; got {tiles!r}.")
  bm, bn, bk = (int(t) for t in tiles) if tiles is not None else default_tiles(m, n, k, interpret)
  if grouped and tiles is None:
    bk = gemm_lib.GROUP
  if grouped and bk != gemm_lib.GROUP:
    raise ValueError(f"fp4_matmul: double-block (1x128 group) operands need BK = {gemm_lib.GROUP}, one K step per "
                     f"group; got tiles {tiles}.")
  for t, lo, name in ((bm, MIN_TILE_MN, "BM"), (bn, MIN_TILE_MN, "BN"), (bk, MIN_TILE_K, "BK")):
    if t < lo or t & (t - 1):
      raise ValueError(f"fp4_matmul: tile {name}={t} must be a power of two >= {lo}.")
  for op, q in ((op_a, a), (op_b, b)):
    if bk % op.block[op.contract] or (q.block_2d and (bm if op is op_a else bn) % q.fmt.block_size):
      raise ValueError(f"fp4_matmul: tiles {(bm, bn, bk)} must be multiples of the {q.fmt.name} block size "
                       f"{q.fmt.block_size} along blocked axes.")
  if split_k is None:
    split_k = default_split_k(m, n, k, (bm, bn, bk), interpret)
  if isinstance(split_k, bool) or not isinstance(split_k, (int, np.integer)) or split_k < 1:
    raise ValueError(f"fp4_matmul: split_k must be a positive int; got {split_k!r}.")
  split_k = int(split_k)  # a static launch parameter: a plain int also for numpy integers
  kq = bk * split_k
  mp, np_, kp = -(-m // bm) * bm, -(-n // bn) * bn, -(-k // kq) * kq
  a_codes, a_scales = _pad_operand(a, op_a, mp, kp)
  b_codes, b_scales = _pad_operand(b, op_b, np_, kp)
  # Both factors (per tensor, or per group and step), applied one at a time: see the Blackwell branch above.
  if grouped:
    g = (_group_factors(a, op_a, mp, kp), _group_factors(b, op_b, np_, kp))
  else:
    g = jnp.stack([_global_scale(a), _global_scale(b)]).astype(jnp.float32)
  out = matmul_call(a_codes, a_scales, b_codes, b_scales, g, op_a, op_b, mp, np_, kp, (bm, bn, bk),
                    split_k=split_k, interpret=interpret, num_warps=num_warps, num_stages=num_stages or 3)
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
