"""The rule's GEMM-only operands as gemm.Unit (no packed codes): the same GEMM inputs, bit for bit.

`gemm.unit_values(x, ...)` must equal `gemm.bf16_values(quantize(x, ...))` and `gemm.f32_unit(x, ...)` must equal
`gemm.f32_values(quantize(x, ...))`; the custom_vjp rule, which takes that
path for operands only an xla-backend GEMM reads (both GEMM modes), must equal the public pieces on QArrays
(layer_operands, fprop, dgrad, wgrad) for every preset recipe.
"""

import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import gemm
from fp4jax import recipes
from fp4jax import rht
import compiled_hlo
import reference as ref

dg = importlib.import_module("fp4jax.dot_general")  # the module (fp4jax.dot_general is the function)

FORMATS = ["nvfp4", fp4jax.NVFP4(scale_rule="up"), fp4jax.NVFP4(scale_rule="4over6"),
           fp4jax.NVFP4(scale_rule="eden", eden_group=32), fp4jax.NVFP4(double_block=True),
           "mxfp4", fp4jax.MXFP4(scale_rule="tseng"), fp4jax.MXFP4(scale_rule="quest")]
LAYOUTS = [dict(axis=1), dict(axis=0), dict(axis=0, block_2d=True),
           dict(axis=1, rounding="stochastic", key=jax.random.key(4)),
           dict(axis=0, rounding="stochastic", key=jax.random.key(5), random_bits=8)]


def _edge_tensor(dtype):
  x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32) * 3
  x = x.at[0, 0].set(0.0).at[1, :16].set(0.0).at[2, 3].set(-0.0).at[5, 5].set(1e-30).at[7, 7].set(1e30)
  return x.astype(dtype)


def _bits(a):
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


# MS-EDEN corrects 1D blocks only (eden.py refuses 2D blocks), and double-block groups are 1x128 (1D too).
CASES = [(f, l) for f in FORMATS for l in LAYOUTS
         if not ((getattr(f, "scale_rule", "") == "eden" or getattr(f, "double_block", False)) and l.get("block_2d"))]


@pytest.mark.parametrize("fmt,layout", CASES,
                         ids=[f"{f}-" + ",".join(f"{k}={v}" for k, v in l.items() if k != "key") for f, l in CASES])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_unit_values_equal_bf16_values_of_the_qarray(fmt, layout, dtype):
  x = _edge_tensor(dtype)
  # One program for both (the suite's time is compiles); each path's ops are its own, XLA only shares equal work.
  want, got = jax.jit(lambda x: (gemm.bf16_values(fp4jax.quantize(x, fmt, **layout)),
                                 gemm.unit_values(x, fmt, **layout)))(x)
  assert isinstance(got, gemm.Unit) and got.values.dtype == jnp.bfloat16 and got.values.shape == x.shape
  np.testing.assert_array_equal(_bits(got.values), _bits(want[0]))
  np.testing.assert_array_equal(_bits(got.factor), _bits(want[1]))


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_4over6"])
@pytest.mark.parametrize("mode", ["bf16", "f32"])
def test_gemm_operands_decode_with_float32_scales_not_float8_ones(fmt, mode):
  """The GEMM operands are decoded with the float32 block scales the quantizer rounded, not the stored E4M3 scales
  read back: XLA:CPU fused that float8 round trip into every element's loop (20 % of the `small` nvfp4 train step).
  No computation of the compiled program that yields per-element values holds a float8 value."""
  x = jax.random.normal(jax.random.key(1), (64, 128), jnp.float32)
  unit = gemm.unit_values if mode == "bf16" else gemm.f32_unit
  layout = dict(axis=0, rounding="stochastic", key=jax.random.key(2))
  hlo = compiled_hlo.compiled_text(lambda x: unit(x, fmt, **layout), x)
  per_element = [c for c in compiled_hlo.computations(hlo) if x.size in compiled_hlo.result_sizes(c)]
  assert per_element
  assert not [c.name for c in per_element if "f8e4m3fn" in c.text]


def test_unit_values_of_a_non_finite_tensor_poison_the_factor():
  x = _edge_tensor(jnp.float32).at[3, 3].set(jnp.nan)
  u = gemm.unit_values(x, "nvfp4", axis=1)
  assert np.isnan(float(u.factor))
  assert np.isnan(np.asarray(gemm.f32_values(u))).all()


def test_formats_without_an_exact_bf16_form_have_no_unit():
  x = _edge_tensor(jnp.float32)
  assert gemm.unit_values(x, fp4jax.FP8(), axis=1) is None  # float32 block scales: the rule takes f32_unit
  # An f32_unit has no bfloat16 form either: a bf16-mode GEMM must multiply it at HIGHEST precision, not at the
  # backend's default (TF32 on NVIDIA GPUs).
  assert gemm.bf16_values(gemm.f32_unit(x, fp4jax.FP8(), axis=1, pad=True)) is None
  assert gemm.bf16_values(gemm.unit_values(x, "nvfp4", axis=1)) is not None


