"""Coverage audit of the quantizer tests: the cells of (format x scale rule x layout x rounding x edge case x dtype)
the other test files did not check bit for bit against the NumPy float64 references (tests/reference.py,
tests/reference_recipes.py).

Closed here:
- Edge cases (zero blocks, -0, tiny negatives that round to -0, E4M3-underflowing blocks, E2M1 ties, all-zero
  tensors) for NVFP4 2D, "up", headroom, 4/6, EDEN, double-block, MXFP4 floor/ceil 2D, tseng, quest, MXFP8 (whose
  codes and E8M0 scales no other test compares) and FP8 (block, tensor, 128x128), in float32, bfloat16 and float16.
- The sign of zero in dequantized values: np.testing.assert_array_equal treats -0 == +0, so the existing reference
  comparisons of dequantized values never checked it; here dequantize, fake_quant and decode_elements are compared
  with the reference as float32 bit patterns.
- fake_quant (direct path), dequantize (stored scales) and decode_elements(quantize_elements) agree bit for bit, and
  quantize_elements' elements and scales are quantize's codes and scales, for every configuration above.
- NaN / +-inf poisoning for formats and layouts test_quantize_errors does not run (MXFP4 ceil / tseng / 2D, MXFP8,
  NVFP4 up / headroom / EDEN / 2D, FP8 128x128), asserting all-NaN output (the documented policy), not just
  "not finite".
- Stochastic-rounding decisions given the bits for MXFP4 (floor, ceil, quest), tseng, NVFP4 2D, 4/6 (both
  candidates rounded with the same bits), double-block and pad=True along axis 0, with random_bits 8 and 32 and both
  generators (only NVFP4 1D along axis -1 was checked); MS-EDEN's stochastic scale rounding given the bits (only
  "a neighbour" was checked, random_bits=8 never).
- pad=True against the reference (scales and amax too) for NVFP4 2D, 4/6, EDEN, MXFP4 1D/2D, quest, MXFP8 and FP8
  (the existing pad test compared non-NVFP4 formats only with the library itself, and no scales).
- A statistical test of MXFP4 ("ceil") stochastic rounding with a fixed key and a stated tolerance, which also checks
  that the tolerance rejects round-to-nearest.

Every input is tiny and shapes are shared between tests so jit compiles are reused. The file is two xdist units
(tests/conftest.py schedules a module as one unit; the second half is marked GROUP_B), so `-n 2` runs it on both
workers.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import prng
from fp4jax.quantize import decode_elements, quantize_elements
import reference as ref
import reference_recipes as rref

SHAPE = (32, 128)  # 1D blocks of 16 / 32 / 128 along either axis, 2D tiles of 16 and 32
NV = fp4jax.NVFP4()
UP = fp4jax.NVFP4(scale_rule="up")
HEAD = fp4jax.NVFP4(headroom=True)
FOUR_SIX = fp4jax.NVFP4(scale_rule="4over6")
EDEN = fp4jax.NVFP4(scale_rule="eden")
DOUBLE = fp4jax.NVFP4(double_block=True)
MX = fp4jax.MXFP4()
MX_CEIL = fp4jax.MXFP4(scale_rule="ceil")
TSENG = fp4jax.MXFP4(scale_rule="tseng")
QUEST = fp4jax.MXFP4(scale_rule="quest")
MXFP8 = fp4jax.MXFP8()
FP8 = fp4jax.FP8()
FP8_T = fp4jax.FP8(scaling="tensor")
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
GROUP_B = pytest.mark.xdist_group("test_audit_coverage_b")


# ---------------------------------------------------------------- inputs


def edge_tensor(shape=SHAPE, seed=0):
  """Gaussian rows with: a +0 block, a -0 block, scattered -0, tiny negatives (rounding to -0 everywhere), a row
  of E4M3-underflowing NVFP4 block scales, an outlier, small elements landing on E4M3 subnormals (8-bit formats), MXFP4 tie rows [+-6, ties] * 2^j (exact scale 2^j)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x[0, :32] = 0.0
  x[1, 32:] = -0.0
  x[2, ::3] = -0.0
  x[3, 1::4] = -1e-6
  x[4, :64] *= np.float32(3e-4)  # vs the outlier 50: NVFP4 block scales on E4M3 subnormals...
  x[4, 64:] *= np.float32(1e-5)  # ...and below the smallest one (scale 0)
  x[5, 0] = 50.0
  x[6, 1::4] = np.float32(1e-4) * np.where(np.arange(len(x[6, 1::4])) % 2, -1, 1)  # E4M3-subnormal MXFP8 / FP8 elements
  blk = np.concatenate([[6.0, -6.0], TIES, -TIES, TIES, -TIES, [-0.0, 0.0]])  # 32 values
  for i, j in enumerate(range(-3, 5)):  # rows 8..11, four 32-blocks each
    x[8 + i // 2, 64 * (i % 2):64 * (i % 2) + 32] = rng.permutation(blk) * 2.0**j
    x[8 + i // 2, 64 * (i % 2) + 32:64 * (i % 2) + 64] = rng.permutation(blk) * 2.0**(-j)
  return x


def zero_tensor(shape=SHAPE):
  """All zeros, a third of them -0: amax 0 (NVFP4's S_enc = 1, every scale 0; MXFP4 2^-127; FP8 scale 1)."""
  x = np.zeros(shape, np.float32)
  x[::2, ::3] = -0.0
  return x


def _cast(x, dtype):
  return jnp.asarray(x, dtype)


# ---------------------------------------------------------------- references


def _mxfp8_ref(x, axis):
  """MXFP8 codes (E4M3 values), E8M0 scales and dequantized values from ref.mxfp8_quantize's exponents."""
  r = ref.mxfp8_quantize(x, axis=axis)
  scale = np.ldexp(1.0, ref.expand(r["exponents"], 32, axis % x.ndim, False))
  codes = ref.e4m3_rne(ref.f32(ref.as_f64(x) / scale))
  return {"codes": codes, "scales": np.ldexp(1.0, r["exponents"]), "amax": float(np.max(np.abs(ref.as_f64(x)))),
          "dequant": r["values"]}


def reference(fmt, x, axis=-1, block_2d=False):
  """dict(codes (uint8 E2M1 codes, or float64 E4M3 values for the 8-bit formats), scales, amax, dequant)."""
  x = ref.as_f64(x)
  a = axis % x.ndim
  if fmt == NV:
    r = ref.nvfp4_quantize(x, axis=a, block_2d=block_2d)
    r["dequant"] = ref.nvfp4_dequantize(r["codes"], r["scales"], r["amax"], axis=a, block_2d=block_2d)
    return r
  if isinstance(fmt, fp4jax.NVFP4):
    if fmt.scale_rule == "eden":
      return rref.nvfp4_eden(x, axis=a)
    return rref.nvfp4_variant(x, axis=a, block_2d=block_2d, four_over_six=fmt.scale_rule == "4over6",
                              select=fmt.select, round_up=fmt.scale_rule == "up", headroom=fmt.headroom,
                              double_block=fmt.double_block)
  if isinstance(fmt, fp4jax.MXFP4):
    if fmt.scale_rule == "tseng":
      return rref.mxfp4_tseng(x, axis=a)
    if fmt.scale_rule == "quest":
      return rref.mxfp4_quest(x, axis=a)
    r = ref.mxfp4_quantize(x, axis=a, block_2d=block_2d, rule=fmt.scale_rule)
    r["dequant"] = ref.f32(ref.e2m1_value(r["codes"]) * ref.expand(r["scales"], 32, a, block_2d))
    return r
  if isinstance(fmt, fp4jax.MXFP8):
    return _mxfp8_ref(x, a)
  r = ref.fp8_quantize(x, scaling=fmt.scaling, block=fmt.block_size, axis=a, block_2d=block_2d)
  r["dequant"] = ref.fp8_dequantize(r["codes"], r["scales"], scaling=fmt.scaling, block=fmt.block_size, axis=a,
                                    block_2d=block_2d)
  return r


# ---------------------------------------------------------------- jitted entry points (one compile per setting)


@functools.cache
def _jit(name, fmt, **kw):
  fn = {"quantize": fp4jax.quantize, "fake_quant": fp4jax.fake_quant}[name]
  return jax.jit(functools.partial(fn, fmt=fmt, **kw))


_dequantize = fp4jax.dequantize  # jitted inside: one compile per QArray layout
_decode = jax.jit(decode_elements, static_argnums=(1, 4, 5, 6))
_random_bits = jax.jit(prng.random_bits, static_argnums=(1, 2))  # the generator's bits, fused (eager: op by op)


def _stored_codes(q):
  return np.asarray(q.unpacked_codes()) if q.fmt.is_fp4 else ref.as_f64(q.codes)


def check_against_reference(x, fmt, axis=-1, block_2d=False, pad=False, r=None):
  """quantize's codes, scales, amax; dequantize, fake_quant and decode_elements(quantize_elements) all equal the
  reference bit for bit (dequantized zeros with their sign, except for an all-zero tensor, whose sign the
  reference leaves open). With pad=True the reference runs on the explicitly zero-padded tensor."""
  kw = dict(axis=axis, block_2d=block_2d, pad=pad)
  x = jnp.asarray(x)
  q = _jit("quantize", fmt, **kw)(x)
  if r is None:
    xp = np.asarray(ref.as_f64(x))
    if pad:
      xp = np.pad(xp, [(0, p - s) for s, p in zip(x.shape, q.shape)])
    r = reference(fmt, xp, axis, block_2d)
  crop = tuple(slice(0, n) for n in x.shape)
  codes = _stored_codes(q)
  np.testing.assert_array_equal(codes, r["codes"], err_msg="codes")
  if not fmt.is_fp4:
    np.testing.assert_array_equal(np.signbit(codes), np.signbit(r["codes"]), err_msg="sign of E4M3 codes")
  scales = np.asarray(q.scales).astype(np.float64)
  np.testing.assert_array_equal(scales.reshape(np.shape(r["scales"])), r["scales"], err_msg="scales")
  if not getattr(fmt, "double_block", False):
    np.testing.assert_array_equal(np.float64(q.amax), r["amax"], err_msg="amax")
  sign = bool(np.max(np.abs(ref.as_f64(x))) > 0)
  want = np.asarray(r["dequant"])[crop]
  deq = _dequantize(q, jnp.float32)
  assert deq.dtype == jnp.float32 and deq.shape == x.shape
  ref.assert_same_bits(deq, want, "dequantize", sign)
  fq = _jit("fake_quant", fmt, **kw)(x)
  assert fq.dtype == x.dtype and fq.shape == x.shape
  # fake_quant returns x's dtype: the float32 dequantized values cast, bit for bit.
  ref.assert_same_bits(np.asarray(fq.astype(jnp.float32)), np.asarray(deq.astype(x.dtype).astype(jnp.float32)),
                   "fake_quant vs dequantize", True)
  el, sc, amax, block = quantize_elements(x, fmt, **kw)
  if fmt.is_fp4:
    np.testing.assert_array_equal(np.asarray(el, np.float64), ref.e2m1_value(codes), err_msg="elements vs codes")
    np.testing.assert_array_equal(np.signbit(np.asarray(el)), codes >= 8, err_msg="sign of elements")
  else:
    ref.assert_same_bits(el, codes, "elements vs E4M3 codes")
  np.testing.assert_array_equal(np.asarray(sc).astype(np.float64).reshape(scales.shape), scales)
  np.testing.assert_array_equal(np.asarray(amax), np.asarray(q.amax))
  ref.assert_same_bits(_decode(el, fmt, sc, amax, tuple(block), tuple(x.shape), jnp.float32), deq,
                   "decode_elements vs dequantize", True)
  return q, r, np.asarray(deq)


# ---------------------------------------------------------------- 1. edge cases bit for bit

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# (fmt, axis, block_2d, dtype): each a cell no other test compares with the reference on these edge cases.
EDGE_CONFIGS = [
    (NV, 0, True, F32),        # 2D: -0, zero blocks, tiny negatives were never in the 2D cases
    (NV, -1, True, F16),       # float16 on 2D
    (UP, 0, False, F16),       # "up": float16, axis 0, -0
    (HEAD, -1, False, BF16),   # headroom: bf16 and -0
    (FOUR_SIX, 0, False, F32),  # 4/6: -0, zero blocks, underflow, along axis 0
    (FOUR_SIX, -1, True, F16),  # 4/6 on 16x16 tiles, float16
    (EDEN, -1, False, F32),    # EDEN: -0 (its zero-scale blocks store +0 codes, as the reference), ties
    (EDEN, 0, False, F16),     # EDEN along axis 0 (a 32-element axis: one partial 128-group), float16
    (DOUBLE, -1, False, F16),  # double-block: float16, -0
    (MX, 0, True, F32),        # MXFP4 2D: zero blocks, -0, saturation
    (MX_CEIL, -1, True, F16),  # "ceil" on 2D, float16
    (MX_CEIL, 0, False, F16),  # "ceil" along axis 0, float16
    (TSENG, -1, False, F16),   # tseng: float16, -0, ties
    (QUEST, 0, False, F16),    # quest: float16 along axis 0
    (MXFP8, 0, False, F32),    # MXFP8 codes and scales: never compared bit for bit elsewhere
    (MXFP8, -1, False, BF16),
    (MXFP8, -1, False, F16),
    (FP8, -1, False, F16),     # FP8 float16 input
]


def _cfg_id(c):
  fmt, axis, block_2d, dtype = c
  return f"{fmt.label}-{'2d' if block_2d else 'axis' + str(axis)}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("fmt,axis,block_2d,dtype", EDGE_CONFIGS, ids=[_cfg_id(c) for c in EDGE_CONFIGS])
def test_edge_cases_match_reference_bit_for_bit(fmt, axis, block_2d, dtype):
  x = _cast(edge_tensor(), dtype)
  q, r, deq = check_against_reference(x, fmt, axis, block_2d)
  # The construction hits what it claims, for this format: zeros keep their sign bit in the codes.
  xs = ref.as_f64(x)
  negz = (xs == 0) & np.signbit(xs)
  codes = _stored_codes(q)
  if fmt == EDEN:  # MS-EDEN zeroes the scaled elements of a zero-scale block, each keeping its sign (-0: code 8)
    zero_scale = ref.expand(r["scales"] == 0, 16, axis % 2, False)
    assert np.any(negz & zero_scale) or axis == 0  # along axis 0 no 16-block of this tensor is all zero
  if fmt.is_fp4:
    assert np.all(codes[negz] == 8) and np.all(codes[(xs == 0) & ~np.signbit(xs)] == 0)
  else:
    assert np.all(np.signbit(codes[negz]))
  assert np.any(np.signbit(deq[negz]))  # -0 reaches the dequantized output
  # The all-zero tensor, same compile.
  check_against_reference(_cast(zero_tensor(), dtype), fmt, axis, block_2d)


def test_edge_tensor_hits_the_cells_it_claims():
  """NVFP4 zero and subnormal block scales and saturated maxima; MXFP4 ties on the E2M1 midpoints, floor saturation."""
  x = edge_tensor()
  r = ref.nvfp4_quantize(x)
  assert np.sum(r["scales"] == 0) >= 4 and np.any((r["scales"] > 0) & (r["scales"] < 2.0**-6))
  assert np.sum(np.abs(r["scaled"]) > 6) >= 10  # block maxima above 6 after scaling (saturate)
  for rule in ("floor", "ceil"):
    m = ref.mxfp4_quantize(x, rule=rule)
    for t in TIES:
      assert np.sum(np.abs(m["scaled"]) == t) >= 16, (rule, t)
  assert np.sum(np.abs(ref.mxfp4_quantize(x, rule="floor")["scaled"]) > 6) >= 5
  assert np.sum(ref.e2m1_rne(r["scaled"]) == 8) > 50  # -0 and tiny negatives become code 8
  c8 = np.abs(_mxfp8_ref(x, -1)["codes"])
  assert np.any((c8 > 0) & (c8 < 2.0**-6)) and np.any(c8 == 448)  # MXFP8: E4M3 subnormal elements, and the top


# FP8 128x128 tiles need a [128, 128] tensor: one float16 case, -0 and zero tiles included.
@GROUP_B
def test_fp8_128x128_tiles_float16_and_negative_zero():
  x = np.concatenate([edge_tensor()] * 4, axis=0)
  x[64:, :] *= np.float32(1e-3)
  check_against_reference(_cast(x, F16), FP8, -1, True)
  check_against_reference(_cast(zero_tensor((128, 128)), F16), FP8, -1, True)


# ---------------------------------------------------------------- 2. NaN / inf: the whole tensor is NaN

# Cells of EDGE_CONFIGS (the same compiles): formats and layouts test_quantize_errors does not run.
NON_FINITE_CONFIGS = [
    (MX_CEIL, 0, False, F16), (MX, 0, True, F32), (MX_CEIL, -1, True, F16), (TSENG, -1, False, F16),
    (MXFP8, 0, False, F32), (UP, 0, False, F16), (HEAD, -1, False, BF16), (EDEN, -1, False, F32),
    (NV, 0, True, F32), (DOUBLE, -1, False, F16),
]
assert all(c in EDGE_CONFIGS for c in NON_FINITE_CONFIGS)


@pytest.mark.parametrize("fmt,axis,block_2d,dtype", NON_FINITE_CONFIGS, ids=[_cfg_id(c) for c in NON_FINITE_CONFIGS])
def test_nan_and_inf_make_every_value_nan(fmt, axis, block_2d, dtype):
  """docs/numerics.md: NaN anywhere makes amax NaN; NaN or +-inf anywhere makes the whole dequantized tensor NaN
  (test_quantize_errors runs only nvfp4 / mxfp4 floor / fp8 1D and checks 'not finite', which +-inf would pass)."""
  kw = dict(axis=axis, block_2d=block_2d, pad=False)
  for bad in (np.nan, np.inf, -np.inf):
    x = edge_tensor()
    x[7, 77] = bad
    x = _cast(x, dtype)
    q = _jit("quantize", fmt, **kw)(x)
    amax = np.asarray(q.amax)  # a scalar, or one per 1x128 group (double_block): the poisoned group's
    assert np.isnan(amax).any() if np.isnan(bad) else (np.isinf(amax).any() and not np.isnan(amax).any())
    for out, what in ((_dequantize(q, jnp.float32), "dequantize"),
                      (_jit("fake_quant", fmt, **kw)(x), "fake_quant")):
      out = np.asarray(out.astype(jnp.float32))
      assert np.all(np.isnan(out)), f"{what} {bad}: {np.sum(~np.isnan(out))} values are not NaN"


MX_INF_CONFIGS = [c for c in NON_FINITE_CONFIGS if isinstance(c[0], (fp4jax.MXFP4, fp4jax.MXFP8))]


@pytest.mark.parametrize("fmt,axis,block_2d,dtype", MX_INF_CONFIGS, ids=[_cfg_id(c) for c in MX_INF_CONFIGS])
def test_mx_blocks_holding_an_infinity_store_what_the_reference_stores(fmt, axis, block_2d, dtype):
  """A block with +-inf gets E8M0's largest exponent (log2 inf = inf, clamped to 127), so its finite elements
  scale to zero codes instead of saturating (frexp(inf) gave exponent 0 before: a scale of 2^-3 with OCP's rule);
  the other blocks keep theirs. Dequantized, the tensor is NaN either way (the test above)."""
  for bad in (np.inf, -np.inf):
    x = edge_tensor()
    x[7, 77] = bad
    x = _cast(x, dtype)
    q = _jit("quantize", fmt, axis=axis, block_2d=block_2d, pad=False)(x)
    r = reference(fmt, x, axis, block_2d)
    assert np.max(r["scales"]) == 2.0**127  # the construction hits the case
    np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float64), r["scales"], err_msg=f"scales {bad}")
    codes = _stored_codes(q)
    want = r["codes"].astype(np.float64)
    np.testing.assert_array_equal(codes.astype(np.float64), want, err_msg=f"codes {bad}")


