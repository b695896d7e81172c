"""recipe backend='pallas': the custom_vjp rule on the Pallas kernels (interpret mode on CPU) equals the XLA path."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax

DIMS = (((1,), (0,)), ((), ()))


@functools.partial(jax.jit, static_argnums=0)
def _fwd_bwd(recipe, x, w, g):
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DIMS, recipe=recipe, key=jax.random.key(3),
                                                   preferred_element_type=jnp.float32), x, w)
  return (y,) + vjp(g)


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4:unbiased_sr=up", "nvfp4:unbiased_sr=headroom"])
def test_pallas_backend_matches_xla(recipe):
  """nvfp4: SR on Dgrad/Wgrad, RHT fused into the Wgrad quantizer, 2D weight reused by Dgrad. The unbiased-SR block
  scales (rounded up, or 16/17 headroom) quantize on the kernel too: no fallback warning."""
  x = jax.random.normal(jax.random.key(0), (32, 64)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (64, 32)) * 0.1
  g = jax.random.normal(jax.random.key(2), (32, 32))
  ref = _fwd_bwd(fp4jax.recipes.get_recipe(recipe), x, w, g)
  with _no_warning():
    out = _fwd_bwd(fp4jax.recipes.get_recipe(recipe).replace(backend="pallas"), x, w, g)
  for a, b in zip(out, ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("recipe", ["four_over_six", "four_over_six:unbiased_sr=headroom,select=mae"])
def test_four_over_six_on_the_kernels(recipe):
  """4/6 (used to fall back to XLA's quantizers): all five quantizers (the RHT + SR Wgrad operands, and with
  unbiased SR the "nearest"-judged headroom candidates, included) and the three GEMMs run on the kernels with no
  fallback warning, and y, dx, dw equal the xla backend's to float32 summation order."""
  _check_gemms_on_the_kernel(fp4jax.recipes.get_recipe(recipe), None, quantizers=5)


def test_quartet2_on_the_kernels():
  """Quartet II (used to fall back to XLA's quantizers): the RNE forward operands and the four MS-EDEN backward
  operands (RHT, corrected and stochastically rounded block scales, the re-quantized Fprop operands included) on
  the quantize kernel, the three GEMMs on the GEMM kernel with the format's own tensor scale, no fallback warning;
  y, dx, dw equal the xla backend's to float32 summation order."""
  _check_gemms_on_the_kernel(fp4jax.recipes.get_recipe("quartet2:rht_size=16"), None, quantizers=6)


def test_ms_eden_with_threefry_bits_falls_back():
  """MS-EDEN's stochastic scales on threefry bits (the reference generator): the kernel computes only the hash
  generator's bits, so those quantizers run on XLA after one warning; the GEMMs still run on the kernel."""
  _check_gemms_on_the_kernel(fp4jax.recipes.get_recipe("quartet2:rht_size=16,sr_bits=threefry"), "hash generator")


def test_ms_eden_round_to_nearest_stays_on_the_kernel_with_threefry_bits():
  """Only MS-EDEN's stochastic scales need the hash generator's bits: a round-to-nearest MS-EDEN quantizer of an
  sr_bits='threefry' recipe runs on the kernel (no fallback warning) and gives fp4jax.quantize's codes and scales."""
  from fp4jax import backends
  backends._fallback.cache_clear()
  recipe = fp4jax.recipes.get_recipe("quartet2:rht_size=16,sr_bits=threefry")
  cfg = dataclasses.replace(recipe.dgrad.lhs, rounding="nearest", rht=False)
  assert cfg.fmt.scale_rule == "eden"
  x = jax.random.normal(jax.random.key(6), (32, 64))
  with _no_warning():
    out = backends.pallas_quantize(x, cfg, axis=1, recipe=recipe, key=None, signs=None)
  ref = fp4jax.quantize(x, cfg.fmt, axis=1)
  np.testing.assert_array_equal(np.asarray(out.codes), np.asarray(ref.codes))
  np.testing.assert_array_equal(np.asarray(out.scales, np.float32), np.asarray(ref.scales, np.float32))


