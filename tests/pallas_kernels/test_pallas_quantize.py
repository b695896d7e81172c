"""Pallas NVFP4 quantize kernel (interpret mode) vs fp4jax.quantize, bit for bit; cuda lowering; kernel numerics.

Interpret-mode kernels cost ~1 s of compile each on CPU, so each test jit-compiles a group of configurations at once.
"""

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import ml_dtypes
import numpy as np
import pytest

import fp4jax
from fp4jax import grids
from fp4jax import nvfp4
from pallas_kernels import numerics
from pallas_kernels import platform
from pallas_kernels import quantize_nvfp4

NVFP4 = fp4jax.NVFP4()
DOUBLE_BLOCK = fp4jax.NVFP4(double_block=True)


def _input(shape, dtype, seed, scale=1.0):
  """Fresh random values with a wide dynamic range (log-normal magnitudes), so blocks get varied scales."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(1.5 * rng.standard_normal(shape)) * scale
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _reference(x, rht_size=None, fmt=NVFP4, **kw):
  kw.pop("tile", None)
  signs = kw.pop("rht_signs", None)
  if rht_size is not None:
    x = fp4jax.random_hadamard(x, size=rht_size, axis=kw.get("axis", -1), signs=signs)
  return fp4jax.quantize(x, fmt, **kw)


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype != jnp.float32 else np.asarray(a)


def _assert_same(q, r, label):
  assert isinstance(q, fp4jax.QArray), label
  for field in ("shape", "orig_shape", "axis", "block_2d", "fmt"):
    assert getattr(q, field) == getattr(r, field), (label, field, getattr(q, field), getattr(r, field))
  assert jnp.dtype(q.dtype) == jnp.dtype(r.dtype), label
  assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.float8_e4m3fn, label
  assert q.codes.shape == r.codes.shape and q.scales.shape == r.scales.shape, label
  np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(r.codes), err_msg=f"codes: {label}")
  np.testing.assert_array_equal(_bits(q.scales), _bits(r.scales), err_msg=f"scales: {label}")
  np.testing.assert_array_equal(np.asarray(q.amax).view(np.uint32), np.asarray(r.amax).view(np.uint32),
                                err_msg=f"amax: {label}")


def _check_group(cases):
  """cases: list of (label, x, kwargs). One jit for all kernels and references; compares each pair bit for bit."""
  xs = [x for _, x, _ in cases]

  def run(xs):
    return [(quantize_nvfp4(x, interpret=True, **kw), _reference(x, **kw)) for x, (_, _, kw) in zip(xs, cases)]

  results = jax.jit(run)(xs)
  for (label, _, _), (q, r) in zip(cases, results):
    _assert_same(q, r, label)
  return [q for q, _ in results]


def test_layouts_rne_bit_identical():
  cases = [
      ("row f32 2x2 grid", _input((32, 64), jnp.float32, 0), dict(tile=(16, 32))),
      ("row bf16 non-pow2", _input((48, 80), jnp.bfloat16, 1), {}),
      ("row f16 3D", _input((2, 3, 32), jnp.float16, 2), {}),
      ("col axis0 f32", _input((64, 48), jnp.float32, 3), dict(axis=0)),
      ("col axis1 of 3D bf16", _input((2, 32, 24), jnp.bfloat16, 4), dict(axis=1, tile=(16, 8))),
      ("2d pack cols bf16", _input((32, 48), jnp.bfloat16, 5), dict(block_2d=True)),
      ("2d pack rows f32", _input((48, 32), jnp.float32, 6), dict(block_2d=True, axis=0)),
      ("2d 3D pack rows f16", _input((2, 16, 32), jnp.float16, 7), dict(block_2d=True, axis=-2)),
      ("smallest row", _input((1, 16), jnp.float32, 8), {}),
      ("smallest col", _input((16, 1), jnp.bfloat16, 9), dict(axis=0)),
      ("smallest 2d", _input((16, 16), jnp.float32, 10), dict(block_2d=True)),
      ("1D vector", _input((48,), jnp.float32, 11), {}),
  ]
  _check_group(cases)


def test_stochastic_rounding_bit_identical():
  k1, k2 = jax.random.key(1), jax.random.key(2)
  x = _input((32, 64), jnp.bfloat16, 20)
  cases = [
      ("SR32 row bf16", x, dict(rounding="stochastic", key=k1)),
      ("SR32 row other key", x, dict(rounding="stochastic", key=k2)),
      ("SR8 col f32", _input((64, 32), jnp.float32, 21), dict(axis=0, rounding="stochastic", key=k1, random_bits=8)),
      ("SR32 2d", _input((32, 32), jnp.float32, 22), dict(block_2d=True, rounding="stochastic", key=k2)),
  ]
  a, b, *_ = _check_group(cases)
  assert not np.array_equal(np.asarray(a.codes), np.asarray(b.codes)), "different keys must give different draws"


def test_in_kernel_hash_bits_on_multi_tile_grids():
  """The hash generator's bits are computed in the kernel from its tile's element indices: every grid axis
  (P > 1, several row and column tiles), the RHT's padding rows, 8-bit draws, a HashSeed and pad=True must give
  fp4jax.quantize's codes; threefry still reads XLA's bits."""
  k = jax.random.key(7)
  seed = fp4jax.prng.HashSeed(fp4jax.prng.seed_from_key(jax.random.key(8)))
  cases = [
      ("SR row, 4x4 tiles", _input((64, 256), jnp.bfloat16, 50), dict(rounding="stochastic", key=k, tile=(16, 64))),
      ("SR col of 3D (P=3), 4x2 tiles", _input((3, 64, 32), jnp.float32, 51),
       dict(axis=1, rounding="stochastic", key=k, tile=(16, 16))),
      ("SR8 2d, 2x2 tiles", _input((64, 64), jnp.float32, 52),
       dict(block_2d=True, rounding="stochastic", key=k, random_bits=8, tile=(32, 32))),
      ("SR RHT16 col, padded cols", _input((32, 3), jnp.float32, 53), dict(axis=0, rht_size=16, rounding="stochastic",
                                                                          key=k)),
      ("SR RHT16 row, padded rows", _input((1, 32), jnp.bfloat16, 54), dict(rht_size=16, rounding="stochastic",
                                                                            key=k)),
      ("SR pad=True", _input((8, 40), jnp.float32, 55), dict(rounding="stochastic", key=k, pad=True, tile=(4, 16))),
      ("SR HashSeed", _input((32, 64), jnp.float32, 56), dict(rounding="stochastic", key=seed, tile=(16, 32))),
      ("SR threefry", _input((32, 64), jnp.float32, 57), dict(rounding="stochastic", key=k, sr_bits="threefry",
                                                              tile=(16, 32))),
  ]
  _check_group(cases)


def _pallas_grids(f, *args):
  """The grid of every pallas_call in f's jaxpr (nested jaxprs included)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append(tuple(eqn.params["grid_mapping"].grid))
      for v in eqn.params.values():
        for sub in v if isinstance(v, (list, tuple)) else [v]:
          if isinstance(sub, jex_core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jex_core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(f)(*args).jaxpr)
  return found