# ---------------------------------------------------------------- 3. stochastic rounding given the bits


def _four_over_six_sr(x, bits, random_bits, axis=-1):
  """4/6 under SR: both candidates rounded with the same bits, each block keeps the smaller-MSE one (ties: "6")."""
  r = rref.nvfp4_variant(x, axis=axis, four_over_six=True)
  amax = r["amax"]
  t_dec = ref.f32(amax / ref.f32(6.0 * 256.0))
  cands = []
  for s_b, scaled in zip(r["candidate_scales"], r["candidate_scaled"]):
    v = ref.e2m1_sr(scaled, bits, random_bits)
    deq = ref.f32(ref.f32(v * ref.expand(s_b, 16, axis % x.ndim, False)) * t_dec)
    err = rref.block_error(ref.f32(deq - x), 16, axis % x.ndim, False, "mse")
    cands.append((v, s_b, deq, err))
  four = cands[1][3] < cands[0][3]
  wide = ref.expand(four, 16, axis % x.ndim, False)
  return {"choice": four, "values": np.where(wide, cands[1][0], cands[0][0]),
          "scales": np.where(four, cands[1][1], cands[0][1]), "dequant": np.where(wide, cands[1][2], cands[0][2])}


SR_CONFIGS = [  # (fmt, shape, axis, block_2d, pad, random_bits, sr_bits)
    (MX, SHAPE, 0, False, False, 8, "hash"),
    (MX_CEIL, SHAPE, -1, True, False, 32, "threefry"),
    (TSENG, SHAPE, 0, False, False, 8, "threefry"),
    (NV, SHAPE, -1, True, False, 8, "threefry"),
    (NV, (40, 24), 0, False, True, 8, "hash"),
    (FOUR_SIX, SHAPE, -1, False, False, 8, "hash"),
    (QUEST, SHAPE, -1, False, False, 32, "hash"),
    (DOUBLE, SHAPE, 0, False, False, 8, "threefry"),
]


