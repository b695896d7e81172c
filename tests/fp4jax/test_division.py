"""fp4jax.division: float32 division correctly rounded on every backend, and the quantizers' scales use it.

XLA:GPU compiles a float32 divide to PTX div.full.f32 (up to 2 ulp off); on an H200 that moved NVFP4 block encode
scales by an ulp and flipped 0.02-0.05 % of the codes of device-drawn bfloat16 tensors against the CPU and the Pallas
kernel (benchmarks/gpu/mismatch.py). Off the CPU, `division.divide` runs `divide_by_bits` (the platform's quotient
corrected by an exact integer residual).
It is tested here on the CPU bit for bit against NumPy's IEEE division, with exact and deliberately inexact
candidate quotients, and the quantizers are checked to divide only through it (or by powers of two, which every
divider gets exact).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import fp4jax
from fp4jax import division, eden, fp8, grids, nvfp4
import compiled_hlo

def off_by_ulps(max_ulps: int):
  """A float32 division up to `max_ulps` ulps off (the offset a hash of the operands' bits), as a stand-in for an
  inexact divider such as XLA:GPU's div.full.f32 (<= 2 ulp)."""
  def approx(x, y):
    q = jax.lax.bitcast_convert_type(x / y, jnp.int32)
    h = (jax.lax.bitcast_convert_type(x, jnp.uint32) * jnp.uint32(0x9E3779B1)) ^ jax.lax.bitcast_convert_type(
        y, jnp.uint32)
    k = (jax.lax.shift_right_logical(h, jnp.uint32(7)) % jnp.uint32(2 * max_ulps + 1)).astype(jnp.int32) - max_ulps
    return jax.lax.bitcast_convert_type(q + k, jnp.float32)
  return approx


_DIVIDERS = {"float64": jax.jit(division.divide_in_float64),  # what GPUs run; the others what TPUs would
             "exact": jax.jit(division.divide_by_bits),
             "2 ulp": jax.jit(lambda a, b: division.divide_by_bits(a, b, off_by_ulps(2))),
             "24 ulp": jax.jit(lambda a, b: division.divide_by_bits(a, b, off_by_ulps(24)))}


def assert_ieee_quotients(a, b):
  for name in _DIVIDERS:
    _assert_ieee_quotients(a, b, name)


def _assert_ieee_quotients(a, b, divider):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  got = np.asarray(_DIVIDERS[divider](a, b))
  with np.errstate(all="ignore"):
    want = a / b
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  bad = got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan]  # bit for bit: -0, subnormals and inf too
  assert not bad.any(), (f"{divider} candidates: {bad.sum()} quotients differ, e.g. {a[~nan][bad][:3]} / "
                         f"{b[~nan][bad][:3]}: {got[~nan][bad][:3]} vs {want[~nan][bad][:3]}")


def test_divide_by_bits_on_random_bit_patterns():
  rng = np.random.default_rng(0)  # every exponent: overflow, gradual underflow, NaN and inf operands included
  a = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
  b = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
  assert_ieee_quotients(a, b)


def test_divide_by_bits_on_nearby_operands_and_scale_like_quotients():
  rng = np.random.default_rng(1)
  a = rng.standard_normal(1 << 18).astype(np.float32)
  assert_ieee_quotients(a, (a * (1 + rng.standard_normal(a.size) * 1e-6)).astype(np.float32))  # quotients ~1
  s_b = (rng.integers(1, 127, 1 << 16).astype(np.uint8).view(jnp.float8_e4m3fn)).astype(np.float32)
  amax = np.abs(rng.standard_normal(s_b.size) * np.exp(rng.standard_normal(s_b.size) * 3)).astype(np.float32)
  s_dec = (np.float32(1) / (np.float32(2688) / amax)).astype(np.float32)
  assert_ieee_quotients(np.ones_like(s_b), s_b * s_dec)  # the NVFP4 block encode scale
  assert_ieee_quotients(np.full_like(amax, 2688), amax)  # the global encode scale


def test_divide_by_bits_on_subnormals_and_range_limits():
  rng = np.random.default_rng(2)
  sub = rng.integers(1, 1 << 23, 1 << 16).astype(np.uint32).view(np.float32)
  normal = (rng.standard_normal(sub.size) * 4).astype(np.float32)
  assert_ieee_quotients(sub, normal)
  assert_ieee_quotients(normal, sub)
  assert_ieee_quotients(sub, np.roll(sub, 1))
  k = np.arange(1, 1 << 16, dtype=np.uint32)
  near_one = (np.float32(1).view(np.uint32) + k).view(np.float32)
  tiny = np.float32(np.finfo(np.float32).tiny)
  for scale in (1.0, 2.0**10, 2.0**22, 2.0**23, 2.0**24):  # results from the smallest normal down to 0
    assert_ieee_quotients(np.full(k.shape, tiny), near_one * np.float32(scale))
  big = np.float32(np.finfo(np.float32).max)
  assert_ieee_quotients(np.full(k.shape, big), (np.float32(1).view(np.uint32) - k).view(np.float32))  # overflow