def test_odd_token_counts_get_few_large_tiles():
  """1021 tokens (prime): tiles used to divide the view, so rows came 1 per tile: 1021 grid steps compiled and in
  interpret mode. The view is now zero-padded to whole tiles (and the outputs cropped): a few steps, same bits."""
  k = jax.random.key(9)
  cases = [
      ("1021 tokens, row SR", _input((1021, 64), jnp.bfloat16, 60), dict(rounding="stochastic", key=k)),
      ("1021 features, col SR (P=2)", _input((2, 32, 1021), jnp.float32, 61),
       dict(axis=1, rounding="stochastic", key=k)),
      ("1021 tokens, row threefry SR8", _input((1021, 32), jnp.float32, 62),
       dict(rounding="stochastic", key=k, sr_bits="threefry", random_bits=8)),
  ]
  for interpret in (True, False):
    for label, x, kw in cases:
      grids = _pallas_grids(lambda x: quantize_nvfp4(x, interpret=interpret, **kw).codes, x)
      assert len(grids) == 1 and np.prod(grids[0]) <= 16, (label, interpret, grids)
  _check_group(cases)


def test_rht_bit_identical():
  k = jax.random.key(3)
  cases = [
      ("RHT16 row bf16", _input((32, 64), jnp.bfloat16, 30), dict(rht_size=16)),
      ("RHT16 col bf16 SR (Wgrad dY^T)", _input((64, 48), jnp.bfloat16, 31),
       dict(axis=0, rht_size=16, rounding="stochastic", key=k)),
      ("RHT4 row f32 (block-diagonal H)", _input((16, 64), jnp.float32, 32), dict(rht_size=4)),
      ("RHT32 col f32", _input((64, 16), jnp.float32, 33), dict(axis=0, rht_size=32)),
      ("RHT16 tiny (padded rows)", _input((1, 32), jnp.float32, 34), dict(rht_size=16)),
      ("RHT16 2d", _input((32, 32), jnp.bfloat16, 35), dict(block_2d=True, rht_size=16)),
      ("RHT16 signs from a key", _input((16, 32), jnp.bfloat16, 36), dict(rht_size=16, rht_signs=jax.random.key(5))),
      ("RHT8 no signs", _input((16, 32), jnp.float32, 37), dict(rht_size=8, rht_signs=jnp.ones((8,)))),
      ("RHT8 pad=True (40 -> 48 after the RHT)", _input((8, 40), jnp.float32, 38), dict(rht_size=8, pad=True)),
  ]
  _check_group(cases)


def test_rht16_sums_in_random_hadamards_order():
  """fp4jax.random_hadamard adds a size-16 group's 16 exact products in a fixed order (rht.mix_fixed_order). The
  kernel did it with a dot over its tile, whose order XLA:CPU picks by shape: float32 columns of 16-64 elements
  then gave an amax one ulp off on 9 of 24 such inputs tried. Interpret mode now adds in the same order."""
  cases = [(f"RHT16 col f32 {shape} seed {seed}", _input(shape, jnp.float32, 40 + seed, scale=8.0),
            dict(axis=0, rht_size=16)) for shape in ((48, 16), (48, 32), (16, 64)) for seed in range(3)]
  _check_group(cases)


