"""Plain NumPy float64 references for the NVFP4 variants of other recipes, written from their papers.

Four Over Six (arXiv 2512.02010): each 16-block is quantized with its max mapped to 6 and to 4, under a tensor scale
6 * 256 / amax, and keeps the candidate with the smaller error. Unbiased stochastic rounding: the block scale rounded
up (no element saturates), or elements encoded at 16/17 of their scale ("headroom").

As in reference.py, every float32 operation is computed in float64 and rounded with `f32` right after, which equals
IEEE float32 arithmetic for + - * /. Block errors are summed in the order fp4jax documents (pairwise halving over the
block's elements in row-major order), each partial sum rounded to float32.
"""

import numpy as np

import reference as ref

f32 = ref.f32


def e4m3_values():
  """All non-negative finite float8_e4m3fn values, ascending (0, subnormals k * 2^-9, normals up to 448)."""
  vals = [k * 2.0**-9 for k in range(8)]
  for e in range(-6, 9):
    for m in range(8):
      v = (1 + m / 8) * 2.0**e
      if v <= 448:
        vals.append(v)
  return np.array(sorted(set(vals)))


_E4M3 = e4m3_values()


def e4m3_up(v, slack=2.0**-21):
  """Smallest E4M3 value r with r * (1 + slack) >= v (v >= 0), 448 beyond 448; NaN stays NaN.

  The slack (4 float32 ulps) is the round-up rule's: a scale product a few roundings above an E4M3 value keeps it.
  """
  v = np.asarray(v, np.float64) / (1.0 + slack)
  safe = np.where(np.isnan(v), 0.0, v)
  idx = np.minimum(np.searchsorted(_E4M3, safe, side="left"), len(_E4M3) - 1)
  return np.where(np.isnan(v), np.nan, _E4M3[idx])