@GROUP_B
@pytest.mark.parametrize("fmt,shape,axis,block_2d,pad,random_bits,sr_bits", SR_CONFIGS,
                         ids=[f"{c[0].label}-{'2d' if c[3] else 'axis' + str(c[2])}{'-pad' if c[4] else ''}-"
                              f"{c[5]}bit-{c[6]}" for c in SR_CONFIGS])
def test_stochastic_rounding_matches_numpy_given_the_bits(fmt, shape, axis, block_2d, pad, random_bits, sr_bits):
  """Codes are the reference decisions on the generator's bits over the (padded) tensor in its own layout; scales
  are the round-to-nearest ones; dequantize, fake_quant and decode_elements(quantize_elements) agree bit for bit."""
  x = edge_tensor((64, 128))[:shape[0], :shape[1]]
  key = jax.random.key(17)
  kw = dict(axis=axis, block_2d=block_2d, pad=pad, rounding="stochastic", random_bits=random_bits, sr_bits=sr_bits)
  q = fp4jax.quantize(jnp.asarray(x), fmt, key=key, **kw)  # jitted inside, the key traced: one compile
  xp = np.pad(x.astype(np.float64), [(0, p - s) for s, p in zip(x.shape, q.shape)])
  bits = np.asarray(_random_bits(key, q.shape, sr_bits))
  if fmt == FOUR_SIX:
    r = _four_over_six_sr(xp, bits, random_bits, axis)
    want_values, want_scales, want_deq = r["values"], r["scales"], r["dequant"]
    assert 0 < r["choice"].mean() < 1  # both candidates are chosen somewhere
  else:
    r = reference(fmt, xp, axis, block_2d)
    want_values, want_scales = ref.e2m1_sr(r["scaled"], bits, random_bits), r["scales"]
    want_deq = None
  codes = np.asarray(q.unpacked_codes())
  np.testing.assert_array_equal(ref.e2m1_value(codes), want_values)
  np.testing.assert_array_equal(codes >= 8, np.signbit(want_values))
  np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float64), want_scales)
  deq = _dequantize(q, jnp.float32)
  if want_deq is not None:
    ref.assert_same_bits(deq, want_deq[tuple(slice(0, n) for n in x.shape)], "4/6 SR dequantize")
  fq = fp4jax.fake_quant(jnp.asarray(x), fmt, key=key, **kw)
  ref.assert_same_bits(fq, deq, "fake_quant vs dequantize")
  el, sc, amax, block = quantize_elements(jnp.asarray(x), fmt, key=key, **kw)
  np.testing.assert_array_equal(np.asarray(el, np.float64), want_values)
  ref.assert_same_bits(_decode(el, fmt, sc, amax, tuple(block), tuple(x.shape), jnp.float32), deq, "decode_elements")
  # The decisions really depend on the bits: another key moves some codes.
  q2 = fp4jax.quantize(jnp.asarray(x), fmt, key=jax.random.key(18), **kw)
  assert np.mean(np.asarray(q2.codes) != np.asarray(q.codes)) > 0.05


