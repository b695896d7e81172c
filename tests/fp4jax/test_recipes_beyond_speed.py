"""The recipes-beyond numerics (4/6, EDEN, double-block, re-quantized backward operands) with the speed work's
SR bit generator (`sr_bits`) and GEMM modes (`gemm_mode`)."""

import functools
import importlib
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import eden
from fp4jax import gemm
from fp4jax import recipes
from fp4jax import rounding as rounding_lib
from fp4jax.quantize import dequantize, quantize
import compiled_hlo

dg = importlib.import_module("fp4jax.dot_general")  # the module (fp4jax.dot_general is also the function)
DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("fmt", [fp4jax.NVFP4(scale_rule="4over6"), fp4jax.NVFP4(scale_rule="up"),
                                 fp4jax.NVFP4(headroom=True), fp4jax.NVFP4(scale_rule="eden")])
def test_bf16_operand_times_factor_is_the_dequantized_value_for_other_scale_rules(fmt):
  """The bf16 GEMM mode decodes with the format's own global range: still bit for bit the dequantized values."""
  x = np.random.default_rng(1).standard_t(3, (64, 64)).astype(np.float32)
  q = quantize(jnp.asarray(x), fmt, axis=1)
  values, factor = gemm.bf16_values(q)
  want = np.asarray(dequantize(q, jnp.float32)).view(np.uint32)
  np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32) * factor).view(np.uint32), want)


def test_double_block_operands_have_a_bf16_unit_with_a_factor_per_group():
  """Per-group second-level scales vary along the contraction: the bf16 form carries one factor per 1x128 group
  (grouped GEMMs apply them per group, tests/fp4jax/test_grouped_gemm.py), and values times the expanded factors are
  the dequantized values bit for bit."""
  x = jnp.asarray(np.random.default_rng(2).standard_t(3, (32, 256)).astype(np.float32))
  q = quantize(x, fp4jax.NVFP4(double_block=True), axis=1)
  unit = gemm.bf16_values(q)
  assert unit.values.dtype == jnp.bfloat16 and unit.factor.shape == (32, 2) and gemm.group_axis(unit) == 1
  want = np.asarray(dequantize(q)).view(np.uint32)
  np.testing.assert_array_equal(np.asarray(gemm.f32_values(unit)).view(np.uint32), want)
  np.testing.assert_array_equal(np.asarray(dequantize(q)), np.asarray(fp4jax.fake_quant(x, q.fmt, axis=1)))


@functools.partial(jax.jit, static_argnames="recipe")
def _fwd_and_grads(x, w, g, key, recipe):
  y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, DN, recipe=recipe, key=key), x, w)
  return (y,) + vjp(g)


@pytest.mark.parametrize("name", ["four_over_six", "quartet2:rht_size=16", "tetrajet_v2"])
def test_new_presets_agree_across_gemm_modes(name):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 128)).astype(np.float32))
  w = jnp.asarray((rng.standard_normal((128, 64)) / np.sqrt(128)).astype(np.float32))
  g = jnp.asarray((rng.standard_normal((64, 64)) * 1e-3).astype(np.float32))
  base, key = recipes.get_recipe(name), jax.random.key(4)
  ref = _fwd_and_grads(x, w, g, key, base.replace(gemm_mode="f32"))
  got = _fwd_and_grads(x, w, g, key, base.replace(gemm_mode="bf16"))
  for a, b in zip(ref, got):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a))


@pytest.mark.parametrize("preset", sorted(recipes.PRESETS))
def test_every_preset_takes_sr_bits_and_gemm_mode(preset):
  r = recipes.get_recipe(f"{preset}:sr_bits=threefry,gemm_mode=bf16")
  assert (r.sr_bits, r.gemm_mode) == ("threefry", "bf16")
  assert "sr_bits=threefry, gemm_mode=bf16" in r.table()
  assert recipes.PRESETS[preset]().sr_bits == "hash"


def test_new_preset_names_carry_the_speed_tags():
  assert recipes.quartet2(sr_bits="threefry", gemm_mode="bf16").name == "quartet2-threefry-gemm:bf16"
  assert recipes.tetrajet_v2(stochastic_rounding=False, sr_bits="threefry").name == "tetrajet_v2-sr"
  assert recipes.four_over_six(sr_bits="threefry").name == "four_over_six-threefry"
  assert recipes.get_recipe("nvfp4:four_over_six=true,gemm_mode=f32").name == "nvfp4+4over6-gemm:f32"
  assert recipes.four_over_six is fp4jax.recipes_beyond.four_over_six


