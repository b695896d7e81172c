"""NVFP4 double-block (TetraJet-v2) GEMMs in bf16 mode: one bf16 GEMM per 1x128 group of the contraction, both
operands' group scales applied to its float32 partial product (fp4jax.gemm.grouped_gemm).

Checked against the exact GEMM of the dequantized values, computed here in float64 from the bf16 units (code x E4M3
block scale, exact) and their group factors: both GEMM modes lie within float32's error of it, so they agree with
each other to float32 rounding, not bit for bit (f32 mode rounds each decoded element first).
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import gemm
from fp4jax import recipes

dg = importlib.import_module("fp4jax.dot_general")
EPS = 2.0**-24
DB = fp4jax.NVFP4(double_block=True)


def _operand(key, shape, axis, outlier=None):
  """A tensor whose 128-groups along `axis` have scales 2^-6 .. 2^6 apart (so a wrong group's factor shows)."""
  x = jax.random.normal(key, shape, jnp.float32)
  k = shape[axis]
  group_scale = 2.0 ** ((np.arange(k) // gemm.GROUP) % 13 - 6.0)
  x = x * jnp.asarray(group_scale, jnp.float32).reshape([-1 if i == axis else 1 for i in range(len(shape))])
  return x if outlier is None else x.at[outlier].set(300.0)


def _exact(unit, axis):
  """float64 values of a Unit with exact arithmetic: bf16 values times each group's factor, unrounded."""
  values = np.asarray(unit.values.astype(jnp.float32), np.float64)
  factor = np.asarray(unit.factor, np.float64)
  if factor.ndim:
    factor = np.repeat(factor, gemm.GROUP, axis=axis)[tuple(slice(0, n) for n in values.shape)]
  return values * factor


@pytest.mark.parametrize("m,k,n", [(64, 512, 48), (32, 192, 64), (48, 64, 32)],
                         ids=["4-groups", "partial-last-group", "one-partial-group"])
@pytest.mark.parametrize("contract", [(1, 1), (0, 0)], ids=["dgrad-layout", "wgrad-layout"])
def test_grouped_gemm_is_the_exact_gemm_to_float32_error(m, k, n, contract):
  """|got - exact| <= (K + 2) eps |A| @ |B| for grouped_gemm (float32 sums within and across groups, two scalings),
  and for f32 mode's GEMM of the dequantized values (each element rounded, then K - 1 sums). Both layouts of the
  contraction: along the minor axes (Dgrad: dY [M, N] . W [K, N]) and the leading ones (Wgrad: x [M, K] . dY [M, N],
  the form that runs grouped off the CPU)."""
  ca, cb = contract
  a_shape, b_shape = ((m, k), (n, k)) if ca else ((k, m), (k, n))

  @jax.jit  # one program (the suite's time is compiles)
  def run(xa, xb):
    a, b = gemm.unit_values(xa, DB, axis=ca), gemm.unit_values(xb, DB, axis=cb)
    f32 = jax.lax.dot_general(gemm.f32_values(a), gemm.f32_values(b), (((ca,), (cb,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST)
    return a, b, gemm.grouped_gemm(a, b, contract), f32

  a, b, got, f32 = run(_operand(jax.random.key(0), a_shape, ca, outlier=(3, 5)),
                       _operand(jax.random.key(1), b_shape, cb))
  assert gemm.group_axis(a) == ca and a.factor.shape[ca] == -(-k // 128)
  got, f32 = np.asarray(got, np.float64), np.asarray(f32, np.float64)
  ea, eb = _exact(a, ca), _exact(b, cb)
  ea, eb = (ea, eb.T) if ca else (ea.T, eb)  # [M, K] and [K, N]
  exact = ea @ eb
  bound = (k + 2) * EPS * (np.abs(ea) @ np.abs(eb))
  assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)
  assert np.all(np.abs(f32 - exact) <= bound), np.max(np.abs(f32 - exact) / bound)
  assert not np.array_equal(got, f32)  # another computation, not the f32 path under another name


def test_grouped_gemm_takes_a_scalar_factor_operand_against_a_grouped_one():
  """A double-block operand against a plain NVFP4 one (one tensor factor for every group)."""
  x = _operand(jax.random.key(2), (32, 256), 1)
  w = jax.random.normal(jax.random.key(3), (256, 16), jnp.float32)
  a, b, got = jax.jit(lambda x, w: (lambda a, b: (a, b, gemm.grouped_gemm(a, b, (1, 0))))(
      gemm.unit_values(x, DB, axis=1), gemm.unit_values(w, "nvfp4", axis=0)))(x, w)
  assert gemm.group_axis(b) is None
  got = np.asarray(got, np.float64)
  ea, eb = _exact(a, 1), _exact(b, 0)
  assert np.all(np.abs(got - ea @ eb) <= 258 * EPS * (np.abs(ea) @ np.abs(eb)))


def test_grouped_gemm_refuses_groups_along_a_free_axis():
  a = gemm.unit_values(_operand(jax.random.key(4), (256, 32), 0), DB, axis=0)  # groups along axis 0
  b = gemm.unit_values(jax.random.normal(jax.random.key(5), (32, 16)), "nvfp4", axis=0)
  with pytest.raises(ValueError, match="contracted axis 1"):
    gemm.grouped_gemm(a, b, (1, 0))


@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf])
def test_a_non_finite_group_poisons_the_whole_product(poison):
  """As dequantize: a non-finite value anywhere makes the whole operand NaN, so every output is NaN."""
  x = _operand(jax.random.key(6), (16, 384), 1).at[2, 300].set(poison)
  w = jax.random.normal(jax.random.key(7), (384, 16))
  out = jax.jit(lambda x, w: gemm.grouped_gemm(gemm.unit_values(x, DB, axis=1), gemm.unit_values(w, DB, axis=0),
                                               (1, 0)))(x, w)
  assert np.isnan(np.asarray(out)).all()


def test_group_axis_rejects_a_factor_of_the_wrong_shape():
  u = gemm.Unit(jnp.ones((32, 256), jnp.bfloat16), jnp.ones((32, 3), jnp.float32))  # 256 elements are 2 groups
  with pytest.raises(ValueError, match="one per 128-element group"):
    gemm.group_axis(u)


def _rule(recipe, x, w, dy, key):
  def f(x, w, dy):
    g = lambda a, b: fp4jax.dot_general(a, b, (((1,), (0,)), ((), ())), recipe=recipe, key=key,
                                        preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(g, x, w)
    return (y, *vjp(dy))
  return f


def test_tetrajet_v2_modes_agree_to_float32_error_and_fprop_dgrad_multiply_bf16():
  """The rule in bf16 mode: y and dx within float32 error of f32 mode's (the same quantized operands; the GEMMs
  differ); Fprop and Dgrad run bf16 dots, one per 128-group (before, every GEMM was float32 at HIGHEST)."""
  x = _operand(jax.random.key(8), (128, 256), 1, outlier=(1, 2))
  w = jax.random.normal(jax.random.key(9), (256, 128), jnp.float32) * 0.05
  dy = jax.random.normal(jax.random.key(10), (128, 128), jnp.float32)
  key = jax.random.key(11)
  base = recipes.get_recipe("tetrajet_v2")
  f_bf16, f_f32 = _rule(base.replace(gemm_mode="bf16"), x, w, dy, key), _rule(base.replace(gemm_mode="f32"), x, w,
                                                                              dy, key)
  got, ref = jax.jit(lambda *a: (f_bf16(*a), f_f32(*a)))(x, w, dy)
  for name, a, b in zip(("y", "dx", "dw"), got, ref):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), (name, np.max(np.abs(a - b)) / np.max(np.abs(b)))
  text = jax.jit(f_bf16).lower(x, w, dy).as_text()
  bf16_dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l and "bf16>, tensor<" in l]
  assert len(bf16_dots) == 2 + 1  # Fprop: K = 256, two groups; Dgrad: N = 128, one group
  if jax.default_backend() == "cpu":  # Wgrad contracts the first axes: one float32 GEMM, f32 mode's bits
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))


def test_unquantized_bf16_operands_still_take_the_plain_bf16_gemm():
  """A recipe's BF16 GEMMs (a policy's BF16 layers, a forward switched to BF16) pass plain bfloat16 arrays: their
  bf16 form is a Unit with factor 1, never mistaken for grouped factors (it was a bare tuple, which broke here)."""
  x = jax.random.normal(jax.random.key(12), (8, 32), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(13), (32, 16), jnp.bfloat16)
  assert isinstance(gemm.bf16_values(x), gemm.Unit) and gemm.group_axis(gemm.bf16_values(x)) is None
  got = gemm.gemm(x, w, (1, 0), recipes.nvfp4(gemm_mode="bf16"))
  want = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