def test_tetrajet_v2_on_the_kernels():
  """TetraJet-v2's double-block operands (an FP32 scale per 1x128 group; they used to fall back to XLA): all six
  quantizers (RHT + SR and the re-quantized Fprop operands included) and the three GEMMs run on the kernels, one
  K step per group, with no fallback warning, and y, dx, dw equal the xla backend's (grouped bf16 GEMMs) to float32
  summation order. Fprop contracts 3 groups, Dgrad 2 (the second partial), Wgrad 2 (over the tokens)."""
  _check_gemms_on_the_kernel(fp4jax.recipes.get_recipe("tetrajet_v2"), None, shape=(256, 384, 160), quantizers=6)


def test_quartet_gemms_on_the_kernel():
  """Quartet on backend='pallas' (used to be refused): MXFP4 with QuEST's clip masks forward and Tseng et al.'s
  rule (code x 2^e x 4/3) in Dgrad and Wgrad. The quantizers and masks stay on XLA (one warning); the three GEMMs
  run on the kernel, whose epilogue applies the 4/3 tensor factor, and y, dx, dw equal the xla backend's to float32
  summation order."""
  recipe = fp4jax.recipes.get_recipe("quartet")
  assert recipe.dgrad.lhs.fmt == fp4jax.MXFP4(scale_rule="tseng") and recipe.fprop.lhs.clip_mask
  _check_gemms_on_the_kernel(recipe, "NVFP4-only")


