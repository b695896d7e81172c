"""Plain NumPy float64 reference quantizers, written from arXiv 2509.25149 (App. B) and docs/numerics.md.

Independent of fp4jax on purpose: every rounding step is spelled out in float64 and
rounded to float32 (`f32`) exactly where the quantizer's float32 arithmetic rounds. A
float32 op computed in float64 and then rounded to float32 gives the correctly
rounded float32 result for + - * / (53 >= 2*24 + 2), so these match IEEE float32.
Float32 subnormals are NOT flushed here (XLA on CPU flushes them): tests keep every
float32 intermediate in the normal range.

Arrays are returned in float64 (values that are exactly float32 / E4M3 / E8M0
numbers) and codes as uint8 0..15, unpacked, with the input's shape.
"""

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
NVFP4_GLOBAL = 2688.0  # 6 * 448
RHT16_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)


def f32(v):
  """Round float64 values to the nearest float32 value (returned as float64)."""
  with np.errstate(over="ignore", invalid="ignore"):
    return np.asarray(v, dtype=np.float64).astype(np.float32).astype(np.float64)


def assert_same_bits(got, want, what="values", sign_of_zero=True):
  """float32 bit patterns equal (so -0 != +0, which np.testing.assert_array_equal lets pass); NaN positions equal
  (payloads free). sign_of_zero=False: values only."""
  got = np.asarray(got).astype(np.float32)
  want = np.asarray(want).astype(np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
  ok = ~np.isnan(want)
  if sign_of_zero:
    bad = got.view(np.uint32)[ok] != want.view(np.uint32)[ok]
    assert not np.any(bad), f"{what}: {bad.sum()} values differ, first got {got[ok][bad][:4]} want {want[ok][bad][:4]}"
  else:
    np.testing.assert_array_equal(got[ok], want[ok], err_msg=what)


def as_f64(x):
  """Upcast a float32/bfloat16/float16 array (numpy, ml_dtypes or jax) to float64."""
  return np.asarray(x).astype(np.float32).astype(np.float64)


# ---------------------------------------------------------------- element formats


def e2m1_rne(v):
  """E2M1 codes (uint8 0..15) of float values: RNE on the grid, saturating at +-6.

  The sign bit is the value's sign bit (so -0 and small negatives give code 8).
  Ties go to the even code index (mantissa bit 0). NaN maps to code 0 (unspecified).
  """
  v = np.asarray(v, dtype=np.float64)
  mag = np.minimum(np.abs(np.nan_to_num(v, nan=0.0)), 6.0)
  lo = np.searchsorted(E2M1_GRID, mag, side="right") - 1
  hi = np.minimum(lo + 1, 7)
  d_lo = mag - E2M1_GRID[lo]
  d_hi = E2M1_GRID[hi] - mag
  take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
  idx = np.where(take_hi, hi, lo)
  return (idx + 8 * np.signbit(v)).astype(np.uint8)


def e2m1_value(codes):
  """Float value of E2M1 codes 0..15 (code 8 is -0)."""
  codes = np.asarray(codes).astype(np.int64)
  mag = E2M1_GRID[codes & 7]
  return np.where(codes >= 8, -mag, mag)


def e2m1_neighbours(v):
  """Magnitudes (lo, hi) of the grid points bracketing min(|v|, 6); lo == hi on the grid."""
  mag = np.minimum(np.abs(np.asarray(v, dtype=np.float64)), 6.0)
  lo_i = np.searchsorted(E2M1_GRID, mag, side="right") - 1
  lo = E2M1_GRID[lo_i]
  hi = np.where(lo == mag, lo, E2M1_GRID[np.minimum(lo_i + 1, 7)])
  return lo, hi


def sr_up(p, bits, random_bits=32):
  """Stochastic rounding's decision: True where the uniform from the uint32 `bits` is below the round-up probability
  p. 32 random bits: the top 24 / 2^24 against p; 8: the top 8 against floor(256 p)."""
  bits = np.asarray(bits).astype(np.uint64)
  if random_bits == 32:
    return (bits >> 8).astype(np.float64) * 2.0**-24 < p
  return (bits >> 24).astype(np.float64) < np.floor(p * 256.0)


def e2m1_sr(y, bits, random_bits=32):
  """Signed E2M1 values of stochastically rounded `y` (float64): up (sr_up) with p = (|y| - lo) / (hi - lo)."""
  a = np.minimum(np.abs(np.asarray(y, np.float64)), 6.0)
  lo, hi = e2m1_neighbours(a)
  p = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
  mag = np.where(sr_up(p, bits, random_bits), hi, lo)
  return np.where(np.signbit(y), -mag, mag)


def e4m3_rne(v):
  """Round to float8_e4m3fn with RNE, saturating at +-448 (inf -> 448, NaN stays NaN)."""
  v = np.asarray(v, dtype=np.float64)
  mag = np.abs(v)
  finite = np.isfinite(mag)
  safe = np.where(finite, mag, 1.0)
  _, e = np.frexp(safe)  # safe = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
  exp = np.maximum(e - 1, -6)  # below the smallest normal 2**-6 the quantum stays 2**-9
  quantum = np.ldexp(1.0, exp - 3)
  r = np.rint(safe / quantum) * quantum  # np.rint is round-half-even; safe/quantum is exact
  r = np.where(finite, np.minimum(r, E4M3_MAX), np.where(np.isnan(mag), np.nan, E4M3_MAX))
  return np.copysign(r, v)


# ---------------------------------------------------------------- block helpers


def block_amax(x_abs, block, axis, block_2d):
  """Max over 1 x block blocks along `axis`, or block x block tiles over the last two axes."""
  if block_2d:
    *lead, r, c = x_abs.shape
    t = x_abs.reshape(*lead, r // block, block, c // block, block)
    return np.max(np.max(t, axis=-1), axis=-2)
  t = np.moveaxis(x_abs, axis, -1)
  t = t.reshape(*t.shape[:-1], t.shape[-1] // block, block)
  return np.moveaxis(np.max(t, axis=-1), -1, axis)


def expand(s, block, axis, block_2d):
  """Broadcast per-block values back to element shape (inverse layout of block_amax)."""
  if block_2d:
    return np.repeat(np.repeat(s, block, axis=-1), block, axis=-2)
  return np.repeat(s, block, axis=axis)


def pack_codes(codes, axis):
  """Pack uint8 codes two per byte along axis: element 2i low nibble, 2i+1 high nibble."""
  c = np.moveaxis(np.asarray(codes).astype(np.uint8), axis, -1)
  packed = c[..., 0::2] | (c[..., 1::2] << 4)
  return np.moveaxis(packed.astype(np.uint8), -1, axis)


def unpack_codes(packed, axis):
  """Inverse of pack_codes."""
  p = np.moveaxis(np.asarray(packed).astype(np.uint8), axis, -1)
  out = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
  return np.moveaxis(out, -1, axis)


# ---------------------------------------------------------------- NVFP4


def nvfp4_quantize(x, axis=-1, block_2d=False, block=16):
  """Reference NVFP4 (paper App. B; docs/numerics.md, "Quantization") on an unpadded array; returns a dict.

  Keys: codes (uint8 0..15, x's shape), scales (float64 E4M3 values, blocked shape),
  amax (float64 scalar), scaled (float32-valued x * enc_b before E2M1 rounding).
  """
  x = as_f64(x)
  axis = axis % x.ndim
  with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
    amax = np.max(np.abs(x)) if x.size else 0.0
    if amax == 0:
      s_enc = 1.0
    else:
      s_enc = f32(np.minimum(NVFP4_GLOBAL / amax, FLT_MAX))
      if s_enc == 0:
        s_enc = 1.0
    sixth = f32(1.0 / 6.0)
    c = f32(s_enc * sixth)
    amax_b = block_amax(np.abs(x), block, axis, block_2d)
    s_b = e4m3_rne(f32(amax_b * c))  # one rounding of the product, no lower clamp
    s_dec = f32(1.0 / s_enc)
    enc_b = np.minimum(f32(1.0 / f32(s_b * s_dec)), FLT_MAX)
    scaled = f32(x * expand(enc_b, block, axis, block_2d))
  return {"codes": e2m1_rne(scaled), "scales": s_b, "amax": float(amax), "scaled": scaled}


def nvfp4_dequantize(codes, scales, amax, axis=-1, block_2d=False, block=16):
  """Reference NVFP4 dequantize: f32(f32(code * s_b) * f32(amax / 2688)); signed zeros when amax == 0."""
  axis = axis % np.ndim(codes)
  s = expand(np.asarray(scales, dtype=np.float64), block, axis, block_2d)
  with np.errstate(over="ignore", invalid="ignore"):
    out = f32(f32(e2m1_value(codes) * s) * f32(np.float64(amax) / NVFP4_GLOBAL))
  if amax == 0:  # zeros, each with its code's sign (-0 * 0 * 0 is -0)
    out = np.copysign(np.zeros_like(out), e2m1_value(codes))
  return out


# ---------------------------------------------------------------- MXFP4


def top_exponent(top):
  """The largest exponent e in E8M0's range whose grid top, top * 2^e, is at most float32's largest value."""
  e = 127
  while top * 2.0**e > FLT_MAX:
    e -= 1
  return e


def mxfp4_exponent(amax_b, rule, top=6.0):
  """E8M0 exponent per block, computed in float64 with log2/floor/ceil, clamped to [-127, top_exponent(top)] (the
  grid top * 2^e must stay a finite float32); a block holding inf gets 127."""
  amax_b = np.asarray(amax_b, dtype=np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    if rule == "floor":
      e = np.floor(np.log2(amax_b)) - 2
    elif rule == "ceil":
      e = np.ceil(np.log2(amax_b / 6.0))
    else:
      raise ValueError(rule)
  e = np.clip(np.nan_to_num(e, nan=0.0, neginf=-127.0, posinf=127.0), -127, top_exponent(top))
  e = np.where(amax_b == 0, -127.0, np.where(amax_b == np.inf, 127.0, e))
  return e.astype(np.int64)


def mxfp4_quantize(x, axis=-1, block_2d=False, rule="floor", block=32):
  """Reference MXFP4: codes (uint8), scales (float64 powers of two), exponents, amax, scaled."""
  x = as_f64(x)
  axis = axis % x.ndim
  amax_b = block_amax(np.abs(x), block, axis, block_2d)
  e = mxfp4_exponent(amax_b, rule)
  # x * 2**-e is exact in float64; one rounding to float32 (exact unless it underflows).
  scaled = f32(x * np.ldexp(1.0, -expand(e, block, axis, block_2d)))
  return {
      "codes": e2m1_rne(scaled),
      "scales": np.ldexp(1.0, e),
      "exponents": e,
      "amax": float(np.max(np.abs(x))) if x.size else 0.0,
      "scaled": scaled,
  }


def mxfp8_quantize(x, axis=-1, block=32):
  """Reference MXFP8 (OCP MX, E4M3 elements): scale 2^e per `block` elements along `axis` with e = ceil(log2(amax_b
  / 448)) (nothing saturates), clamped to [-127, top_exponent(448)] (-127 for all-zero blocks, 127 for a block
  holding inf; above 448 * 2^119 a block saturates); elements e4m3_rne(x * 2^-e).
  The axis is zero-padded to whole blocks and cropped again. Returns dict(values (dequantized), exponents)."""
  x = as_f64(x)
  axis = axis % x.ndim
  n = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, -n % block)
  xp = np.pad(x, pad)
  amax_b = block_amax(np.abs(xp), block, axis, False)
  with np.errstate(divide="ignore"):
    e = np.ceil(np.log2(amax_b / E4M3_MAX))
  e = np.clip(e, -127, top_exponent(E4M3_MAX))
  e = np.where(amax_b == 0, -127.0, np.where(amax_b == np.inf, 127.0, e)).astype(np.int64)
  scale = np.ldexp(1.0, expand(e, block, axis, False))
  values = f32(e4m3_rne(f32(xp / scale)) * scale)
  return {"values": np.take(values, np.arange(n), axis=axis), "exponents": e}


# ---------------------------------------------------------------- FP8


def fp8_quantize(x, scaling="block", block=128, axis=-1, block_2d=False):
  """Reference FP8 E4M3: scale = f32(amax_blk / 448), codes = e4m3(f32(x * min(f32(448 / amax_blk), FLT_MAX)))."""
  x = as_f64(x)
  axis = axis % x.ndim
  if scaling == "tensor":
    amax_blk = np.max(np.abs(x))
  else:
    amax_blk = block_amax(np.abs(x), block, axis, block_2d)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    scale = np.where(amax_blk == 0, 1.0, f32(amax_blk / E4M3_MAX))
    factor = np.where(amax_blk == 0, 1.0, np.minimum(f32(E4M3_MAX / amax_blk), FLT_MAX))
    factor_el = factor if scaling == "tensor" else expand(factor, block, axis, block_2d)
    codes = e4m3_rne(f32(x * factor_el))
  return {"codes": codes, "scales": scale, "amax": float(np.max(np.abs(x)))}


def fp8_dequantize(codes, scales, scaling="block", block=128, axis=-1, block_2d=False):
  """Reference FP8 dequantize: f32(code * scale)."""
  axis = axis % np.ndim(codes)
  s = np.asarray(scales, np.float64) if scaling == "tensor" else expand(scales, block, axis, block_2d)
  return f32(np.asarray(codes, np.float64) * s)


# ---------------------------------------------------------------- RHT


def sylvester(d):
  """Sylvester Hadamard matrix H_d (scipy.linalg.hadamard ordering), float64 +-1."""
  h = np.ones((1, 1))
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return h


def rht_matrix(d, signs):
  """H = diag(signs) @ H_d / sqrt(d) in float64."""
  return np.diag(np.asarray(signs, np.float64)) @ sylvester(d) / np.sqrt(d)


def rht_apply(x, d, signs, axis=-1, inverse=False):
  """Each run of d consecutive elements along axis, as a row vector t, becomes t @ H (t @ H^T if inverse).

  Row-vector convention of the reference implementation (x.reshape(-1, 16) @ H).
  """
  h = rht_matrix(d, signs)
  if inverse:
    h = h.T
  t = np.moveaxis(as_f64(x), axis, -1)
  y = (t.reshape(-1, d) @ h).reshape(t.shape)
  return np.moveaxis(y, -1, axis)