@pytest.mark.parametrize("shape, kw", [((32, 40), dict(rht_size=16)), ((24, 16), dict(rht_size=32, axis=0))])
def test_rht_size_must_divide_the_unpadded_axis(shape, kw):
  """fp4jax.random_hadamard refuses an RHT size not dividing the axis; with pad=True the kernel used to transform
  the padded axis instead and return tiles whose outputs past the original length were cropped (for (32, 40) and
  size 16: transformed values up to 2.2 in columns 40..47 dropped, so dequantize gave no RHT of x at all)."""
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  n, size = shape[kw.get("axis", -1)], kw["rht_size"]
  match = f"RHT size {size} does not divide the length {n} "
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda x: _reference(x, pad=True, **kw), x)  # the XLA path's refusal
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda x: quantize_nvfp4(x, pad=True, interpret=True, **kw), x)


def test_rht_of_float16_stays_float32():
  """fp4jax.random_hadamard returns float32 for float16 input (RHT sums can pass 65504); the kernel rounded its
  transform to float16 instead: other codes for ordinary inputs, and inf (a NaN tensor) where x's RHT passes 65504."""
  x = _input((32, 64), jnp.float16, 38)
  cases = [
      ("RHT16 row f16", x, dict(rht_size=16)),
      ("RHT16 col f16 SR", x, dict(axis=0, rht_size=16, rounding="stochastic", key=jax.random.key(4))),
      ("RHT16 f16 past 65504", jnp.full((16, 32), 6e4, jnp.float16), dict(rht_size=16)),
  ]
  *_, big = _check_group(cases)
  assert np.isfinite(float(big.amax)) and np.all(np.isfinite(np.asarray(fp4jax.dequantize(big))))


def test_extreme_inputs_and_padding():
  big = jnp.full((16, 32), np.finfo(np.float32).max, jnp.float32).at[0, 0].set(-np.finfo(np.float32).max)
  with_inf = _input((16, 32), jnp.float32, 40).at[3, 5].set(jnp.inf)
  cases = [
      ("zeros", jnp.zeros((16, 32), jnp.float32), {}),
      ("finfo.max", big, {}),
      ("gradient-sized", _input((32, 32), jnp.float32, 41, scale=1e-7), dict(axis=0)),
      ("inf element", with_inf, {}),
      ("pad row", _input((3, 20), jnp.bfloat16, 42), dict(pad=True)),
      ("pad 2d", _input((20, 24), jnp.float32, 43), dict(block_2d=True, pad=True)),
  ]
  _check_group(cases)


def test_double_block_bit_identical():
  """TetraJet-v2's double-block scales (fp4jax.NVFP4(double_block=True)): each 1x128 group's amax, its FP32 scale,
  the E4M3 block scales and the codes come from one kernel pass, equal to fp4jax.quantize's bit for bit: groups
  across several tiles, a partial last group (144 = 128 + 16: its zero padding must not change its amax), the
  column (Wgrad) layout, RHT + SR as the recipe's backward runs them, and a zero group (amax 0: S_enc = 1)."""
  k = jax.random.key(11)
  # Group magnitudes spread over 16^4, so a scale taken from the wrong group changes codes.
  spread = jnp.asarray(16.0 ** np.arange(-2, 2, dtype=np.float32).repeat(128))  # 4 groups of 128 along the row
  with_zero_group = _input((16, 256), jnp.float32, 75).at[:, 128:].set(0.0)
  cases = [
      ("row, 4 groups, 2 col tiles", _input((32, 512), jnp.float32, 70) * spread, dict(tile=(16, 256))),
      ("row bf16, partial last group", _input((8, 144), jnp.bfloat16, 71), {}),
      ("col (Wgrad) bf16 3 groups, 3D", _input((2, 384, 24), jnp.bfloat16, 72), dict(axis=1)),
      ("col RHT16 SR (dY^T)", (_input((512, 40), jnp.bfloat16, 73) * spread[:, None]).astype(jnp.bfloat16),
       dict(axis=0, rht_size=16, rounding="stochastic", key=k, tile=(128, 8))),
      ("row RHT16 SR8, pad=True", _input((3, 200), jnp.float32, 74),
       dict(rht_size=8, rounding="stochastic", key=k, random_bits=8, pad=True)),
      ("row, a zero group", with_zero_group, {}),
      ("row threefry SR", _input((16, 128), jnp.float16, 76), dict(rounding="stochastic", key=k, sr_bits="threefry")),
  ]
  qs = _check_group([(label, x, dict(kw, fmt=DOUBLE_BLOCK)) for label, x, kw in cases])
  assert qs[0].amax.shape == (32, 4) and qs[1].amax.shape == (8, 2) and qs[2].amax.shape == (2, 3, 24)
  assert qs[0].fmt == DOUBLE_BLOCK
  np.testing.assert_array_equal(np.asarray(qs[5].amax[:, 1]), 0.0)
  # One pass: no tensor-wide amax reduction before the kernel, so a single pallas_call in the jaxpr.
  assert len(_pallas_grids(lambda x: quantize_nvfp4(x, fmt=DOUBLE_BLOCK, rht_size=16, interpret=True).codes,
                           cases[0][1])) == 1


