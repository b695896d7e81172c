"""GEMM modes of the xla backend: "bf16" (exact code x block scale operands, per-tensor scales after the GEMM) against
the "f32" reference (dequantized float32 values, HIGHEST precision): equal within float32 rounding (the summation
order, and the reference's rounded decoded elements and products).
"""

import functools
import importlib
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import gemm
from fp4jax import recipes
from fp4jax.quantize import dequantize, quantize

dg = importlib.import_module("fp4jax.dot_general")  # the module (fp4jax.dot_general is also the function)
DN = (((1,), (0,)), ((), ()))
M, K, N = 64, 128, 64
EPS = 2.0**-24  # float32 unit roundoff


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  x[3, 5] = 40.0  # an outlier: blocks with very different scales in one GEMM
  w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
  g = (rng.standard_normal((M, N)) * 1e-5).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)


@functools.partial(jax.jit, static_argnames="recipe")
def _fwd_and_grads(x, w, g, key, recipe):
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key), x, w)
  return (y,) + vjp(g)


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4:stochastic_rounding=false,rht=false", "mxfp4",
                                  "fp8:scaling=tensor"])
def test_bf16_and_f32_modes_agree_within_float32_rounding(name):
  """y, dx and dW of both modes differ by at most (K + 3) float32 roundings of |A| @ |B| (the operands' magnitudes):
  K - 1 additions in some order, plus the reference's rounded products and the per-tensor scale multiplications."""
  x, w, g = _inputs()
  key = jax.random.key(4)
  base = recipes.get_recipe(name)
  ref = _fwd_and_grads(x, w, g, key, base.replace(gemm_mode="f32"))
  got = _fwd_and_grads(x, w, g, key, base.replace(gemm_mode="bf16"))
  # Magnitude bounds |A| @ |B| from the same quantized operands (the forward's; the backward's are of similar size).
  xq, wq = dg.fprop_operands(x, w, base, key)
  bound = (K + 3) * EPS * (np.abs(np.asarray(dequantize(xq), np.float64)) @ np.abs(np.asarray(dequantize(wq),
                                                                                               np.float64)))
  y_ref, y = np.asarray(ref[0], np.float64), np.asarray(got[0], np.float64)
  assert np.all(np.abs(y - y_ref) <= bound), np.max(np.abs(y - y_ref) / bound)
  for a, b in zip(ref[1:], got[1:]):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), np.max(np.abs(a - b)) / np.max(np.abs(a))
  if name.startswith("nvfp4"):  # the global scales moved after the GEMM: really another computation
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ref, got))


def test_bf16_mode_runs_bf16_dots_also_under_vmap():
  """"bf16" multiplies bfloat16 operands on every platform (XLA:CPU too: ~15% faster per layer here than float32);
  a vmapped layer (batched bf16 x bf16 -> float32 dots) runs and matches the f32 mode to summation order."""
  x, w, g = _inputs(1)
  base = recipes.get_recipe("nvfp4")
  hlo = jax.jit(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=base.replace(gemm_mode="bf16"),
                                                key=jax.random.key(0))).lower(x, w).as_text()
  dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
  assert dots and all("xbf16>, tensor<" in line and "xf32>" in line.split("->")[-1] for line in dots), dots
  xs, ws, gs = jnp.stack([x, -x]), jnp.stack([w, 2 * w]), jnp.stack([g, g])
  run = lambda mode: jax.vmap(functools.partial(_fwd_and_grads, recipe=base.replace(gemm_mode=mode)),
                              in_axes=(0, 0, 0, None))(xs, ws, gs, jax.random.key(4))
  for a, b in zip(run("f32"), run("bf16")):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), np.max(np.abs(a - b)) / np.max(np.abs(a))


@pytest.mark.parametrize("fmt,kwargs", [
    ("nvfp4", dict(axis=1)), ("nvfp4", dict(axis=0, block_2d=True)), ("mxfp4", dict(axis=0)),
    (fp4jax.FP8(scaling="tensor"), dict(axis=1)),
])
def test_bf16_operand_times_factor_is_the_dequantized_value_bit_for_bit(fmt, kwargs):
  x = np.random.default_rng(1).standard_t(3, (64, 64)).astype(np.float32)
  q = quantize(jnp.asarray(x), fmt, **kwargs)
  values, factor = gemm.bf16_values(q)
  assert values.dtype == jnp.bfloat16
  want = np.asarray(dequantize(q, jnp.float32)).view(np.uint32)
  np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32) * factor).view(np.uint32), want)


