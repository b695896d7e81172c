"""The quantizers keep the rounding of a bfloat16 input that is computed in the same jit (XLA:GPU's excess precision).

XLA:GPU removes a float32 -> bfloat16 -> float32 convert pair by default (SimplifyFPConversions); on an H200 that
made `fp4jax.quantize(random_hadamard(x_bf16))` read the transform's unrounded float32 output (2 % of its codes
differed from the CPU's). The quantizers and the RHT therefore widen narrow inputs from their bits
(`grids.exact_float32`). These tests check that function on every bit pattern, and that no such removable convert
pair is left on the path from a bfloat16 cast to fp4jax's arithmetic, forward and backward, for each recipe.
benchmarks/gpu/bits.py checks the codes themselves on a GPU.
"""

import os
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import source_info_util  # where a pair comes from, for the failure message
from jax.extend import core as jcore

import fp4jax
import pallas_kernels
from fp4jax import grids

LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (fp4jax, pallas_kernels))
NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SHAPE_OPS = {"reshape", "transpose", "slice", "squeeze", "broadcast_in_dim", "expand_dims", "copy", "rev",
             "dynamic_slice", "pad", "concatenate"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_exact_float32_on_every_bit_pattern(dtype):
  bits = np.arange(1 << 16, dtype=np.uint16)
  x = jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)
  got = np.asarray(grids.exact_float32(x))
  want = np.asarray(x).astype(np.float32)
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])  # -0, subnormals, inf too


def test_exact_float32_passes_float32_and_refuses_other_dtypes():
  x = jnp.arange(4, dtype=jnp.float32)
  assert grids.exact_float32(x) is x
  with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
    grids.exact_float32(jnp.arange(4))


def removable_convert_pairs(fn, *args) -> list[str]:
  """Convert ops narrow -> float32 made by fp4jax or pallas_kernels code whose operand is a float32 -> narrow convert
  (through shape-only ops), in the jaxpr of `fn` and every jaxpr nested in it: the pairs XLA:GPU's excess-precision
  rewrite deletes in front of fp4jax's arithmetic. (The caller's own pairs, e.g. autodiff's transpose of its casts
  back to float32, are the caller's.)"""
  found = []

  def walk(jaxpr, narrow: set) -> set:
    for eqn in jaxpr.eqns:
      ins = [v if isinstance(v, jcore.Var) else None for v in eqn.invars]
      name = eqn.primitive.name
      if name == "convert_element_type":
        new = jnp.dtype(eqn.params["new_dtype"])
        if ins[0] is not None and ins[0] in narrow and new == jnp.float32:
          tb = eqn.source_info.traceback
          files = [f.file_name for f in tb.frames] if tb is not None else []
          if any(f.startswith(LIBRARY_DIRS) for f in files):
            found.append(f"{str(eqn)[:120]} at {source_info_util.summarize(eqn.source_info)}")
        if eqn.invars[0].aval.dtype == jnp.float32 and new in NARROW:
          narrow.add(eqn.outvars[0])
      elif name in SHAPE_OPS and ins and ins[0] is not None and ins[0] in narrow:
        narrow.update(eqn.outvars)
      for p in eqn.params.values():
        sub = p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p if isinstance(p, jcore.Jaxpr) else None
        if sub is None or len(sub.invars) != len(eqn.invars):
          continue
        inner = {iv for ov, iv in zip(ins, sub.invars) if ov is not None and ov in narrow}
        out = walk(sub, inner)
        narrow.update(o for i, o in zip(sub.outvars, eqn.outvars) if isinstance(i, jcore.Var) and i in out)
    return narrow

  walk(jax.make_jaxpr(fn)(*args).jaxpr, set())
  return found


X32 = jnp.asarray(np.random.default_rng(0).standard_normal((128, 256)), jnp.float32)


def test_the_checker_finds_a_removable_pair():
  with_cast = lambda x: fp4jax.quantize((x * 3).astype(jnp.bfloat16).reshape(256, 128), "nvfp4").codes
  with_pair = lambda x: fp4jax.quantize((x * 3).astype(jnp.bfloat16).astype(jnp.float32), "nvfp4").codes
  assert removable_convert_pairs(with_cast, X32) == []
  assert removable_convert_pairs(with_pair, X32) == []  # the caller's pair, not fp4jax's
  with unittest.mock.patch.object(fp4jax.grids, "exact_float32", lambda x: x.astype(jnp.float32)):
    jax.clear_caches()  # the quantizer's jitted trace would otherwise be reused
    try:
      assert len(removable_convert_pairs(with_cast, X32)) == 1  # what quantize did before: a cast
    finally:
      jax.clear_caches()


@pytest.mark.parametrize("kw", [dict(), dict(block_2d=True), dict(axis=0, rounding="stochastic"),
                                dict(fmt="mxfp4"), dict(fmt="fp8")])
def test_quantize_of_a_fused_cast_keeps_its_rounding(kw):
  kw = dict(kw)
  fmt = kw.pop("fmt", "nvfp4")
  key = jax.random.key(0) if kw.get("rounding") else None
  fn = lambda x: fp4jax.quantize((x * 3).astype(jnp.bfloat16), fmt, key=key, **kw).codes
  assert removable_convert_pairs(fn, X32) == []


@pytest.mark.parametrize("size,axis", [(16, -1), (16, 0), (32, 0)])
def test_rht_then_quantize_keeps_both_roundings(size, axis):
  def fn(x):
    y = fp4jax.random_hadamard((x * 3).astype(jnp.bfloat16), size=size, axis=axis)
    return fp4jax.quantize(y, "nvfp4", axis=axis).codes
  assert removable_convert_pairs(fn, X32) == []


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4:gemm_mode=f32", "mxfp4", "fp8", "four_over_six", "quartet2",
                                    "tetrajet_v2", "quartet"])
def test_quantized_gemm_forward_and_backward_keep_bf16_roundings(recipe):
  w = jnp.asarray(np.random.default_rng(1).standard_normal((256, 128)) * 0.1, jnp.float32)
  g = jnp.asarray(np.random.default_rng(2).standard_normal((128, 128)), jnp.float32)
  dims = (((1,), (0,)), ((), ()))

  def loss(x, w, key):  # x, W and (in the backward) dY reach the GEMM as bfloat16 casts of float32 values
    y = fp4jax.dot_general((x * 3).astype(jnp.bfloat16), w.astype(jnp.bfloat16), dims, recipe=recipe, key=key)
    return jnp.sum(y.astype(jnp.float32) * g)

  grads = jax.grad(loss, argnums=(0, 1))
  assert removable_convert_pairs(grads, X32, w, jax.random.key(0)) == []


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_flax_layers_forward_and_backward_keep_bf16_roundings(api):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  g = jnp.asarray(np.random.default_rng(2).standard_normal((128, 128)), jnp.float32)
  if api == "nnx":
    layer = fp4jax.nn.Linear(256, 128, recipe="nvfp4", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    apply = lambda p, x: nnx.merge(graphdef, p, rest)(x, key=jax.random.key(2))
  else:
    layer = fp4jax.linen.Dense(128, recipe="nvfp4", dtype=jnp.bfloat16)
    params = layer.init({"params": jax.random.key(0), "quant": jax.random.key(1)}, X32)
    apply = lambda p, x: layer.apply(p, x, rngs={"quant": jax.random.key(2)})
  loss = lambda p, x: jnp.sum(apply(p, (x * 3).astype(jnp.bfloat16)).astype(jnp.float32) * g)
  assert removable_convert_pairs(jax.grad(loss, argnums=(0, 1)), params, X32) == []
