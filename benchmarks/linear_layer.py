"""One quantized linear layer: forward+backward time and saved-residual memory, as ratios to the bf16 layer.

  python benchmarks/linear_layer.py                       # M=4096 tokens, K=N=1024, recipes nvfp4 mxfp4 fp8
  python benchmarks/linear_layer.py --tokens 512 --k 256 --n 256 --iters 5 --runs 3 --recipes nvfp4,nvfp4:rht=false

The layer is y = x W as fp4jax.nn.Linear runs it: x bf16 [M, K], a float32 master weight W [K, N], bf16 output;
the bf16 baseline casts W to bf16 and calls lax.dot_general. Time: jitted value_and_grad of sum(y * G) w.r.t.
(x, W), warmed up; the recipes take turns over --runs blocks of --iters calls, and each ratio is a block's median
over bf16's in the same block (median and min over blocks). Residuals: the bytes the custom_vjp forward saves for
the backward (fp4jax.dot_general._qmatmul_fwd, shapes only via jax.eval_shape) vs bf16 autodiff's x and W in bf16,
(M*K + K*N) * 2 bytes. The "xla" backend emulates FP4 GEMMs in the recipe's gemm_mode: "f32" multiplies the
dequantized values in float32, "bf16" the codes times their block scales in bf16 with float32 accumulation, and
"auto" (the default) resolves per machine (fp4jax.gemm.resolve_gemm_mode: bf16 on accelerators and AVX-512 CPUs,
f32 on other CPUs); the heading prints the mode each recipe resolved to. Times measure quantization overhead on
this machine, not FP4 tensor-core speed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

import fp4jax
from benchmarks import interleave
from fp4jax import gemm as gemm_lib
from fp4jax import recipes as recipes_lib
from fp4jax.dot_general import _qmatmul_fwd

DN = (((1,), (0,)), ((), ()))


def layer_loss(recipe: recipes_lib.Recipe):
  """loss(x_MxK, w_KxN, g_MxN, key) = sum(y * G) for the layer under `recipe` (the bf16 one for bf16)."""

  def loss(x_MxK, w_KxN, g_MxN, key):
    if recipe.is_quantized:
      y = fp4jax.dot_general(x_MxK, w_KxN, DN, recipe=recipe, key=key if recipe.needs_key else None,
                             preferred_element_type=jnp.bfloat16)
    else:
      y = jax.lax.dot_general(x_MxK, w_KxN.astype(jnp.bfloat16), DN, preferred_element_type=jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) * g_MxN)

  return loss


def compile_step(recipe, x, w, g):
  """(the jitted value_and_grad step, its compile + first run seconds)."""
  step = jax.jit(jax.value_and_grad(layer_loss(recipe), argnums=(0, 1)))
  t0 = time.perf_counter()
  jax.block_until_ready(step(x, w, g, jax.random.key(0)))
  return step, time.perf_counter() - t0


def time_blocks(steps: dict, x, w, g, *, iters: int, warmup: int, runs: int) -> dict[str, list[float]]:
  """{recipe: the median seconds of its `iters` timed calls in each of `runs` blocks}. The recipes take turns block
  by block, the order rotating, so that a change of the machine's load hits all alike; `warmup` untimed calls
  each first."""
  names = list(steps)
  for name in names:
    for i in range(warmup):
      jax.block_until_ready(steps[name](x, w, g, jax.random.key(1 + i)))
  block_s = {name: [] for name in names}
  for b, order in enumerate(interleave.block_orders(names, runs)):
    for name in order:
      times = []
      for i in range(iters):
        key = jax.random.key(100 + b * iters + i)  # a fresh key per step, as in training
        t0 = time.perf_counter()
        out = jax.block_until_ready(steps[name](x, w, g, key))
        times.append(time.perf_counter() - t0)
        del out  # freed after the clock stops, as in common.time_jitted
      block_s[name].append(statistics.median(times))
  return block_s


def _nbytes(leaf) -> int:
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return 8 * math.prod(leaf.shape)  # threefry key data: 2 x uint32
  return math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def residual_bytes(recipe, x, w) -> int:
  """Bytes saved between forward and backward by the layer's VJP."""
  if not recipe.is_quantized:
    return (x.size + w.size) * 2  # autodiff of a bf16 dot_general saves x and W (cast to bf16)
  _, residuals = jax.eval_shape(lambda x, w: _qmatmul_fwd(x, w, jax.random.key(0), recipe), x, w)
  return sum(_nbytes(leaf) for leaf in jax.tree.leaves(residuals))