def _check_gemms_on_the_kernel(recipe, warning, shape=(32, 64, 32), quantizers=0):
  """Runs Fprop/Dgrad/Wgrad of `recipe` on x [M, K] and w [K, N] (shape = (M, K, N)) on the xla and the pallas
  backends (expecting the quantizers' fallback `warning`, or none), checks every GEMM reached the kernel, and at
  least `quantizers` quantize calls, and the outputs agree to summation order."""
  from fp4jax import backends
  m, d_in, n = shape  # (not k: the monkeypatched kernel below takes **k)
  x = jax.random.normal(jax.random.key(0), (m, d_in)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (d_in, n)) * 0.1
  g = jax.random.normal(jax.random.key(2), (m, n))
  ref = _fwd_bwd(recipe, x, w, g)
  backends._fallback.cache_clear()
  calls, quantize_calls = [], []
  kernel, quantize = backends._kernels().fp4_matmul, backends._kernels().quantize_nvfp4
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(backends._kernels(), "fp4_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    mp.setattr(backends._kernels(), "quantize_nvfp4", lambda *a, **k: quantize_calls.append(1) or quantize(*a, **k))
    with pytest.warns(UserWarning, match=warning) if warning else _no_warning():
      out = _fwd_bwd(recipe.replace(backend="pallas"), x, w, g)
  assert len(calls) >= 3  # traced for Fprop (custom_vjp may trace it twice), Dgrad and Wgrad: none fell back
  assert len(quantize_calls) >= quantizers
  for a, b in zip(out, ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_uncovered_operands_fall_back_with_a_warning():
  from fp4jax import backends
  backends._fallback.cache_clear()
  x = jnp.ones((32, 64), jnp.float32)
  cfg = fp4jax.recipes.mxfp4().fprop.lhs
  with pytest.warns(UserWarning, match="NVFP4-only.*XLA path"):
    assert backends.pallas_quantize(x, cfg, axis=1, recipe=fp4jax.recipes.mxfp4(), key=None, signs=None) is None
  nvfp4 = fp4jax.recipes.nvfp4()
  with pytest.warns(UserWarning, match="no clip mask.*XLA path"):  # the caller needs (QArray, mask)
    assert backends.pallas_quantize(x, nvfp4.fprop.lhs, axis=1, recipe=nvfp4, key=None, signs=None,
                                    with_mask=True) is None
  cfg = dataclasses.replace(nvfp4.fprop.lhs, fmt=fp4jax.NVFP4(scale_rule="4over6", double_block=True))
  with pytest.warns(UserWarning, match="4/6 and MS-EDEN take one tensor amax.*XLA path"):
    assert backends.pallas_quantize(x, cfg, axis=1, recipe=nvfp4, key=None, signs=None) is None


def test_pallas_quantize_passes_on_the_recipes_8_bit_sr():
  """random_bits=8 (hardware-style SR: one random byte per element) reaches the kernel: a stochastically rounded
  operand's codes equal fp4jax.quantize's with random_bits=8, which differ from its 32-bit codes."""
  from fp4jax import backends
  recipe = fp4jax.recipes.get_recipe("nvfp4").replace(random_bits=8)
  cfg, key = recipe.dgrad.lhs, jax.random.key(5)
  assert cfg.rounding == "stochastic"
  x = jax.random.normal(jax.random.key(4), (32, 64))
  out = backends.pallas_quantize(x, cfg, axis=1, recipe=recipe, key=key, signs=None)
  ref8, ref32 = (fp4jax.quantize(x, cfg.fmt, axis=1, rounding="stochastic", key=key, random_bits=bits)
                 for bits in (8, 32))
  assert not np.array_equal(np.asarray(ref8.codes), np.asarray(ref32.codes))
  np.testing.assert_array_equal(np.asarray(out.codes), np.asarray(ref8.codes))


class _no_warning:
  def __enter__(self):
    import warnings
    self._cm = warnings.catch_warnings()
    self._cm.__enter__()
    warnings.simplefilter("error")
    # jax >= 0.11 warns when it lowers any Pallas Triton kernel (compiled mode, i.e. on a GPU): jax's own notice
    # (pallas_kernels/platform.py), not the fallback warning these tests look for.
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

  def __exit__(self, *exc):
    return self._cm.__exit__(*exc)


def test_gemm_dispatch_table():
  from fp4jax import backends
  routes = (backends.GemmRoute("NVIDIA H200", 64, "pallas", "test"),
            backends.GemmRoute("NVIDIA H200", 1 << 30, "xla", "test"))
  assert backends.choose_gemm_backend(16, 8192, 8192, "NVIDIA H200", routes) == "pallas"
  assert backends.choose_gemm_backend(8192, 8192, 64, "NVIDIA H200", routes) == "pallas"  # Wgrad over 64 tokens
  assert backends.choose_gemm_backend(128, 8192, 8192, "NVIDIA H200", routes) == "xla"
  assert backends.choose_gemm_backend(128, 8192, 8192, "NVIDIA H100 80GB HBM3", routes) == "pallas"  # no row
  assert backends.GEMM_ROUTES == () or all(r.source for r in backends.GEMM_ROUTES)
  with pytest.raises(ValueError, match="backend"):
    backends.GemmRoute("NVIDIA H200", 64, "cuda", "test")


def test_gemm_dispatch_matches_device_kind_prefixes():
  """A route's device_kind is a prefix of the device's kind (one row covers "NVIDIA H200 NVL" and the like), not
  the other way round; max_min_dim must be >= 1 (0 would route nothing)."""
  from fp4jax import backends
  routes = (backends.GemmRoute("NVIDIA H200", 1 << 30, "xla", "test"),)
  assert backends.choose_gemm_backend(128, 128, 128, "NVIDIA H200 NVL", routes) == "xla"
  assert backends.choose_gemm_backend(128, 128, 128, "NVIDIA H20", routes) == "pallas"
  with pytest.raises(ValueError, match="max_min_dim"):
    backends.GemmRoute("NVIDIA H200", 0, "xla", "test")


def test_gemm_dispatch_applies_on_gpu_only(monkeypatch):
  """pallas_gemm consults the table when the default backend is a GPU (simulated here): a route to 'xla' returns
  None (the caller's XLA path) without a warning; on CPU the table is not consulted."""
  from fp4jax import backends
  a = fp4jax.quantize(jax.random.normal(jax.random.key(0), (16, 32)), "nvfp4", axis=1)
  b = fp4jax.quantize(jax.random.normal(jax.random.key(1), (32, 16)), "nvfp4", axis=0)
  kind = jax.devices()[0].device_kind
  to_xla = (backends.GemmRoute(kind, 1 << 30, "xla", "test"),)
  assert backends.pallas_gemm(a, b, (1, 0), routes=to_xla) is not None  # CPU: interpret-mode kernel
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with _no_warning():
    assert backends.pallas_gemm(a, b, (1, 0), routes=to_xla) is None


def test_gemm_dims_are_m_n_k_for_either_contraction_layout():
  """(M, N, K) of a . b whatever axes are contracted: the dispatch table is looked up with the output's M and N."""
  from fp4jax import backends
  a_MxK, a_KxM = jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((64, 16), jnp.float32)
  b_KxN, b_NxK = jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32)
  assert backends.gemm_dims(a_MxK, b_KxN, (1, 0)) == (16, 32, 64)
  assert backends.gemm_dims(a_MxK, b_NxK, (1, 1)) == (16, 32, 64)
  assert backends.gemm_dims(a_KxM, b_KxN, (0, 0)) == (16, 32, 64)
