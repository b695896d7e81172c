"""Compile every Pallas kernel configuration and the `small` train step for sm_90 without a GPU (XLA deviceless AOT).

  python -m benchmarks.gpu.aot [--out DIR]       # needs jax >= 0.11 and a CUDA PJRT plugin (jax[cuda13]) installed

XLA compiles each `pallas_call` with its own Triton for an H100-class target described by `H100_TARGET_CONFIG`
(sm_90; H200 differs only in memory), through a compile-only topology (`jax.experimental.topologies`), as jax's
own deviceless AOT tests do. That runs the Triton compiler (TTIR -> TTGIR -> LLVM) that plain cuda lowering never
reaches, so compile-time failures (shared memory over the limit, layout conversions, an `LLVM ERROR`) show here
before a GPU is lent, and the thunk report gives each kernel's grid, threads and shared memory. It does not run
anything: numerics and speed still need the GPU (benchmarks/gpu.sh). The train steps (bf16, nvfp4 on the XLA path,
nvfp4 on the Pallas kernels) go through XLA's GPU compiler whole; their rows count the kernel launches per step.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# GpuTargetConfigProto of an H100 SXM (CUDA 13 runtime, cuDNN 9): what XLA's compiler reads about the target.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 3 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def supported() -> tuple[bool, str]:
  """Whether this jax can compile for cuda without a GPU (a CUDA PJRT plugin and compile-only topologies)."""
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
  except Exception as e:  # pylint: disable=broad-except
    return False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
  return True, "ok"


def cases():
  """[(name, fn, abstract args)]: the GEMM defaults and every benchmarked tile variant, the `small` train step
  (bf16, nvfp4 on the XLA path, nvfp4 with the Pallas kernels), the quantizer layouts."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  from benchmarks.gpu import gemm as gemm_bench  # pylint: disable=g-import-not-at-top
  from benchmarks.gpu import quant as quant_bench  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fp4_matmul, quantize_nvfp4  # pylint: disable=g-import-not-at-top

  def q(shape, fmt="nvfp4", **kw):
    return jax.eval_shape(lambda x: fp4jax.quantize(x, fmt, **kw), jax.ShapeDtypeStruct(shape, jnp.bfloat16))

  out = []
  for (m, n, k) in gemm_bench.GEMM_SIZES:
    out.append((f"fp4_matmul default M,N,K={m},{n},{k}", lambda a, b: fp4_matmul(a, b, interpret=False),
                (q((m, k), axis=1), q((k, n), axis=0, block_2d=True))))
  for (m, n, k), variants in (((8192, 8192, 8192), gemm_bench.TILE_VARIANTS),
                              ((16, 8192, 8192), gemm_bench.SKINNY_VARIANTS)):
    for tiles, split, warps in variants:
      out.append((f"fp4_matmul {tiles} split_k={split} warps={warps} M,N,K={m},{n},{k}",
                  lambda a, b, t=tiles, s=split, w=warps: fp4_matmul(a, b, interpret=False, tiles=t, split_k=s,
                                                                     num_warps=w),
                  (q((m, k), axis=1), q((k, n), axis=0, block_2d=True))))
  layouts = [("Dgrad W 2D packed along K", (1, 1), q((4096, 8192), axis=1), q((4096, 8192), axis=0, block_2d=True)),
             ("Wgrad [K, M] x [K, N]", (0, 0), q((8192, 4096), axis=0), q((8192, 4096), axis=0)),
             ("MXFP4", (1, 0), q((4096, 4096), "mxfp4", axis=1), q((4096, 4096), "mxfp4", axis=0))]
  for name, contract, a, b in layouts:
    out.append((f"fp4_matmul {name}", lambda a, b, c=contract: fp4_matmul(a, b, contract=c, interpret=False), (a, b)))
  for recipe in TRAIN_STEP_RECIPES:
    out.append((f"train step small {recipe}", *_train_step_case(recipe)))
  x = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  extra = [("2d packed along rows", dict(block_2d=True, axis=0)), ("col RNE", dict(axis=0)),
           ("2d 16x16 4/6 absmax", dict(block_2d=True, scale_rule="4over6", select="absmax")),
           ("col RHT16 + SR32 4/6 headroom, judged on RNE", dict(axis=0, rht_size=16, rounding="stochastic",
                                                                 scale_rule="4over6", headroom=True,
                                                                 select_on="nearest")),
           ("row MS-EDEN SR scales, groups of 32", dict(rounding="stochastic", scale_rule="eden", eden_group=32))]
  for name, kw in quant_bench.QUANT_BENCH + extra:
    sr = kw.get("rounding") == "stochastic"
    fmt, kw = quant_bench.format_and_args(kw)
    out.append((f"quantize_nvfp4 {name}",
                lambda x, kw=kw, sr=sr, fmt=fmt: quantize_nvfp4(x, interpret=False, fmt=fmt,
                                                                key=jax.random.key(0) if sr else None, **kw).codes,
                (x,)))
  return out


# The `small` model's train step as benchmarks/gpu.sh's train section runs it: bf16, nvfp4, nvfp4 on the kernels.
TRAIN_STEP_RECIPES = ("bf16", "nvfp4", "nvfp4:backend=pallas")