def test_unbiased_sr_scale_rules_bit_identical():
  """The unbiased-SR block scales of `nvfp4(unbiased_sr=...)`: scale_rule "up" (E4M3 rounded up) and headroom (16/17
  of the scale, R = 2688 * 16/17), alone and with RHT, 2D blocks and double-block scales, as fp4jax.quantize."""
  k = jax.random.key(12)
  up, headroom = fp4jax.NVFP4(scale_rule="up"), fp4jax.NVFP4(headroom=True)
  cases = [
      ("up, row SR", _input((32, 64), jnp.bfloat16, 80), dict(fmt=up, rounding="stochastic", key=k)),
      ("up, col RHT16 SR", _input((64, 48), jnp.float32, 81), dict(fmt=up, axis=0, rht_size=16,
                                                                  rounding="stochastic", key=k)),
      ("up, 2d RNE", _input((64, 96), jnp.float32, 82), dict(fmt=up, block_2d=True)),
      ("headroom, row SR8", _input((16, 64), jnp.float16, 83), dict(fmt=headroom, rounding="stochastic", key=k,
                                                                    random_bits=8)),
      ("headroom, col RHT16 SR", _input((32, 32), jnp.bfloat16, 84), dict(fmt=headroom, axis=0, rht_size=16,
                                                                          rounding="stochastic", key=k)),
      ("up + headroom + double-block, row SR", _input((16, 256), jnp.float32, 85),
       dict(fmt=fp4jax.NVFP4(scale_rule="up", headroom=True, double_block=True), rounding="stochastic", key=k)),
  ]
  qs = _check_group(cases)
  # The rules differ from NVIDIA's on these inputs, else the comparison would not tell them apart ("up": scales;
  # headroom: codes, its block scales being NVIDIA's up to rounding).
  for q, (label, x, kw) in zip(qs, cases):
    nvidia = _reference(x, **dict(kw, fmt=NVFP4))
    assert not (np.array_equal(_bits(q.scales), _bits(nvidia.scales))
                and np.array_equal(np.asarray(q.codes), np.asarray(nvidia.codes))), label


def _four_over_six(**kw):
  return fp4jax.NVFP4(scale_rule="4over6", **kw)


def test_four_over_six_bit_identical():
  """Four Over Six (each block scaled to 6 and to 4, the smaller error kept) as fp4jax.quantize bit for bit: the
  three error metrics, 1D blocks along the minor axis and along axis 0, 16x16 blocks packed either way, stochastic
  rounding (both candidates on the same bits, judged on them), with RHT and the unbiased-SR headroom judged on
  round-to-nearest (select_on="nearest"), threefry bits, and tensors whose squared errors would overflow or
  underflow float32 without the per-block power-of-two unit."""
  k = jax.random.key(3)
  cases = [
      ("row f32 mse, 2x2 grid", _input((32, 64), jnp.float32, 90), dict(fmt=_four_over_six(), tile=(16, 32))),
      ("row bf16 SR", _input((32, 64), jnp.bfloat16, 91), dict(fmt=_four_over_six(), rounding="stochastic", key=k)),
      ("col mae", _input((64, 48), jnp.float32, 92), dict(fmt=_four_over_six(select="mae"), axis=0)),
      ("2d absmax bf16", _input((32, 48), jnp.bfloat16, 93), dict(fmt=_four_over_six(select="absmax"),
                                                                  block_2d=True)),
      ("2d packed along rows", _input((48, 32), jnp.float32, 94), dict(fmt=_four_over_six(), block_2d=True, axis=0)),
      ("col RHT16 SR headroom @nearest", _input((64, 32), jnp.bfloat16, 95),
       dict(fmt=_four_over_six(headroom=True, select_on="nearest"), axis=0, rht_size=16, rounding="stochastic",
            key=k)),
      ("row SR8 threefry f16", _input((16, 64), jnp.float16, 96),
       dict(fmt=_four_over_six(), rounding="stochastic", key=k, random_bits=8, sr_bits="threefry")),
      ("zeros", jnp.zeros((16, 32), jnp.float32), dict(fmt=_four_over_six())),
      ("tiny (squares underflow)", _input((32, 32), jnp.float32, 97, scale=1e-30), dict(fmt=_four_over_six())),
      ("huge (squares overflow)", _input((32, 32), jnp.float32, 98, scale=1e30), dict(fmt=_four_over_six())),
      ("pad 2d", _input((20, 24), jnp.float32, 99), dict(fmt=_four_over_six(), block_2d=True, pad=True)),
  ]
  qs = _check_group(cases)
  # Both candidates are chosen (else the comparison could not tell 4/6 from a one-scale rule): blocks whose scale
  # is not the "6" candidate's, E4M3(amax_b * S_enc / 6), took the "4" one's (1.5x larger).
  x, q = cases[0][1], qs[0]
  amax_b = np.abs(np.asarray(x)).reshape(32, 4, 16).max(-1)
  s6 = (amax_b * np.float32(_four_over_six().global_range / float(q.amax)) / np.float32(6)).astype(
      ml_dtypes.float8_e4m3fn)
  chose_four = np.mean(_bits(q.scales) != s6.view(np.uint8))
  assert 0.1 < chose_four < 0.9, chose_four


def _eden(**kw):
  return fp4jax.NVFP4(scale_rule="eden", **kw)