def gemm_mode(recipe: recipes_lib.Recipe) -> str:
  """The GEMM mode a quantized recipe runs in here: gemm_mode with "auto" resolved (xla), else its backend."""
  if recipe.backend != "xla":
    return f"{recipe.backend} backend"
  mode = gemm_lib.resolve_gemm_mode(recipe)
  return mode if recipe.gemm_mode == mode else f"{mode} ({recipe.gemm_mode})"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096, help="M: tokens (batch x sequence)")
  parser.add_argument("--k", type=int, default=1024, help="K: input features")
  parser.add_argument("--n", type=int, default=1024, help="N: output features")
  parser.add_argument("--iters", type=int, default=10, help="timed calls per recipe and block (their median)")
  parser.add_argument("--runs", type=int, default=3, help="blocks, the recipes in turns; median and min reported")
  parser.add_argument("--warmup", type=int, default=2, help="untimed runs after compilation")
  parser.add_argument("--recipes", default="nvfp4,mxfp4,fp8",
                      help="comma-separated recipe specs; '+' joins tuple values (nvfp4:rht_on=wgrad+dgrad)")
  args = parser.parse_args(argv)
  for flag in ("tokens", "k", "n", "iters", "runs"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1; got {getattr(args, flag)}.")
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0; got {args.warmup}.")

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.tokens, args.k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((args.k, args.n)) / np.sqrt(args.k), jnp.float32)
  g = jnp.asarray(rng.standard_normal((args.tokens, args.n)), jnp.float32)
  # Each spec once: the timings are keyed by it.
  specs = ["bf16"] + list(dict.fromkeys(s.strip() for s in args.recipes.split(",") if s.strip() not in ("", "bf16")))
  recipes = [recipes_lib.get_recipe(s) for s in specs]

  print(f"linear layer M={args.tokens} K={args.k} N={args.n}  backend={jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), jax {jax.__version__}; {args.runs} blocks of {args.iters} calls, "
        "recipes in turns; ratio to bf16 per block: median (min)")
  print("GEMM mode: " + (", ".join(f"{spec} {gemm_mode(recipe)}" for spec, recipe in zip(specs, recipes)
                                   if recipe.is_quantized) or "none quantized"))
  compiled = {spec: compile_step(recipe, x, w, g) for spec, recipe in zip(specs, recipes)}
  block_s = time_blocks({spec: step for spec, (step, _) in compiled.items()}, x, w, g, iters=args.iters,
                        warmup=args.warmup, runs=args.runs)
  paired = interleave.paired_ratios(block_s, "bf16")
  rows = []
  for spec, recipe in zip(specs, recipes):
    ratios = paired[spec]
    rows.append((spec, compiled[spec][1], statistics.median(block_s[spec]), statistics.median(ratios), min(ratios),
                 residual_bytes(recipe, x, w)))
  base_b = rows[0][5]
  header = (f"{'recipe':<28} {'compile+1st s':>13} {'fwd+bwd ms':>11} {'x bf16':>7} {'(min)':>6} {'residual MiB':>13} "
            f"{'x bf16':>7}")
  print(header)
  print("-" * len(header))
  for spec, first, median, ratio, low, nbytes in rows:
    print(f"{spec:<28} {first:>13.2f} {median * 1e3:>11.2f} {ratio:>7.2f} {low:>6.2f} {nbytes / 2**20:>13.2f} "
          f"{nbytes / base_b:>7.3f}")
  return rows


if __name__ == "__main__":
  main()