def test_non_finite_tensor_poisons_the_bf16_product_like_dequantize():
  x = np.ones((16, 32), np.float32)
  x[2, 3] = np.inf
  values, factor = gemm.bf16_values(quantize(jnp.asarray(x), "nvfp4"))
  assert np.isnan(np.asarray(factor))
  assert np.all(np.isnan(np.asarray(dequantize(quantize(jnp.asarray(x), "nvfp4")))))
  del values


def test_a_huge_activation_against_a_small_weight_stays_finite_in_bf16_mode():
  """The output factors went on as (out * fa) * fb only: with amax_x ~ 1e36 and amax_w ~ 0.03, out * fa overflowed
  for |y| above ~1e33 and 222 of 256 outputs were inf where the f32 mode gives the finite product (max 1.2e35)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 16)) * 1e36, jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 16)) * 0.01, jnp.float32)
  ys = {m: np.asarray(fp4jax.dot_general(x, w, DN, recipe=recipes.nvfp4(gemm_mode=m), key=jax.random.key(0)))
        for m in ("f32", "bf16")}
  assert np.all(np.isfinite(ys["f32"])) and np.all(np.isfinite(ys["bf16"]))
  np.testing.assert_allclose(ys["bf16"], ys["f32"], rtol=0, atol=16 * EPS * np.max(np.abs(ys["f32"])))
  # In range, the bits are (out * fa) * fb's; the other order only where that overflows.
  out = jnp.asarray([[3.0e38, -1.5e3, 0.0, jnp.inf]], jnp.float32)
  fa, fb = jnp.float32(1e10), jnp.float32(3e-12)
  got = np.asarray(gemm.scale_output(out, fa, fb))
  np.testing.assert_array_equal(got[0, 1:], np.asarray((out * fa) * fb)[0, 1:])
  assert got[0, 0] == np.float32(np.float32(3.0e38) * fb) * np.float32(1e10) and np.isfinite(got[0, 0])


def test_fp8_block_scales_are_not_exact_in_bf16_so_the_gemm_stays_f32():
  """FP8's float32 block scales (amax / 448) have no exact bf16 form: "bf16" mode runs the reference GEMM."""
  x, w, g = _inputs(2)
  assert gemm.bf16_values(quantize(x, "fp8", axis=1)) is None
  key = jax.random.key(0)
  a = _fwd_and_grads(x, w, g, key, recipes.fp8(gemm_mode="f32"))
  b = _fwd_and_grads(x, w, g, key, recipes.fp8(gemm_mode="bf16"))
  for u, v in zip(a, b):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_auto_mode_is_bf16_on_accelerators_and_avx512_cpus_f32_on_other_cpus():
  assert gemm.auto_gemm_mode("gpu") == gemm.auto_gemm_mode("tpu") == "bf16"
  assert gemm.auto_gemm_mode("gpu", frozenset({"avx2"})) == "bf16"  # the host CPU does not matter there
  assert gemm.auto_gemm_mode("cpu", frozenset({"fpu", "avx", "avx2", "fma"})) == "f32"  # AMD Zen 3
  assert gemm.auto_gemm_mode("cpu", frozenset({"avx2", "fma", "avx512f", "avx512bw"})) == "bf16"
  assert gemm.auto_gemm_mode("cpu", frozenset({"amx_bf16"})) == "bf16"
  assert gemm.auto_gemm_mode("cpu", frozenset({"fp", "asimd", "bf16"})) == "f32"  # ARM: never measured
  assert gemm.auto_gemm_mode("cpu") == "f32"  # no /proc/cpuinfo


def test_auto_mode_resolves_for_this_machine_and_explicit_modes_stay():
  r = recipes.nvfp4()
  assert r.gemm_mode == "auto"
  assert dg.resolve_gemm_mode(r) == gemm.auto_gemm_mode(jax.default_backend(), gemm.cpu_flags())
  assert dg.resolve_gemm_mode(r.replace(gemm_mode="f32")) == "f32"
  assert dg.resolve_gemm_mode(r.replace(gemm_mode="bf16")) == "bf16"