def test_ms_eden_bit_identical():
  """Quartet II's MS-EDEN quantizer as fp4jax.quantize bit for bit: round-to-nearest elements, each group's
  correction sum(y^2) / sum(y q(y)) multiplied into its block scales, which are rounded to nearest or
  stochastically between their E4M3 neighbours on the hash bits of the scales' own indices (computed in the
  kernel), along the minor axis and along axis 0 (the backward's dY^T after a 128-point RHT), groups of 16, 32
  and 128 over several tiles, a partial last group, blocks whose scale underflowed to 0 beside others in their
  group (their x * FLT_MAX must not reach the sums), and extreme magnitudes."""
  k = jax.random.key(4)
  sr = dict(rounding="stochastic", key=k)
  cases = [
      ("row f32, scales to nearest", _input((32, 256), jnp.float32, 110), dict(fmt=_eden())),
      ("row bf16 SR scales", _input((32, 256), jnp.bfloat16, 111), dict(fmt=_eden(), **sr)),
      ("col RHT128 SR (quartet2 dY^T)", _input((256, 48), jnp.bfloat16, 112),
       dict(fmt=_eden(), axis=0, rht_size=128, **sr)),
      ("row group 16, SR8 f16", _input((16, 64), jnp.float16, 113), dict(fmt=_eden(eden_group=16), random_bits=8,
                                                                         **sr)),
      ("row group 32, 4x2 grid", _input((64, 128), jnp.float32, 114), dict(fmt=_eden(eden_group=32), tile=(16, 64),
                                                                           **sr)),
      ("partial last group", _input((8, 144), jnp.float32, 115), dict(fmt=_eden(), **sr)),
      ("col of 3D", _input((2, 128, 24), jnp.bfloat16, 116), dict(fmt=_eden(), axis=1, **sr)),
      ("underflowed blocks", _input((16, 256), jnp.float32, 117, scale=1e-3).at[0, 0].set(1e6),
       dict(fmt=_eden(), **sr)),
      ("zeros", jnp.zeros((16, 128), jnp.float32), dict(fmt=_eden(), **sr)),
      ("tiny", _input((16, 128), jnp.float32, 118, scale=1e-30), dict(fmt=_eden())),
      ("huge", _input((16, 128), jnp.float32, 119, scale=1e30), dict(fmt=_eden(), **sr)),
      ("headroom", _input((16, 256), jnp.float32, 120), dict(fmt=_eden(headroom=True), **sr)),
  ]
  qs = _check_group(cases)
  # The correction and the stochastic scale rounding both change scales here: without either, the comparison
  # could not tell MS-EDEN from NVIDIA's rule with its constants.
  x, kw = cases[1][1], cases[1][2]
  nearest = _reference(x, **dict(kw, rounding="nearest", key=None))
  assert not np.array_equal(_bits(qs[1].scales), _bits(nearest.scales))
  x0, q0 = cases[0][1], qs[0]
  amax_b = np.abs(np.asarray(x0)).reshape(32, 16, 16).max(-1)
  s_enc = np.float32(_eden().global_range / float(q0.amax))
  uncorrected = (amax_b * s_enc / np.float32(_eden().targets[0])).astype(ml_dtypes.float8_e4m3fn)
  corrected = np.mean(_bits(q0.scales) != uncorrected.view(np.uint8))
  assert 0.01 < corrected < 0.5, corrected  # the factor is near 1: it moves a few percent of the scales