@pytest.mark.parametrize("name", [n for n in recipes.PRESETS if n != "bf16"])
def test_bf16_mode_multiplies_float32_operands_at_highest_precision(name):
  """Every float32 x float32 dot of the rule (forward and backward) in bf16 mode is at HIGHEST precision: FP8's
  block-scaled operands come as float32 Units, which GPUs would otherwise multiply in TF32."""
  recipe = recipes.get_recipe(name).replace(gemm_mode="bf16")
  x, w = jnp.ones((128, 128), jnp.float32), jnp.ones((128, 128), jnp.float32)
  dims = (((1,), (0,)), ((), ()))

  def step(x, w, dy):
    f = lambda a, b: fp4jax.dot_general(a, b, dims, recipe=recipe, key=jax.random.key(0),
                                        preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  text = jax.jit(step).lower(x, w, x).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert dots
  f32_dots = [d for d in dots if re.search(r"\(tensor<[0-9x]*xf32>, tensor<[0-9x]*xf32>\)", d)]
  assert all("HIGHEST" in d for d in f32_dots), [d for d in f32_dots if "HIGHEST" not in d]
  if name == "fp8":
    assert len(f32_dots) == 3  # Fprop, Dgrad and Wgrad all on the float32 path


F32_FORMATS = ["nvfp4", fp4jax.NVFP4(double_block=True), fp4jax.NVFP4(scale_rule="4over6"), "mxfp4",
               fp4jax.MXFP4(scale_rule="tseng"), fp4jax.FP8(), fp4jax.FP8(scaling="tensor"), fp4jax.MXFP8()]
F32_LAYOUTS = [dict(axis=1), dict(axis=0), dict(axis=1, rounding="stochastic", key=jax.random.key(6))]


def _edge_tensor_128(dtype, poison=None):
  """128 x 256 (whole FP8 blocks along either axis) with the edge values, and a NaN or inf at [3, 3] if asked."""
  x = jnp.tile(_edge_tensor(jnp.float32), (2, 3))[:128, :256]
  return (x if poison is None else x.at[3, 3].set(poison)).astype(dtype)


# Stochastic rounding is for the FP4 formats only (quantize refuses it for FP8 and MXFP8).
F32_CASES = [(f, l) for f in F32_FORMATS for l in F32_LAYOUTS
             if "rounding" not in l or fp4jax.get_format(f).is_fp4]


@pytest.mark.parametrize("fmt,layout", F32_CASES,
                         ids=[f"{f}-" + ",".join(f"{k}={v}" for k, v in l.items() if k != "key") for f, l in F32_CASES])
@pytest.mark.parametrize("dtype,poison", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, jnp.nan),
                                          (jnp.float32, jnp.inf)], ids=["f32", "bf16", "nan", "inf"])
def test_f32_unit_equals_dequantized_qarray(fmt, layout, dtype, poison):
  """What an f32-mode GEMM reads: the QArray's float32 values, from the element values (no packed codes)."""
  x = _edge_tensor_128(dtype, poison)
  want, got = jax.jit(lambda x: (gemm.f32_values(fp4jax.quantize(x, fmt, **layout)),
                                 gemm.f32_unit(x, fmt, **layout)))(x)  # one program, as above
  assert isinstance(got, gemm.Unit) and got.values.dtype == jnp.float32 and got.values.shape == x.shape
  np.testing.assert_array_equal(_bits(gemm.f32_values(got)), _bits(want))
  if poison is not None:
    assert np.isnan(np.asarray(want)).all()


def _pieces(x, w, dy, recipe, key):
  """y, dx, dW from the public pieces on QArrays (no Unit anywhere)."""
  ops = dg.layer_operands(x, w, recipe, key)
  y = dg.fprop(ops, recipe)
  dx, _ = dg.dgrad(dy, ops.w_dgrad, recipe, key, x.dtype, ops.x_mask)
  dw, _ = dg.wgrad(dy, ops.x_wgrad, recipe, key, x.dtype, ops.w_mask)
  return y, dx, dw


# f32 mode (what "auto" is on AVX2 CPUs) takes gemm.f32_unit operands (dequantized float32 values): checked on one
# preset per kind of operand (NVFP4 1D and 2D, MXFP4, block FP8, Quartet II's RHT-128; OutControl below).
_F32_MODE = ["nvfp4", "mxfp4", "fp8", "quartet2"]


@pytest.mark.parametrize("name,mode", [*[(n, "bf16") for n in recipes.PRESETS if n != "bf16"],
                                       *[(n, "f32") for n in _F32_MODE]])