def test_cpu_flags_read_this_machine():
  flags = gemm.cpu_flags()
  if os.path.exists("/proc/cpuinfo") and platform.machine() == "x86_64":
    assert "sse2" in flags  # every x86_64 CPU has it: the flags line was found and split
  assert all(isinstance(f, str) and f and " " not in f for f in flags)


@functools.partial(jax.jit, static_argnames=("recipe", "levels"))
def _vmapped_grads(x, w, g, key, recipe, levels):
  """_fwd_and_grads under nested vmaps: `levels` holds the in_axes of (x, W, dY, key), innermost first."""
  fn = functools.partial(_fwd_and_grads, recipe=recipe)
  for in_axes in levels:
    fn = jax.vmap(fn, in_axes=in_axes)
  return fn(x, w, g, key)


# Only the SR keys, only dY or only x batched: under the first two, Wgrad's dot has an unbatched lhs contracted on its
# first axis and a batched rhs, the form XLA:CPU (jax 0.10.2) cannot run as bf16 x bf16 -> f32 ("Unsupported element
# type for DotThunk::Execute: BF16 x BF16 = F32"); the SR unbiasedness test (a vmap over keys) hit it.
KEYS, DY, X = (None, None, None, 0), (None, None, 0, None), (0, None, None, None)


@pytest.mark.parametrize("levels", [(KEYS,), (DY,), (X,), (DY, KEYS)], ids=["keys", "dy", "x", "dy_then_keys"])
def test_bf16_mode_runs_under_vmap_with_unbatched_operands(levels):
  x, w, g = _inputs(4)
  key = jax.random.key(6)
  args = [x, w, g, key]
  for in_axes in levels:  # two entries along axis 0 of each batched argument, innermost level first
    for i, ax in enumerate(in_axes):
      if ax is not None:
        args[i] = jax.random.split(key, 2) if i == 3 else jnp.stack([args[i], -0.5 * args[i]])
  base = recipes.nvfp4()
  ref = _vmapped_grads(*args, recipe=base.replace(gemm_mode="f32"), levels=levels)
  got = _vmapped_grads(*args, recipe=base.replace(gemm_mode="bf16"), levels=levels)
  for a, b in zip(ref, got):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)  # materialized: the failure came at run time
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), np.max(np.abs(a - b)) / np.max(np.abs(a))


def test_recipe_fields_in_cli_strings_names_and_table():
  r = recipes.get_recipe("nvfp4:sr_bits=threefry,gemm_mode=bf16")
  assert (r.sr_bits, r.gemm_mode, r.name) == ("threefry", "bf16", "nvfp4-threefry-gemm:bf16")
  assert "sr_bits=threefry" in r.table() and "gemm_mode=bf16" in r.table()
  assert recipes.nvfp4().name == "nvfp4" and recipes.nvfp4().sr_bits == "hash"
  assert recipes.get_recipe("nvfp4:stochastic_rounding=false,sr_bits=threefry").name == "nvfp4-sr"
  assert recipes.get_recipe("fp8:gemm_mode=f32").name == "fp8-gemm:f32"
  assert recipes.get_recipe("mxfp4:sr_bits=threefry").sr_bits == "threefry"
  with pytest.raises(ValueError, match="sr_bits"):
    recipes.get_recipe("nvfp4:sr_bits=philox")
  with pytest.raises(ValueError, match="gemm_mode"):
    recipes.nvfp4(gemm_mode="fp16")


def test_threefry_recipe_draws_the_threefry_bits():
  """dgrad's SR operand under sr_bits="threefry" is quantize(dY, ..., sr_bits="threefry") with the GEMM's key."""
  _, _, g = _inputs(3)
  key = jax.random.key(5)
  for sr_bits in ("hash", "threefry"):
    r = recipes.nvfp4(sr_bits=sr_bits)
    q = dg.dgrad_gradient(g, r, key)
    want = quantize(g, "nvfp4", axis=1, rounding="stochastic", key=jax.random.fold_in(key, 1), sr_bits=sr_bits)
    np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(want.codes))