def test_block_sums_match_fp4jax():
  """The kernel's per-block errors equal fp4jax.four_over_six.block_error's bit for bit under jit, for every metric
  and block shape: the pairwise summation order (a plain sum differs on many blocks, checked) and the squares
  rounded before they are summed (XLA contracts them into fused multiply-adds otherwise). So do MS-EDEN's group
  sums of per-block sums."""
  from fp4jax import four_over_six
  from pallas_kernels import quantize as quantize_lib
  err = _input((64, 128), jnp.float32, 100, scale=3.0)
  zero = jnp.uint32(0)  # a jit argument: a runtime 0, as in the kernel
  for block in ((1, 16), (16, 1), (16, 16)):
    plain_sum_differs = 0
    for metric in ("mse", "mae", "absmax"):
      kernel = jax.jit(lambda e, z, b=block, m=metric: quantize_lib._block_error(e, b, m, z))(err, zero)
      ref = jax.jit(lambda e, z, b=block, m=metric: four_over_six.block_error(e, b, m, z))(err, zero)
      np.testing.assert_array_equal(np.asarray(kernel).view(np.uint32), np.asarray(ref).view(np.uint32),
                                    err_msg=f"{block} {metric}")
      if metric != "absmax":
        terms = err * err if metric == "mse" else jnp.abs(err)
        plain = jnp.sum(terms.reshape(64 // block[0], block[0], 128 // block[1], block[1]), axis=(1, 3))
        plain_sum_differs += int(jnp.sum(plain != ref))
    if block != (1, 16):  # XLA:CPU's own sum of 16 contiguous elements happens to halve pairwise too
      assert plain_sum_differs > 0, block
  # MS-EDEN's group sums over 8 blocks of per-block sums, along either axis: fp4jax.eden's pairwise order.
  from fp4jax import eden
  for axis, group in ((1, (1, 8)), (0, (8, 1))):
    kernel = jax.jit(lambda e, z, g=group: quantize_lib._pairwise_blocks(e, g, jnp.add, z))(jnp.abs(err), zero)
    ref = jax.jit(lambda e, a=axis: eden._group_sum(e, a, 8))(jnp.abs(err))
    np.testing.assert_array_equal(np.asarray(kernel).view(np.uint32), np.asarray(ref).view(np.uint32),
                                  err_msg=f"group sums along {axis}")


@pytest.mark.parametrize("layout_kw, rht_group, scale_group", [
    (dict(axis=0), 0, 128), (dict(axis=1), 0, 128), (dict(axis=0), 256, 0), (dict(axis=0), 16, 128)])
def test_compiled_tiles_stay_within_the_budget(layout_kw, rht_group, scale_group):
  """A compiled kernel's tile holds a few thousand elements (registers, 4 warps). A long minimum along the rows (a
  128-row double-block group, a 256-point RHT along the tokens) used to come on top of the full column width:
  128 x 256 and 256 x 256 tiles, 4-8x the budget."""
  from pallas_kernels import quantize as quantize_lib
  view, block, pack_axis = quantize_lib.layout((4096, 4096), layout_kw["axis"], False)
  plan = quantize_lib.make_plan(view, block, pack_axis, rht_group, interpret=False, scale_group=scale_group)
  assert plan.tile[0] * plan.tile[1] <= quantize_lib.GPU_TILE_ELEMENTS, plan
  assert plan.tile[pack_axis] % max(rht_group, scale_group, 16) == 0, plan


def test_double_block_nonfinite_groups():
  """A NaN gives its own 1x128 group a NaN amax and an inf an inf amax; the other groups' amaxes, and the codes and
  scales outside the NaN group, are fp4jax.quantize's. Dequantizing is then NaN throughout, as fp4jax's."""
  x = _input((16, 384), jnp.float32, 77).at[2, 7].set(jnp.nan).at[5, 300].set(jnp.inf)
  q = quantize_nvfp4(x, interpret=True, fmt=DOUBLE_BLOCK)
  r = _reference(x, fmt=DOUBLE_BLOCK)
  np.testing.assert_array_equal(np.asarray(q.amax).view(np.uint32), np.asarray(r.amax).view(np.uint32))
  amax = np.asarray(q.amax)
  assert np.isnan(amax[2, 0]) and np.isposinf(amax[5, 2]) and np.isfinite(amax).sum() == amax.size - 2
  codes, ref_codes = np.array(q.codes), np.array(r.codes)
  scales, ref_scales = _bits(q.scales).copy(), _bits(r.scales).copy()
  codes[2, :64] = ref_codes[2, :64] = scales[2, :8] = ref_scales[2, :8] = 0  # the NaN group: platform-dependent
  np.testing.assert_array_equal(codes, ref_codes)
  np.testing.assert_array_equal(scales, ref_scales)
  assert np.isnan(np.asarray(fp4jax.dequantize(q))).all() and np.isnan(np.asarray(fp4jax.dequantize(r))).all()


@pytest.mark.parametrize("shape, rht_size", [((16, 32), None), ((64, 128), None), ((64, 128), 16)])
def test_nan_poisons_the_tensor(shape, rht_size):
  """NaN: amax is NaN and the whole tensor dequantizes to NaN (codes of NaN elements are platform-dependent), also
  past 4096 elements, where XLA:CPU's float max reduction (YNNPACK) drops NaN."""
  x = _input(shape, jnp.float32, 44).at[2, 7].set(jnp.nan)
  q = quantize_nvfp4(x, interpret=True, rht_size=rht_size)
  assert np.isnan(float(q.amax))
  assert np.all(np.isnan(np.asarray(fp4jax.dequantize(q))))


def test_gradient_is_refused():
  """The quantizer is not differentiable: jax.grad through it raises (it would give zeros) without tracing into the
  kernel; a stop_gradient'ed input differentiates to zero."""
  x = _input((16, 32), jnp.float32, 44)
  zero = jax.jit(jax.grad(
      lambda x: jnp.sum(fp4jax.dequantize(quantize_nvfp4(jax.lax.stop_gradient(x), interpret=True)))))(x)
  np.testing.assert_array_equal(np.asarray(zero), 0.0)
  for kw in [{}, dict(rht_size=16, axis=0, rounding="stochastic", key=jax.random.key(1), rht_signs=[1.0, -1.0] * 8)]:
    with pytest.raises(TypeError, match="pallas_kernels.quantize_nvfp4 has no gradient"):
      jax.grad(lambda x, kw=kw: jnp.sum(fp4jax.dequantize(quantize_nvfp4(x, interpret=True, **kw))))(x)


def test_bad_inputs_raise():
  x = jnp.ones((4, 24), jnp.float32)
  with pytest.raises(ValueError, match="multiple of the NVFP4 block size"):
    quantize_nvfp4(x)
  with pytest.raises(ValueError, match="PRNG key"):
    quantize_nvfp4(jnp.ones((4, 32)), rounding="stochastic")
  with pytest.raises(ValueError, match="dtype|supports"):
    quantize_nvfp4(jnp.ones((4, 32), jnp.int32))
  with pytest.raises(ValueError, match="tile"):
    quantize_nvfp4(jnp.ones((4, 32)), tile=(3, 16))
  with pytest.raises(ValueError, match="tile"):
    quantize_nvfp4(jnp.ones((4, 32)), tile=(4, 8))  # not a whole block
  with pytest.raises(ValueError, match="RHT size"):
    quantize_nvfp4(jnp.ones((4, 48)), rht_size=32)
  with pytest.raises(ValueError, match="RHT size"):
    quantize_nvfp4(jnp.ones((4, 32)), rht_size=12)
  with pytest.raises(ValueError, match="axis"):
    quantize_nvfp4(jnp.ones((2, 16, 16)), axis=0, block_2d=True)
  with pytest.raises(ValueError, match="random_bits"):
    quantize_nvfp4(jnp.ones((4, 32)), rounding="stochastic", key=jax.random.key(0), random_bits=16)
  with pytest.raises(ValueError, match="double_block scales need 1D blocks"):
    quantize_nvfp4(jnp.ones((16, 128)), block_2d=True, fmt=DOUBLE_BLOCK)
  with pytest.raises(ValueError, match="multiple of 128"):
    quantize_nvfp4(jnp.ones((16, 128)), fmt=DOUBLE_BLOCK, tile=(16, 64))  # a tile must hold whole groups
  for fmt in (_four_over_six(double_block=True), _eden(double_block=True)):
    with pytest.raises(ValueError, match="4/6 and MS-EDEN with one tensor amax"):
      quantize_nvfp4(jnp.ones((16, 128)), fmt=fmt)
  with pytest.raises(ValueError, match="eden' needs 1D blocks"):
    quantize_nvfp4(jnp.ones((16, 128)), fmt=_eden(), block_2d=True)
  with pytest.raises(ValueError, match="hash generator"):
    quantize_nvfp4(jnp.ones((16, 128)), fmt=_eden(), rounding="stochastic", key=jax.random.key(0),
                   sr_bits="threefry")
  for fmt in (fp4jax.MXFP4(), "mxfp4"):
    with pytest.raises(ValueError, match="NVFP4 only"):
      quantize_nvfp4(jnp.ones((16, 128)), fmt=fmt)


@pytest.mark.parametrize("x_shape, kwargs, match", [
    ((0, 128), {}, "empty"),
    ((16, 128), {"key": jax.random.key(0)}, "stochastic' only"),  # round-to-nearest would ignore the key
    ((16, 128), {"axis": True}, "axis must be an int"),
    ((16, 128), {"axis": 1.0}, "axis must be an int"),
    ((16, 128), {"sr_bits": "philox"}, "sr_bits"),
    ((16, 128), {"rounding": "stochastic", "key": 3}, "key"),
    ((16, 128), {"block_2d": "false"}, "block_2d must be True or False"),
    ((16, 120), {"pad": "no"}, "pad must be True or False"),
    ((16, 128), {"tile": 16}, "tile must be None or"),
])
def test_arguments_are_checked_as_fp4jax_quantize_checks_them(x_shape, kwargs, match):
  """The kernel takes fp4jax.quantize's checks: each of these ran (or crashed deep inside) before."""
  with pytest.raises(ValueError, match=match):
    quantize_nvfp4(jnp.ones(x_shape), **kwargs)


@pytest.mark.parametrize("kw", [
    dict(), dict(axis=0), dict(block_2d=True), dict(block_2d=True, axis=0),
    dict(rounding="stochastic", random_bits=8, axis=0, rht_size=16), dict(rht_size=4, rounding="stochastic"),
    dict(fmt=DOUBLE_BLOCK), dict(fmt=DOUBLE_BLOCK, axis=0, rht_size=16, rounding="stochastic"),
    dict(fmt=fp4jax.NVFP4(scale_rule="up", headroom=True), rounding="stochastic"),
    dict(fmt=_four_over_six()), dict(fmt=_four_over_six(select="mae"), axis=0),
    dict(fmt=_four_over_six(select="absmax"), block_2d=True),
    dict(fmt=_four_over_six(headroom=True, select_on="nearest"), axis=0, rht_size=16, rounding="stochastic"),
    dict(fmt=_eden(), rounding="stochastic"), dict(fmt=_eden(), axis=0, rht_size=128, rounding="stochastic"),
], ids=["row", "col", "2d", "2d_rows", "col_sr8_rht16", "row_sr_rht4", "double_block", "double_block_col_rht_sr",
        "up_headroom_sr", "4over6_row", "4over6_mae_col", "4over6_absmax_2d", "4over6_nearest_col_rht_sr",
        "eden_row_sr", "eden_col_rht128_sr"])
def test_lowers_for_cuda(kw):
  """The compiled (Triton) kernels lower for cuda on a CPU-only machine; the custom call is XLA's Triton call.
  Double-block scales take one kernel (no RHT amax pass before it)."""
  x = jnp.zeros((256, 256), jnp.bfloat16)
  key = jax.random.key(0)

  def f(x, key):
    q = quantize_nvfp4(x, interpret=False, key=key if kw.get("rounding") else None, **kw)
    return q.codes, q.scales, q.amax

  text = platform.lower_for_cuda(f, x, key).as_text()
  assert text.count("xla.gpu.triton") == (2 if "rht_size" in kw and kw.get("fmt") != DOUBLE_BLOCK else 1)


def test_compiled_block_scale_division_is_ieee():
  """Compiled, the encode-scale division is PTX div.rn.f32 (IEEE round to nearest, as fp4jax's) through inline
  asm, not Triton's `/` (div.full.f32, up to 2 ulp off): the asm string is in the kernel lowered for cuda."""
  text = platform.lower_for_cuda(lambda x: quantize_nvfp4(x, interpret=False).codes,
                                 jnp.zeros((256, 256), jnp.bfloat16)).as_text()
  assert "div.rn.f32" in text and "div.full.f32" not in text


def test_platform_reports_cpu():
  ok, why = platform.available(reason=True)
  assert ok is (jax.default_backend() == "gpu" and platform.compute_capability() is not None
                and platform.compute_capability() >= 8.0)
  assert isinstance(why, str) and why
  if jax.default_backend() == "cpu":
    assert platform.resolve_interpret(None) is True
    assert "GPU" in why


def test_gpu_capability_thresholds(monkeypatch):
  """On a (simulated) GPU: compiled kernels need compute capability >= 8.0 (Triton's bf16 dot), the native
  block-scaled MMA path >= 10.0; both thresholds inclusive."""
  class FakeGpu:
    platform, device_kind, core_count = "gpu", "NVIDIA fake", 132

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  try:
    for cc, ok, blackwell in (("7.5", False, False), ("8.0", True, False), ("9.0", True, False),
                              ("10.0", True, True)):
      device = FakeGpu()
      device.compute_capability = cc
      monkeypatch.setattr(jax, "devices", lambda *_, d=device: [d])
      platform._availability.cache_clear()
      assert platform.available() is ok, cc
      assert platform.use_blackwell_path() is (blackwell and platform.has_scaled_matmul()), cc
  finally:
    platform._availability.cache_clear()  # recomputed on the real backend next time


# --- kernel-safe numerics == fp4jax.grids, bit for bit -------------------------------------------------------------

def _all_bf16_values():
  bits = np.arange(1 << 16, dtype=np.uint16)
  return jnp.asarray(bits.view(ml_dtypes.bfloat16).astype(np.float32))


def _e2m1_probe_values():
  """All finite bf16 values, dense uniforms on [-8, 8], and each grid midpoint with its float32 neighbours."""
  bits = np.arange(1 << 16, dtype=np.uint16)
  v = bits.view(ml_dtypes.bfloat16).astype(np.float32)
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 2.0, 4.0], np.float32)
  near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 9)])
  rng = np.random.default_rng(0)
  return jnp.asarray(np.concatenate([v[np.isfinite(v)], rng.uniform(-8, 8, 200_000).astype(np.float32), near, -near]))