# Values each preset switch is tried with (the default is skipped; values a preset refuses are skipped).
_SWITCH_VALUES = {"rht": (True, False), "rht_size": (8, 16, 32, 64, 128), "stochastic_rounding": (True, False),
                  "stochastic_scales": (True, False), "weight_2d": (True, False), "double_block": (True, False),
                  "four_over_six": (True, False), "rht_on": (("fprop",), ("dgrad", "wgrad")),
                  "random_signs": (False, "per_call"), "random_bits": (8,), "sr_bits": ("threefry",),
                  "gemm_mode": ("f32", "bf16"), "select": ("mse", "mae", "max"), "unbiased_sr": (True, "up"),
                  "scale_rule": ("ceil", "floor", "quest", "tseng"), "block_size": (32, 64),
                  "scaling": ("block", "tensor")}


@pytest.mark.parametrize("preset", [p for p in recipes.PRESETS if p != "bf16"])
def test_every_switch_that_changes_a_preset_changes_its_name(preset):
  """Layers, logs and reports name a recipe by `.name` ("one recipe, one name"): quartet, quartet2 and tetrajet_v2
  with random_bits=8, and tetrajet_v2 with another rht_size, kept the default's name."""
  factory = recipes.PRESETS[preset]
  default = factory()
  params = inspect.signature(factory).parameters
  tried = 0
  for switch, values in _SWITCH_VALUES.items():
    if switch not in params:
      continue
    for value in values:
      if value == params[switch].default:
        continue
      try:
        r = factory(**{switch: value})
      except ValueError:  # a value this preset refuses
        continue
      tried += 1
      if switch == "sr_bits" and not any(op.rounding == "stochastic" for g in ("fprop", "dgrad", "wgrad")
                                         for op in (r.gemm(g).lhs, r.gemm(g).rhs)):
        continue  # no SR: the generator is used for nothing (as with nvfp4:stochastic_rounding=false), and untagged
      assert r != default and r.name != default.name, (switch, value, r.name)
  assert set(params) - set(_SWITCH_VALUES) <= {"backend"}, "a new switch: give it values above"
  assert tried >= 3
  assert recipes.quartet(random_bits=8).name == "quartet-sr8bit"
  assert recipes.tetrajet_v2(rht_size=32, random_bits=8, sr_bits="threefry").name == "tetrajet_v2-rht32-sr8bit-threefry"


def test_eden_stochastic_scales_draw_bits_from_the_recipe_generator():
  """"threefry": jax.random.bits, as before sr_bits existed; "hash": fp4jax.prng's counter-based bits."""
  s = jnp.asarray(np.random.default_rng(3).uniform(0.01, 400.0, (8, 64)).astype(np.float32))
  key = jax.random.key(7)
  lo, hi = eden.e4m3_neighbours(s)
  p = jnp.where(hi > lo, (s - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)
  for sr_bits, bits in (("threefry", jax.random.bits(key, s.shape, jnp.uint32)),
                        ("hash", fp4jax.prng.random_bits(key, s.shape, "hash"))):
    want = jnp.where(rounding_lib.uniform_from_bits(bits, 32) < p, hi, lo)
    got = eden.round_scales(s, rounding="stochastic", key=key, random_bits=32, sr_bits=sr_bits)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", ["quartet2:rht_size=16", "four_over_six"])
def test_quantize_of_new_formats_follows_sr_bits(name):
  """The 4/6 elements' and EDEN scales' SR: "threefry" and "hash" give different draws, each reproducible."""
  op = recipes.get_recipe(name).wgrad.lhs
  g = jnp.asarray(np.random.default_rng(4).standard_normal((128, 64)).astype(np.float32))
  key = jax.random.key(1)
  q = {b: quantize(g, op.fmt, axis=0, rounding="stochastic", key=key, sr_bits=b) for b in ("hash", "threefry")}
  again = quantize(g, op.fmt, axis=0, rounding="stochastic", key=key, sr_bits="threefry")
  np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(q["threefry"].codes))
  assert not np.array_equal(np.asarray(dequantize(q["hash"])), np.asarray(dequantize(q["threefry"])))