def blocks_last(a, block, axis, block_2d):
  """[..., blocks, B]: each block's elements on the last axis (row major inside a 2D tile)."""
  if block_2d:
    *lead, r, c = a.shape
    t = a.reshape(*lead, r // block, block, c // block, block)
    t = np.moveaxis(t, -3, -2)  # [..., R/b, C/b, b(row), b(col)]
    return t.reshape(*t.shape[:-2], block * block)
  t = np.moveaxis(a, axis, -1)
  return t.reshape(*t.shape[:-1], t.shape[-1] // block, block)  # block index just before the last axis


def _unblock_1d(s, axis):
  """[..., n/b] per-block values (block index last) -> the scales' layout (block index at `axis`)."""
  return np.moveaxis(s, -1, axis)


def pairwise(t, op):
  """Reduce the last axis by halving, rounding every partial result to float32."""
  while t.shape[-1] > 1:
    h = t.shape[-1] // 2
    t = f32(op(t[..., :h], t[..., h:]))
  return t[..., 0]


def block_error(err, block, axis, block_2d, metric):
  t = blocks_last(err, block, axis, block_2d)
  if metric == "mse":
    e = pairwise(f32(t * t), np.add)
  elif metric == "mae":
    e = pairwise(np.abs(t), np.add)
  else:
    e = pairwise(np.abs(t), np.maximum)
  return e if block_2d else _unblock_1d(e, axis)


def group_amax(amax_b, axis, group=8):
  """Max over each run of `group` blocks along `axis` (the last run may be shorter), repeated back per block."""
  a = np.moveaxis(amax_b, axis, -1)
  n = a.shape[-1]
  out = np.empty_like(a)
  for start in range(0, n, group):
    out[..., start:start + group] = np.max(a[..., start:start + group], axis=-1, keepdims=True)
  return np.moveaxis(out, -1, axis)


def nvfp4_variant(x, *, axis=-1, block_2d=False, four_over_six=False, select="mse", round_up=False,
                  headroom=False, double_block=False, block=16):
  """NVFP4 quantization with the variant rules (round-to-nearest elements). Returns a dict.

  Keys: codes (uint8, x's shape), scales (chosen E4M3 block scales), amax, dequant (float32 values),
  choice (0 = max -> 6, 1 = max -> 4, per block), scaled (the chosen candidate's x * enc_b).
  """
  x = ref.as_f64(x)
  axis = axis % x.ndim
  h = 16.0 / 17.0 if headroom else 1.0
  bound = 256.0 if four_over_six else 448.0
  g_range = f32(6.0 * bound * h)
  targets = (6.0 * h, 4.0 * h) if four_over_six else (6.0 * h,)
  with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
    amax_b = ref.block_amax(np.abs(x), block, axis, block_2d)
    # The second-level amax: the tensor's, or (double block) each 1x128 group's, per block.
    amax = group_amax(amax_b, axis) if double_block else np.full(amax_b.shape, np.max(np.abs(x)))
    s_enc = np.where(amax == 0, 1.0, f32(np.minimum(g_range / amax, ref.FLT_MAX)))
    s_enc = np.where(s_enc == 0, 1.0, s_enc)
    s_dec = f32(1.0 / s_enc)
    t_dec = ref.expand(f32(amax / g_range), block, axis, block_2d)
    cands = []
    for t in targets:
      v = f32(amax_b * f32(s_enc * f32(1.0 / t)))
      s_b = e4m3_up(v) if round_up else ref.e4m3_rne(v)
      enc = np.minimum(f32(1.0 / f32(s_b * s_dec)), ref.FLT_MAX)
      scaled = f32(x * ref.expand(enc, block, axis, block_2d))
      codes = ref.e2m1_rne(scaled)
      deq = f32(f32(ref.e2m1_value(codes) * ref.expand(s_b, block, axis, block_2d)) * t_dec)
      err = block_error(f32(deq - x), block, axis, block_2d, select)
      cands.append((codes, s_b, deq, err, scaled))
  choice = np.zeros(cands[0][1].shape, np.int64)
  if four_over_six:
    choice = (cands[1][3] < cands[0][3]).astype(np.int64)  # strictly better; ties and NaN keep "6"
  wide = ref.expand(choice, block, axis, block_2d).astype(bool)
  pick = lambda i: np.where(wide, cands[1][i], cands[0][i]) if four_over_six else cands[0][i]
  deq = pick(2)
  if not np.all(np.isfinite(amax)):
    deq = np.full_like(deq, np.nan)
  return {"codes": pick(0), "scales": np.where(choice == 1, cands[1][1], cands[0][1]) if four_over_six else cands[0][1],
          "amax": amax if double_block else float(amax.flat[0]), "dequant": deq, "choice": choice, "scaled": pick(4),
          "candidate_scales": [c[1] for c in cands], "candidate_scaled": [c[4] for c in cands]}


EDEN_ELEM_MAX = 6.0 / ((17.0 / 16.0) * 0.93)


def nvfp4_eden(x, *, axis=-1, block=16, group=8):
  """Quartet II's MS-EDEN quantizer with the corrected scales rounded to nearest E4M3 (the deterministic part).

  Returns codes, scales (corrected, E4M3), dequant, and pre_round (the corrected float32 scales before rounding).
  """
  x = ref.as_f64(x)
  axis = axis % x.ndim
  g_range = f32(EDEN_ELEM_MAX * 255.99)
  with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
    amax = np.max(np.abs(x))
    s_enc = 1.0 if amax == 0 else f32(min(g_range / amax, ref.FLT_MAX))
    s_dec = f32(1.0 / s_enc)
    t_dec = f32(amax / g_range)
    amax_b = ref.block_amax(np.abs(x), block, axis, False)
    s_b = ref.e4m3_rne(f32(amax_b * f32(s_enc * f32(1.0 / EDEN_ELEM_MAX))))
    enc = np.minimum(f32(1.0 / f32(s_b * s_dec)), ref.FLT_MAX)
    y = f32(x * ref.expand(enc, block, axis, False))
    y = np.where(ref.expand(s_b, block, axis, False) == 0, np.copysign(0.0, y), y)  # zero-scale blocks: signed 0
    codes = ref.e2m1_rne(y)
    v = ref.e2m1_value(codes)
    per_block = lambda t: np.moveaxis(pairwise(blocks_last(t, block, axis, False), np.add), -1, axis)
    num_b, den_b = per_block(f32(y * y)), per_block(f32(y * v))

    def group_sum(a):
      a = np.moveaxis(a, axis, -1)
      n = a.shape[-1]
      padded = np.concatenate([a, np.zeros(a.shape[:-1] + (-n % group,))], axis=-1)
      s = pairwise(padded.reshape(*a.shape[:-1], -1, group), np.add)
      return np.moveaxis(np.repeat(s, group, axis=-1)[..., :n], -1, axis)

    num, den = group_sum(num_b), group_sum(den_b)
    corr = np.where(den == 0, 1.0, f32(num / np.where(den == 0, 1.0, den)))
    pre = f32(s_b * corr)
    s = ref.e4m3_rne(pre)
    deq = f32(f32(v * ref.expand(s, block, axis, False)) * t_dec)
  return {"codes": codes, "scales": s, "dequant": deq, "pre_round": pre, "amax": float(amax)}


# ---------------------------------------------------------------- Quartet (arXiv 2505.14669): QuEST forward, Tseng
# backward, both MXFP4 (32-element blocks, power-of-two scales).

QUEST_SCALE = 2.92247856 / 6.0  # the MSE-optimal E2M1 clipping range for Gaussian data, 2.92 sigma, over 6
QUEST_EPS = 1e-8


def _mxfp4_finish(x, codes, e, axis, block, factor=1.0):
  """Dequantized values (NaN everywhere if x holds NaN or inf), scales and amax of MXFP4 codes and exponents."""
  amax = float(np.max(np.abs(x))) if x.size else 0.0
  with np.errstate(over="ignore", invalid="ignore"):
    deq = f32(ref.e2m1_value(codes) * np.ldexp(1.0, ref.expand(e, block, axis, False)) * f32(factor))
  if not np.isfinite(amax):
    deq = np.full_like(deq, np.nan)
  return deq, amax


def mxfp4_quest(x, *, axis=-1, block=32):
  """QuEST's MXFP4 quantizer: codes, scales (NaN for a block holding NaN or inf), mask, dequant, amax.

  sigma: each block's population standard deviation (float64, mean-centred, ddof 0). Scale 2^e with
  e = floor(log2(sigma * 2.92247856 / 6 + 1e-8)), clamped to [-127, 125] (E8M0's range, and 6 * 2^e a finite
  float32: ref.top_exponent(6)); elements x / 2^e rounded to nearest even on E2M1, saturating at 6; mask:
  |x / 2^e| < 6 (the elements whose gradient passes).
  """
  x = ref.as_f64(x)
  axis = axis % x.ndim
  t = blocks_last(x, block, axis, False)
  finite = np.all(np.isfinite(t), axis=-1)
  with np.errstate(invalid="ignore", over="ignore"):
    sigma = np.std(np.where(finite[..., None], t, 0.0), axis=-1)
  e = np.clip(np.floor(np.log2(sigma * QUEST_SCALE + QUEST_EPS)), -127, ref.top_exponent(6.0)).astype(np.int64)
  e = np.where(finite, e, 0)  # a block holding NaN or inf: exponent 0 (its scale is stored as NaN)
  e = _unblock_1d(e, axis)
  with np.errstate(over="ignore", invalid="ignore"):
    scaled = f32(x * np.ldexp(1.0, -ref.expand(e, block, axis, False)))
  codes = ref.e2m1_rne(scaled)
  deq, amax = _mxfp4_finish(x, codes, e, axis, block)
  scales = np.where(_unblock_1d(finite, axis), np.ldexp(1.0, e), np.nan)
  return {"codes": codes, "scales": scales, "mask": np.abs(scaled) < 6.0, "dequant": deq, "amax": amax,
          "scaled": scaled, "exponents": e}


def mxfp4_tseng(x, *, axis=-1, block=32):
  """Tseng et al.'s MXFP4 rule (arXiv 2502.20586), Quartet's backward quantizer, rounded to nearest.

  e = floor(log2 amax_b) - 2 (the OCP scale), elements x * 3/4 / 2^e (block max in [3, 6): never saturates),
  values decoded as code * 2^e * 4/3 (4/3 as a float32 constant). e is capped where the decoded top 6 * 4/3 * 2^e is
  still a finite float32 (124): a block with amax_b >= 2^127 saturates.
  """
  x = ref.as_f64(x)
  axis = axis % x.ndim
  e = ref.mxfp4_exponent(ref.block_amax(np.abs(x), block, axis, False), "floor", top=8.0)
  with np.errstate(over="ignore", invalid="ignore"):
    scaled = f32(x * np.ldexp(1.0, -ref.expand(e, block, axis, False)) * 0.75)
  codes = ref.e2m1_rne(scaled)
  deq, amax = _mxfp4_finish(x, codes, e, axis, block, 4.0 / 3.0)
  return {"codes": codes, "scales": np.ldexp(1.0, e), "dequant": deq, "amax": amax, "scaled": scaled}