def _e4m3_sr(s, bits, random_bits):
  """E4M3 values of float32 scales `s` >= 0 rounded stochastically between their E4M3 neighbours (eden.py)."""
  grid = rref.e4m3_values()
  idx = np.minimum(np.searchsorted(grid, s, side="right") - 1, len(grid) - 1)
  lo = grid[idx]
  hi = np.where(lo == s, lo, grid[np.minimum(idx + 1, len(grid) - 1)])
  p = np.where(hi > lo, ref.f32((s - lo) / np.where(hi > lo, hi - lo, 1.0)), 0.0)
  return np.where(ref.sr_up(p, bits, random_bits), hi, lo)


@GROUP_B
@pytest.mark.parametrize("axis,random_bits,sr_bits", [(-1, 8, "hash"), (0, 32, "threefry")])
def test_eden_stochastic_scales_match_numpy_given_the_bits(axis, random_bits, sr_bits):
  """MS-EDEN under SR: elements round to nearest; each corrected scale (the reference's pre_round) goes up to its
  upper E4M3 neighbour exactly where the uniform from the bits over the scales' shape is below p (8-bit: below
  floor(256 p)). Only neighbourhood was checked before (test_recipes_presets_beyond), and random_bits=8 never."""
  x = edge_tensor()
  key = jax.random.key(23)
  kw = dict(axis=axis, rounding="stochastic", random_bits=random_bits, sr_bits=sr_bits)
  q = fp4jax.quantize(jnp.asarray(x), EDEN, key=key, **kw)
  r = rref.nvfp4_eden(x, axis=axis)
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()), r["codes"])
  bits = np.asarray(_random_bits(key, r["pre_round"].shape, sr_bits))
  want = _e4m3_sr(r["pre_round"], bits, random_bits)
  scales = np.asarray(q.scales).astype(np.float64)
  np.testing.assert_array_equal(scales, want)
  other = _e4m3_sr(r["pre_round"], np.asarray(_random_bits(jax.random.key(24), bits.shape, sr_bits)), random_bits)
  assert np.any(want != r["scales"]) and np.any(want != other)  # SR moves scales, and the bits matter
  t_dec = ref.f32(r["amax"] / ref.f32(rref.EDEN_ELEM_MAX * 255.99))
  deq = ref.f32(ref.f32(ref.e2m1_value(r["codes"]) * ref.expand(want, 16, axis % 2, False)) * t_dec)
  ref.assert_same_bits(_dequantize(q, jnp.float32), deq, "EDEN SR dequantize")
  ref.assert_same_bits(fp4jax.fake_quant(jnp.asarray(x), EDEN, key=key, **kw), deq, "EDEN SR fake_quant")