def _u32(a):
  return np.asarray(a).astype(np.float32).view(np.uint32)


def test_numerics_match_grids():
  x = _e2m1_probe_values()
  key = jax.random.key(7)

  @jax.jit
  def run(x):
    rb = fp4jax.prng.random_bits(key, x.shape)  # the default generator, as round_e2m1_stochastic draws
    small = jnp.where(jnp.abs(x) < 2.0**22, x, 0.0)
    return (
        numerics.round_half_even(small), jnp.round(small),
        numerics.round_e4m3(x), grids.round_e4m3(x),
        numerics.e2m1_code_nearest(x), grids.e2m1_codes(fp4jax.rounding.round_e2m1_nearest(x)),
        numerics.e2m1_code_stochastic(x, rb, 32),
        grids.e2m1_codes(fp4jax.rounding.round_e2m1_stochastic(x, key, 32)),
        numerics.e2m1_code_stochastic(x, jax.lax.shift_right_logical(rb, jnp.uint32(24)).astype(jnp.uint8), 8),
        grids.e2m1_codes(fp4jax.rounding.round_e2m1_stochastic(x, key, 8)),
        numerics.round_e4m3_up(scale_like), nvfp4.round_e4m3_up(scale_like),
    )

  # Block scales are non-negative: E4M3 values, their midpoints and neighbours, subnormals, 448 and above, NaN.
  grid = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  near = np.concatenate([grid, np.nextafter(grid, np.inf), np.nextafter(grid, 0), (grid[1:] + grid[:-1]) / 2,
                         [448.5, 464, 480, 1e30, np.inf, np.nan, 2.0**-12, 1e-30]]).astype(np.float32)
  scale_like = jnp.asarray(np.concatenate([near, np.abs(np.asarray(x))]))
  out = run(x)
  names = ["round_half_even", "round_e4m3", "e2m1 RNE codes", "e2m1 SR32 codes", "e2m1 SR8 codes", "round_e4m3_up"]
  for name, a, b in zip(names, out[::2], out[1::2]):
    np.testing.assert_array_equal(_u32(a), _u32(b), err_msg=name)
  # round_half_even on halves and near-halves, where floor(x + 0.5) goes wrong.
  v = jnp.asarray([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 4194304.5, 3.5, 0.0, -0.0, -0.3], jnp.float32)
  np.testing.assert_array_equal(_u32(numerics.round_half_even(v)), _u32(jnp.round(v)))


def test_format_codecs_match_ml_dtypes():
  bits = jnp.arange(256, dtype=jnp.int32)
  e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  finite = np.isfinite(e4m3)
  e8m0 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
  codes = jnp.arange(16, dtype=jnp.int32)

  @jax.jit
  def run(bits, e4m3_finite, codes):
    return (numerics.e4m3_value(bits), numerics.e4m3_bits(e4m3_finite), numerics.e8m0_value(bits),
            numerics.e2m1_value(codes), grids.e2m1_decode(codes.astype(jnp.uint8)))

  e4m3_v, e4m3_b, e8m0_v, e2m1_v, e2m1_ref = run(bits, jnp.asarray(e4m3[finite]), codes)
  np.testing.assert_array_equal(np.asarray(e4m3_v), e4m3)
  np.testing.assert_array_equal(np.asarray(e4m3_b), np.arange(256)[finite])
  # Bit for bit, 2^-127 (a float32 subnormal, built from its bits so no flush can touch it) and NaN included.
  np.testing.assert_array_equal(_u32(e8m0_v), _u32(e8m0))
  np.testing.assert_array_equal(_u32(e2m1_v), _u32(e2m1_ref))  # bits: -0.0 for code 8