def test_divide_by_bits_on_special_values():
  sp = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 3.0, 1e-45, -1e-45, np.finfo(np.float32).tiny,
                 np.finfo(np.float32).max, 5.877472e-39], np.float32)
  a, b = np.meshgrid(sp, sp)
  assert_ieee_quotients(a.ravel(), b.ravel())


def test_divide_broadcasts_matches_cpu_division_and_differentiates():
  a = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(division.divide(1.0, a)), np.float32(1) / np.asarray(a))
  np.testing.assert_array_equal(np.asarray(jax.jit(division.divide)(a, a[0])), np.asarray(a) / np.asarray(a[0]))
  da, db = jax.grad(lambda x, y: jnp.sum(division.divide(x, y)), argnums=(0, 1))(a, a + 3.0)
  np.testing.assert_allclose(da, 1 / (a + 3.0), rtol=1e-6)
  np.testing.assert_allclose(db, -a / (a + 3.0) ** 2, rtol=1e-5)


def _lowered(fn, args, platform):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_each_platform_lowers_its_division():
  x = jnp.ones((16,), jnp.float32)
  text = {p: _lowered(division.divide, (x, x), p) for p in ("cpu", "cuda", "rocm", "tpu")}
  for p in ("cuda", "rocm"):  # the float64 quotient
    assert "tensor<16xf64>" in text[p] and "count_leading_zeros" not in text[p], p
  assert "count_leading_zeros" in text["tpu"] and "f64" not in text["tpu"]  # the integer correction
  assert "count_leading_zeros" not in text["cpu"] and "f64" not in text["cpu"]  # XLA:CPU's own divide


def test_float64_division_widens_its_operands_from_bits():
  """A chain of divisions (S_dec = 1 / (2688 / amax)) lowered for the GPU converts no float32 to float64: XLA:GPU's
  excess-precision rewrite would delete such a convert after the float64 -> float32 rounding of the first quotient,
  and the second division would read the unrounded quotient (the bfloat16 bug of the first H200 run, in float64)."""
  chain = lambda amax: division.divide(1.0, division.divide(2688.0, amax))
  text = _lowered(chain, (jnp.float32(3.0),), "cuda")
  assert "tensor<f64>" in text
  assert not re.search(r"stablehlo\.convert %\S+ : \(tensor<f32>\) -> tensor<f64>", text), text
  np.testing.assert_array_equal(np.asarray(chain(jnp.float32(3.0))), np.float32(1) / (np.float32(2688) / np.float32(3)))


def raw_float_divisions(fn, *args) -> int:
  """float `div` equations in the jaxpr of `fn` (nested ones too), not counting the branches of a
  platform-dependent choice (division.divide's: its CPU branch is XLA:CPU's IEEE divide)."""
  count = 0

  def walk(jaxpr):
    nonlocal count
    platform_vars = set()
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "platform_index":
        platform_vars.update(eqn.outvars)
        continue
      if name == "cond" and eqn.invars and eqn.invars[0] in platform_vars:
        continue
      if name == "div" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        count += 1
      for p in eqn.params.values():
        for s in p if isinstance(p, (tuple, list)) else (p,):
          sub = s.jaxpr if isinstance(s, jcore.ClosedJaxpr) else s if isinstance(s, jcore.Jaxpr) else None
          if sub is not None:
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return count


X = jnp.asarray(np.random.default_rng(4).standard_normal((64, 128)), jnp.float32)


def test_the_checker_counts_raw_divisions():
  assert raw_float_divisions(lambda x: x / (x + 1.0), X) == 1
  assert raw_float_divisions(lambda x: division.divide(x, x + 1.0), X) == 0


@pytest.mark.parametrize("name,fn", [
    ("global encode scale", lambda x: nvfp4.global_encode_scale(jnp.max(jnp.abs(x)))),
    ("global decode scale", lambda x: nvfp4.global_decode_scale(jnp.max(jnp.abs(x)))),
    ("block encode scale", lambda x: nvfp4.block_encode_scale(jnp.abs(x[:, :8]), 3.0)),
    ("FP8 block scales", lambda x: fp8.scales(jnp.abs(x))),
    ("divide by constant", lambda x: grids.divide_by_constant(x, 448.0)),
    ("MS-EDEN correction", lambda x: eden.correction(x, jnp.round(x), (1, 16), 1, jnp.uint32(0))),
])
def test_scale_arithmetic_divides_correctly_rounded(name, fn):
  assert raw_float_divisions(fn, X) == 0, name