# ---------------------------------------------------------------- 4. pad=True against the reference

PAD_CONFIGS = [  # (fmt, shape, axis, block_2d)
    (NV, (40, 20), 0, True),
    (MX_CEIL, (40, 20), -1, True),
    (MX, (40, 20), 0, False),
    (FP8, (3, 200), -1, False),
    (MXFP8, (40, 20), 0, False),
    (FOUR_SIX, (40, 20), -1, False),
    (EDEN, (40, 20), 0, False),
    (QUEST, (40, 20), -1, False),  # the padding zeros count in the block's standard deviation (documented)
]


@pytest.mark.parametrize("fmt,shape,axis,block_2d", [pytest.param(*c, marks=[GROUP_B] if i >= 5 else [])
                                                     for i, c in enumerate(PAD_CONFIGS)],
                         ids=[f"{c[0].label}-{'2d' if c[3] else 'axis' + str(c[2])}" for c in PAD_CONFIGS])
def test_pad_true_matches_the_reference_on_the_zero_padded_tensor(fmt, shape, axis, block_2d):
  """All negative inputs (padding zeros must not become the amax or flip signs), -0 among them."""
  x = -np.abs(edge_tensor((64, 256))[:shape[0], :shape[1]]) - np.float32(0.5)
  x[1, :3] = -0.0
  q, _, _ = check_against_reference(x, fmt, axis, block_2d, pad=True)
  assert q.orig_shape == shape and q.shape != shape
  assert float(q.amax) == np.max(np.abs(x))