def test_rule_equals_its_public_pieces(name, mode):
  recipe = recipes.get_recipe(name).replace(gemm_mode=mode)
  k0, k1, k2, k3 = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(k0, (128, 128), jnp.float32)
  w = jax.random.normal(k1, (128, 128), jnp.float32) * 0.1  # N = 128: Quartet II's RHT-128 runs along N in Dgrad
  dy = jax.random.normal(k2, (128, 128), jnp.float32)
  dims = (((1,), (0,)), ((), ()))

  def rule(x, w, dy):
    f = lambda a, b: fp4jax.dot_general(a, b, dims, recipe=recipe, key=k3, preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  # One program for both (the suite's time is compiles): each side's ops are its own.
  got, want = jax.jit(lambda x, w, dy: (rule(x, w, dy), _pieces(x, w, dy, recipe, k3)))(x, w, dy)
  for got, want in zip(got, want):
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_the_rule_keeps_no_packed_weight_codes():
  """Dgrad reuses the Fprop weight: in both GEMM modes its residual is the Unit (bf16 values in bf16 mode, float32
  values in f32 mode), so the forward packs no weight codes; the Pallas backend, whose GEMMs read packed codes,
  keeps the QArray."""
  x = jnp.ones((32, 64), jnp.float32)
  w = jnp.ones((64, 32), jnp.float32)
  x128, w128 = jnp.ones((32, 128), jnp.float32), jnp.ones((128, 128), jnp.float32)  # whole FP8 blocks
  for recipe, kind, dtype in ((recipes.nvfp4(gemm_mode="bf16"), gemm.Unit, jnp.bfloat16),
                              (recipes.nvfp4(gemm_mode="f32"), gemm.Unit, jnp.float32),
                              (recipes.fp8(gemm_mode="bf16"), gemm.Unit, jnp.float32),  # no exact bf16 form
                              (recipes.nvfp4(backend="pallas"), fp4jax.QArray, None)):
    a, b = (x128, w128) if recipe.name.startswith("fp8") else (x, w)
    _, residuals = dg._qmatmul_fwd(a, b, jax.random.key(0), recipe)
    assert isinstance(residuals[0], kind), (recipe, type(residuals[0]))
    if dtype is not None:
      assert residuals[0].values.dtype == dtype, recipe


def test_wgrad_x_residual_is_the_bf16_unit_where_there_is_one():
  """Wgrad's x is kept as its bfloat16 Unit in bf16 mode (no codes to unpack in the backward; 2 bytes per element,
  as the bf16 recipe keeps x), and as packed codes where the Unit would be float32 (f32 mode, FP8's block scales)."""
  x = jnp.ones((32, 128), jnp.float32)
  w = jnp.ones((128, 128), jnp.float32)
  for recipe, bf16_unit in ((recipes.nvfp4(gemm_mode="bf16"), True), (recipes.mxfp4(gemm_mode="bf16"), True),
                            (recipes.nvfp4(gemm_mode="f32"), False), (recipes.fp8(gemm_mode="bf16"), False),
                            (recipes.nvfp4(backend="pallas"), False)):
    _, residuals = dg._qmatmul_fwd(x, w, jax.random.key(0), recipe)
    x_wgrad = residuals[1]
    if bf16_unit:
      assert isinstance(x_wgrad, gemm.Unit) and x_wgrad.values.dtype == jnp.bfloat16, recipe
    else:
      assert isinstance(x_wgrad, fp4jax.QArray), (recipe, type(x_wgrad))


@pytest.mark.parametrize("name,mode", [("nvfp4", "bf16"), ("tetrajet_v2", "bf16"), ("tetrajet_v2", "f32")])
def test_outcontrol_rule_equals_its_public_pieces(name, mode):
  from fp4jax import outcontrol  # pylint: disable=g-import-not-at-top
  recipe = recipes.get_recipe(name).replace(gemm_mode=mode)
  k0, k1, k2, k3 = jax.random.split(jax.random.key(2), 4)
  x = jax.random.normal(k0, (128, 128), jnp.float32)
  w = jax.random.normal(k1, (128, 64), jnp.float32) * 0.1
  dy = jax.random.normal(k2, (128, 64), jnp.float32)
  idx = jnp.array([0, 5, 77, 127])
  dims = (((1,), (0,)), ((), ()))

  def rule(x, w, dy):
    f = lambda a, b: outcontrol.dot_general(a, b, dims, recipe=recipe, key=k3, outliers=idx,
                                            preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  def pieces(x, w, dy):
    ops = outcontrol.split_operands(x, w, idx, recipe, k3)
    return (outcontrol.split_fprop(ops, recipe), outcontrol.split_dgrad(dy, ops, idx, recipe, k3, x.dtype),
            outcontrol.split_wgrad(dy, ops, idx, recipe, k3, x.dtype))

  got, want = jax.jit(lambda x, w, dy: (rule(x, w, dy), pieces(x, w, dy)))(x, w, dy)  # one program, as above
  for got, want in zip(got, want):
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_eager_calls_compile_the_rule_once_per_shape_and_recipe():
  """Outside jit the rule runs as one jitted function (op by op it compiled each small op: seconds per call)."""
  x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
  dims = (((1,), (0,)), ((), ()))
  recipe = recipes.nvfp4(gemm_mode="bf16")
  y1 = fp4jax.dot_general(x, w, dims, recipe=recipe, key=jax.random.key(0))
  compiled = dg._qmatmul_jit._cache_size()  # >= 1 (another test on this worker may have compiled the same)
  y2 = fp4jax.dot_general(x + 1, w, dims, recipe=recipe, key=jax.random.key(1))
  assert compiled >= 1 and dg._qmatmul_jit._cache_size() == compiled
  want = jax.jit(lambda a, b: fp4jax.dot_general(a, b, dims, recipe=recipe, key=jax.random.key(1)))(x + 1, w)
  np.testing.assert_array_equal(_bits(y2), _bits(want))
  assert y1.shape == (32, 32)


@pytest.mark.parametrize("axis", [0, 1])
def test_to_input_basis_applies_the_inverse_of_fprops_rht(axis):
  """The gradient leaves Fprop's Hadamard basis through H^T (H^T != H once Fprop's signs are not all ones; Quartet's
  plain Sylvester H is symmetric and hides a forward H there)."""
  r = fp4jax.recipes.quartet(stochastic_rounding=False).replace(fprop_rht_signs="fixed")
  g = np.random.default_rng(12).standard_normal((64, 96) if axis == 1 else (96, 64)).astype(np.float32)
  mask = jnp.ones(g.shape, jnp.bool_)
  got = np.asarray(dg.to_input_basis(jnp.asarray(g), mask, r, jax.random.key(0), axis=axis, in_fprop_basis=True),
                   np.float64)
  want = ref.rht_apply(g, r.rht_size, rht.default_signs(r.rht_size), axis=axis, inverse=True)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_scale_output_multiplies_by_fa_then_by_fb():
  """(out * fa) * fb in float32, bit for bit; not out * (fa * fb), whose product of two tiny factors underflows."""
  rng = np.random.default_rng(13)
  out = rng.standard_normal((64, 64)).astype(np.float32) * np.float32(1e3)
  fa = (np.float32(10.0) ** rng.uniform(-4, 4, (64, 1))).astype(np.float32)
  fb = (np.float32(10.0) ** rng.uniform(-4, 4, (1, 64))).astype(np.float32)
  got = np.asarray(jax.jit(gemm.scale_output)(jnp.asarray(out), jnp.asarray(fa), jnp.asarray(fb)))
  want = ((out * fa).astype(np.float32) * fb).astype(np.float32)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  tiny = np.float32(2.0**-80)
  np.testing.assert_array_equal(np.asarray(gemm.scale_output(jnp.float32(2.0**100), tiny, tiny)), np.float32(2.0**-60))


def test_dgrads_requantize_switch_leaves_dw_alone():
  """Wgrad's gradient leaves Fprop's Hadamard basis as Wgrad's own x operand says (`wgrad.rhs.requantize`):
  switching Dgrad's W to the original tensor must not change dW (same key, no stochastic rounding)."""
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
  g = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
  key = jax.random.key(0)
  r = fp4jax.recipes.quartet(stochastic_rounding=False, gemm_mode="f32").replace(fprop_rht_signs="fixed")
  r2 = r.replace(dgrad=dataclasses.replace(r.dgrad, rhs=dataclasses.replace(r.dgrad.rhs, requantize=False)))
  ops = jax.jit(lambda x, w: dg.layer_operands(x, w, r, key))(x, w)
  dw = [np.asarray(jax.jit(lambda g, xw, m, rec=rec: dg.wgrad(g, xw, rec, key, jnp.float32, m)[0])(
      g, ops.x_wgrad, ops.w_mask)) for rec in (r, r2)]
  want = ref.rht_apply(np.asarray(dg.gemm_lib.f32_values(ops.x_wgrad), np.float64).T
                       @ np.asarray(dg.gemm_lib.f32_values(dg.wgrad_gradient(g, r, key)), np.float64)
                       * np.asarray(ops.w_mask), 32, rht.default_signs(32), axis=0, inverse=True)
  np.testing.assert_allclose(dw[0], want, rtol=0, atol=1e-4 * np.abs(want).max())
  np.testing.assert_array_equal(dw[0], dw[1])