@pytest.mark.parametrize("fmt,kw,allowed", [
    # The one raw division left: round_e4m3(per_block=True) divides by a power of two (exact on any divider).
    ("nvfp4", dict(), 1), ("nvfp4", dict(block_2d=True), 1), ("nvfp4", dict(axis=0, rounding="stochastic"), 1),
    ("fp8", dict(), 0), ("nvfp4_eden", dict(rounding="stochastic"), 2)])  # its scales' neighbours: once more
def test_quantizers_divide_only_by_powers_of_two_outside_division(fmt, kw, allowed):
  assert raw_float_divisions(lambda x: grids.round_e4m3(x, per_block=True), X) == 1
  key = jax.random.key(0) if kw.get("rounding") else None
  fmt = fp4jax.formats.NVFP4(scale_rule="eden") if fmt == "nvfp4_eden" else fmt
  assert raw_float_divisions(lambda x: fp4jax.quantize(x, fmt, key=key, **kw).codes, X) <= allowed


def _layer_fwd_bwd(x, w):
  """One nvfp4 linear layer's forward and backward (2D weight blocks, Wgrad's output scaling, SR on dY)."""
  loss = lambda x, w: jnp.sum(fp4jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4",
                                                 key=jax.random.key(0), preferred_element_type=jnp.float32))
  return jax.grad(loss, argnums=(0, 1))(x, w)


_ONCE_CASES = [
    ("NVFP4 2D weight blocks", lambda x: fp4jax.quantize(x, "nvfp4", block_2d=True).codes, (X,)),
    ("NVFP4 rows, SR", lambda x: fp4jax.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(1)).codes,
     (X,)),
    ("FP8 blocks", lambda x: fp4jax.fake_quant(x, "fp8"), (X,)),
    ("nvfp4 layer fwd+bwd (bf16-mode GEMM factors)", _layer_fwd_bwd, (X[:, :64].T, X[:, :64])),
]


@pytest.mark.parametrize("name,fn,args", _ONCE_CASES, ids=[c[0] for c in _ONCE_CASES])
def test_quotients_computed_once_off_the_cpu_only(name, fn, args):
  """Off the CPU, every scale quotient a quantizer or a GEMM factor broadcasts sits behind an optimization barrier
  (else XLA:GPU recomputes its ~70 integer operations in every element of the consumer); the CPU's programs have
  none (its native divide is not duplicated), so they are the ones measured and recorded before."""
  assert "optimization_barrier" in _lowered(fn, args, "cuda"), name
  assert "optimization_barrier" not in _lowered(fn, args, "cpu"), name


def test_computed_once_returns_its_arguments():
  a, b = jnp.float32(3.0), jnp.arange(4, dtype=jnp.float32)
  out = jax.jit(division.computed_once)(a, b)
  assert isinstance(out, tuple) and len(out) == 2
  np.testing.assert_array_equal(out[0], a)
  np.testing.assert_array_equal(out[1], b)


# What marks a quotient in XLA's optimized HLO: a float64 divide (divide_in_float64), or divide_by_bits' clz.
_QUOTIENT_MARK = r"f64\[[\d,]*\]\S* divide\(|count-leading-zeros\("


def test_no_quotient_is_recomputed_per_element_on_sm90():
  """Compiled for sm_90 without a GPU (XLA's deviceless AOT; needs jax >= 0.11 with a CUDA plugin, else skipped):
  in one nvfp4 layer's forward and backward, no kernel that writes as many values as a weight or an activation
  contains a quotient; per-block and scalar kernels do (and some must: the test would pass on no division)."""
  from benchmarks.gpu import aot
  ok, why = aot.supported()
  if not ok:
    pytest.skip(f"no deviceless CUDA compile here: {why}")
  # At this size XLA:GPU put the weight quantizer's quotients into its per-element kernel (bf16[1024,1024]) until
  # the quotients went behind computed_once's barrier; per-block arrays here have at most 1024^2 / 16 entries.
  text = aot.compiled_hlo(_layer_fwd_bwd, jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
                          jax.ShapeDtypeStruct((1024, 1024), jnp.float32))
  per_element = [(i.type, i.calls) for i in compiled_hlo.instructions(compiled_hlo.entry(text))
                 if i.opcode == "fusion" and max(compiled_hlo.sizes(i.type)) >= 1024 * 1024 // 4
                 and re.search(_QUOTIENT_MARK, compiled_hlo.body(text, i))]
  assert not per_element, per_element
  assert re.search(_QUOTIENT_MARK, text)