# ---------------------------------------------------------------- 5. statistics: MXFP4 SR is unbiased


@GROUP_B
def test_mxfp4_ceil_stochastic_rounding_is_unbiased_with_a_tolerance_round_to_nearest_fails():
  """MXFP4 "ceil" (nothing saturates): over 512 fixed keys the mean of SR(x) is within 5 standard errors of x, per
  element (variance floored at one flip in 512 draws) and summed over the tensor. The same bound rejects
  round-to-nearest, so the tolerance is tight enough to matter."""
  n = 512
  x = np.random.default_rng(31).standard_normal((8, 64)).astype(np.float32)
  keys = jax.random.split(jax.random.key(32), n)
  draws = jax.jit(jax.vmap(lambda k: fp4jax.fake_quant(jnp.asarray(x), MX_CEIL, rounding="stochastic", key=k)))(keys)
  draws = np.asarray(draws, np.float64)
  r = ref.mxfp4_quantize(x, rule="ceil")
  scale = ref.expand(r["scales"], 32, 1, False)
  lo, hi = ref.e2m1_neighbours(r["scaled"])
  assert np.all(np.isin(np.abs(draws) / scale, np.stack([lo, hi])))  # every draw is a grid neighbour
  step = (hi - lo) * scale
  p = np.where(hi > lo, (np.abs(r["scaled"]) - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
  se = np.maximum(step * np.sqrt(p * (1 - p) / n), step / n)

  def unbiased(mean):
    z = np.sum(mean - x) / np.sqrt(np.sum(se**2))
    return np.all(np.abs(mean - x) <= 5 * se + 1e-7 * np.abs(x)) and abs(z) < 5

  assert unbiased(draws.mean(axis=0))
  assert not unbiased(r["dequant"] if "dequant" in r else ref.f32(ref.e2m1_value(r["codes"]) * scale))