def _train_step_case(recipe: str, **model_overrides):
  """(step fn, (state, batch, key)) of the `small` model's train step at the gpu.sh size (gpu_model.SMALL_BATCH_SEQ);
  `model_overrides`: ModelConfig fields to replace (e.g. scan_layers=True)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from benchmarks.gpu import model as gpu_model  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  from pallas_kernels import platform as pallas_platform  # pylint: disable=g-import-not-at-top
  step, state, _ = gpu_model.train_step_and_state(model_lib.get_model_config("small", **model_overrides), recipe,
                                                  *gpu_model.SMALL_BATCH_SEQ)
  batch = {k: jax.ShapeDtypeStruct(gpu_model.SMALL_BATCH_SEQ, jnp.int32) for k in ("inputs", "targets")}

  def step_with_compiled_kernels(*args):
    # The recipe's kernels pick interpret mode from the default backend, which is the CPU here; on the GPU they
    # run compiled, so that is what this case traces.
    with mock.patch.object(pallas_platform, "resolve_interpret", lambda interpret: bool(interpret)):
      return step(*args)

  return step_with_compiled_kernels, (state, batch, jax.random.key(0))


def _sm90_mesh():
  """(a compile-only one-device mesh of H100_TARGET_CONFIG, the replicated sharding on it)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
  mesh = topologies.make_mesh(topo=topo, mesh_shape=(1,), axis_names=("x",))
  return mesh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_sm90(fn, *args, compiler_options=None):
  """`jax.jit(fn)` compiled for sm_90 without a GPU; `args` give shapes and dtypes."""
  import jax  # pylint: disable=g-import-not-at-top
  mesh, sharding = _sm90_mesh()
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the Triton lowering asks it for the GPU kind
    return jax.jit(fn).lower(*args).compile(compiler_options=compiler_options)


def compiled_hlo(fn, *args) -> str:
  """XLA's optimized HLO text of `jax.jit(fn)` compiled for sm_90 without a GPU; `args` give shapes and dtypes."""
  return compile_sm90(fn, *args).as_text()


def bf16_roundings_kept() -> list[tuple[str, int]]:
  """(case, bfloat16 converts left in XLA:GPU's optimized HLO, bfloat16 roundings the case has) for fp4jax's
  quantizers fed by bfloat16 casts in the same jit. XLA:GPU's excess-precision rewrite deletes float32 -> bfloat16
  -> float32 convert pairs; a missing convert is a rounding the quantizer skipped (what the first H200 run showed
  for the RHT's output). fp4jax widens narrow inputs from their bits (fp4jax.grids.exact_float32), which keeps
  each one."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  x32 = jax.ShapeDtypeStruct((1024, 1536), jnp.float32)
  cast = lambda x: (x * 2).astype(jnp.bfloat16)
  cases = {  # name: (fn, roundings: the cast, and the RHT's output)
      "quantize(cast)": (lambda x: fp4jax.quantize(cast(x), "nvfp4").codes, 1),
      "quantize(RHT(cast)) along axis 0, SR": (lambda x: fp4jax.quantize(
          fp4jax.random_hadamard(cast(x), size=16, axis=0), "nvfp4", axis=0, rounding="stochastic",
          key=jax.random.key(0)).codes, 2),
  }
  out = []
  for name, (fn, roundings) in cases.items():
    text = compiled_hlo(fn, x32)
    out.append((name, len(re.findall(r"= bf16\[[0-9,]*\]\{[^}]*\} convert\(", text)), roundings))
  return out


def compile_all(out_dir: str | None = None) -> list[tuple[str, bool, str]]:
  """Compiles every case; returns (name, ok, detail) with the kernels' grid/threads/shared memory or the error."""
  dump = out_dir or tempfile.mkdtemp(prefix="fp4jax_aot_")
  # Per compile, not in XLA_FLAGS: those are read once, when jax starts its first backend, which in a test worker
  # another test may already have done.
  options = {"xla_dump_to": dump}
  results = []
  for name, fn, args in cases():
    before = set(glob.glob(os.path.join(dump, "*thunk_sequence.txt")))
    t0 = time.time()
    try:
      compile_sm90(fn, *args, compiler_options=options)
      kernels, launches = [], 0
      for path in sorted(set(glob.glob(os.path.join(dump, "*thunk_sequence.txt"))) - before):
        with open(path, encoding="utf-8") as f:
          text = f.read()
        kernels += sorted({re.sub(r"\s+", " ", m.group(0)) for m in
                           re.finditer(r"(fp4_matmul|quantize\w*|rht\w*) grid: \[[^\]]*\] threads: \[[^\]]*\]\s+"
                                       r"shared_memory: \d+ bytes", text)})
        launches += len(re.findall(r" grid: \[", text))
      detail = "; ".join(kernels) if not name.startswith("train step") else f"{launches} kernel launches"
      results.append((name, True, f"{time.time() - t0:.1f} s; " + detail))
    except Exception as e:  # pylint: disable=broad-except
      results.append((name, False, f"{type(e).__name__}: {str(e).strip()[:300]}"))
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="XLA dump folder (default: a temporary one)")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  ok, why = supported()
  if not ok:
    print(f"deviceless cuda compilation unavailable here: {why}")
    return 2
  import jax  # pylint: disable=g-import-not-at-top
  results = compile_all(args.out)
  print(f"# sm_90 compile check, jax {jax.__version__}: {sum(r[1] for r in results)}/{len(results)} compiled")
  for name, good, detail in results:
    print(f"| {'OK' if good else 'FAIL'} | {name} | {detail} |")
  return 0 if all(r[1] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