@pytest.mark.parametrize("layout", [dict(axis=1), dict(axis=0), dict(block_2d=True)], ids=["minor", "axis0", "2d"])
def test_four_over_six_rounds_elements_apart_from_its_error_sums(layout):
  """4/6's per-block errors are summed from squared errors written out by the elementwise pass. XLA:CPU used to fuse
  the rounding into the kernels of the sums' pairwise stages, which then wrote 1/8 of the elements each (loops of
  width 2, or stride-16 reads): 4/6's `small` train step took 4.0x bf16's. Every compiled kernel that rounds (RNE)
  writes one value per element or one per block, nothing in between."""
  x = jax.random.normal(jax.random.key(1), (128, 256), jnp.float32)
  fmt = fp4jax.NVFP4(scale_rule="4over6")
  hlo = compiled_hlo.compiled_text(lambda x: fp4jax.fake_quant(x, fmt, **layout), x)
  sizes = {s for c in compiled_hlo.computations(hlo) if "round-nearest-even(" in c.text
           for s in compiled_hlo.result_sizes(c)}
  block = 256 if layout.get("block_2d") else 16
  assert x.size in sizes and sizes <= {x.size, x.size // block}, sizes


# Packed FP4 codes and E8M0 scales are uint8 values, NVFP4's E4M3 scales float8 ones.
_CODES_OR_SCALES = re.compile(r"\b(u8|f8e4m3fn|f8e8m0fnu)\[")


@pytest.mark.parametrize("name, checked", [("tetrajet_v2", ("fprop", "dgrad", "wgrad")),
                                           ("quartet", ("dgrad", "wgrad"))], ids=["tetrajet_v2", "quartet"])
def test_requantizing_recipes_decode_gemm_operands_from_float32_scales(name, checked):
  """tetrajet_v2's and quartet's Fprop operands and re-quantized backward operands (Dgrad's W, Wgrad's x) are
  gemm.Units, decoded with the quantizer's float32 block scales. As packed QArrays, XLA:CPU fused quantize, pack,
  unpack and decode into the kernel that writes each GEMM operand: every element recomputed both codes of its byte
  and its block's scale. No kernel writing an operand of the checked GEMMs, nor the GEMM's own, holds a uint8 or
  float8 value. (quartet's Fprop operands stay QArrays: their clip masks come from the quantizer.) A GEMM may run
  as one dot per 128-group of its contraction (tetrajet_v2's double-block scales in bf16 mode, gemm.grouped_gemm)."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks XLA:CPU's kernels")
  m, k, n = 64, 128, 256  # each operand and product has its own element count
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
  w = jnp.asarray((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))
  g = jnp.asarray((rng.standard_normal((m, n)) * 1e-3).astype(np.float32))
  fn = functools.partial(_fwd_and_grads, recipe=recipes.get_recipe(name))
  text = compiled_hlo.compiled_text(fn, x, w, g, jax.random.key(4))
  # (product's size, operands' sizes); the operand sizes tell the layer's GEMMs from the RHT's (a Hadamard tile).
  sizes = {"fprop": (m * n, {m * k, k * n}, k), "dgrad": (m * k, {m * n, k * n}, n),
           "wgrad": (k * n, {m * n, m * k}, m)}
  for gemm_name in checked:
    product, operand_sizes, length = sizes[gemm_name]
    per_group = {s // length * gemm.GROUP for s in operand_sizes}  # each operand's slice of one 128-group
    found = {"whole": [], "grouped": []}
    for op in compiled_hlo.gemms(text):
      writers = [compiled_hlo.writer(text, o) for o in op.operands]
      written = {compiled_hlo.sizes(kernel.type)[0] for kernel in writers}
      if compiled_hlo.sizes(op.type) == [product] and written in (operand_sizes, per_group):
        found["whole" if written == operand_sizes else "grouped"].append((op, writers))
    assert (len(found["whole"]), len(found["grouped"])) in ((1, 0), (0, length // gemm.GROUP)), (gemm_name, found)
    for op, writers in found["whole"] + found["grouped"]:
      for kernel in [op] + writers:
        assert not _CODES_OR_SCALES.search(compiled_hlo.body(text, kernel)), (gemm_name, kernel.name)
