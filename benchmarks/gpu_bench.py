"""One prepared GPU check and benchmark of pallas_kernels: correctness first, then one table of speeds.

  PYTHONPATH=. python benchmarks/gpu_bench.py --out $OUT            # on the GPU (benchmarks/gpu.sh wraps this)
  PYTHONPATH=. python benchmarks/gpu_bench.py --smoke               # tiny sizes, interpret mode: checks the script

Sections (each row is independent: a failure is recorded with its traceback in errors.txt and the run goes on):
  check   every kernel vs the XLA reference on fresh random inputs (two draws per config, so an output buffer left
          over from an earlier run cannot pass): quantize codes/scales/amax mismatches (0 expected; RHT rows may
          differ in rare codes because Triton and XLA sum the 16 RHT products in different orders), GEMM max
          |out - ref| / (|a| @ |b|) against dequantize + float32 HIGHEST matmul.
  copy    device-to-device bandwidth (read + write) measured in the same run: the ceiling for quantize.
  quant   fused quantize, bytes moved (input read + codes/scales written, + random bits for SR) per second, vs the
          copy and vs fp4jax.quantize (XLA) on the same input.
  gemm    fp4_matmul TFLOP/s (2MNK / time) vs jnp.dot in bf16 (f32 accumulation) and vs XLA emulation
          (dequantize to bf16 + dot), M=16 (memory-bound) to 8192^3 (compute-bound).
  linear  one quantized linear layer forward + backward (fp4jax.dot_general, nvfp4 recipe) with backend="pallas"
          and "xla" vs the bf16 recipe; skipped with a message if this fp4jax has no pallas backend.
Times: median over repeats of back-to-back calls (jax dispatch is asynchronous, so launches overlap).
Table columns: value, baseline, ratio = value / baseline (quant: fraction of copy bandwidth; gemm: FP4 / bf16
throughput; linear: time relative to bf16, > 1 is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp4jax  # pylint: disable=g-import-not-at-top
import pallas_kernels  # pylint: disable=g-import-not-at-top
from pallas_kernels import fp4_matmul  # pylint: disable=g-import-not-at-top
from pallas_kernels import quantize_nvfp4  # pylint: disable=g-import-not-at-top

HIGHEST = jax.lax.Precision.HIGHEST


class Report:
  """Collects rows and errors; writes them under `out` as they come, so a killed run still leaves results."""

  def __init__(self, out: str, deadline: float):
    self.out, self.deadline, self.rows, self.errors = out, deadline, [], []
    os.makedirs(out, exist_ok=True)

  def time_left(self) -> float:
    return self.deadline - time.time()

  def add(self, section, name, value=None, unit="", baseline=None, base_name="", ok=None, note=""):
    row = dict(section=section, name=name, value=value, unit=unit, baseline=baseline, base_name=base_name,
               ratio=(value / baseline if value is not None and baseline else None), ok=ok, note=note)
    self.rows.append(row)
    print(self._line(row), flush=True)
    self.flush()

  def fail(self, section, name, exc):
    tb = traceback.format_exc()
    self.errors.append(f"== {section} / {name}\n{tb}")
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    self.add(section, name, ok=False, note=f"ERROR {type(exc).__name__}: {first}")

  def skip(self, section, name, why):
    self.add(section, name, note=f"skipped: {why}")

  @staticmethod
  def _fmt(v):
    if v is None:
      return ""
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)

  def _line(self, r):
    ok = {True: "PASS", False: "FAIL", None: ""}[r["ok"]]
    ratio = f"{r['ratio']:.3g}x" if r["ratio"] is not None else ""
    return (f"| {r['section']:<6} | {r['name']:<56} | {self._fmt(r['value']):>10} {r['unit']:<7} | "
            f"{self._fmt(r['baseline']):>10} {r['base_name']:<14} | {ratio:>7} | {ok:<4} | {r['note']}")

  def table(self) -> str:
    head = (f"| {'sect':<6} | {'name':<56} | {'value':>10} {'unit':<7} | {'baseline':>10} {'(which)':<14} | "
            f"{'ratio':>7} | ok   | note")
    sep = "|" + "-" * (len(head) - 2) + "|"
    return "\n".join([head, sep] + [self._line(r) for r in self.rows])

  def flush(self):
    with open(os.path.join(self.out, "gpu_bench.json"), "w") as f:
      json.dump(self.rows, f, indent=1, default=str)
    with open(os.path.join(self.out, "gpu_bench.md"), "w") as f:
      f.write(self.table() + "\n")
    with open(os.path.join(self.out, "errors.txt"), "w") as f:
      f.write("\n".join(self.errors))


def median_time(fn, *args, target_s: float = 0.05, reps: int = 5) -> float:
  """Median seconds per call of a jitted fn (compiled and warmed up first)."""
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t, 1e-6)
  iters = int(min(max(target_s / one, 1), 200))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def random_input(key, shape, dtype, scale=1.0):
  """Normal values with log-normal magnitudes (a wide range of block scales), drawn on the device."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(jax.random.normal(k2, shape, jnp.float32)) * scale
  return x.astype(dtype)


def _bits(a):
  return jax.lax.bitcast_convert_type(a, jnp.uint8)


# --- correctness -------------------------------------------------------------------------------------------------

QUANT_CONFIGS = [
    ("row 1x16 RNE", dict()),
    ("col 16x1 (axis 0) RNE", dict(axis=0)),
    ("2d 16x16 RNE", dict(block_2d=True)),
    ("2d 16x16 packed along rows", dict(block_2d=True, axis=0)),
    ("row SR32", dict(rounding="stochastic")),
    ("col SR8", dict(axis=0, rounding="stochastic", random_bits=8)),
    ("row RHT16", dict(rht_size=16)),
    ("col RHT16 + SR32 (Wgrad dY^T)", dict(axis=0, rht_size=16, rounding="stochastic")),
]


def check_quantize(rep: Report, shape, interpret, key):
  for name, kw in QUANT_CONFIGS:
    for dtype in (jnp.bfloat16, jnp.float32):
      label = f"quantize {name} {jnp.dtype(dtype).name} {shape}"
      if rep.time_left() < 60:
        rep.skip("check", label, "time budget")
        continue
      try:
        sr = kw.get("rounding") == "stochastic"
        rht = kw.get("rht_size")
        ref_kw = {k: v for k, v in kw.items() if k != "rht_size"}

        @jax.jit
        def both(x, k, kw=kw, rht=rht, ref_kw=ref_kw, sr=sr):
          q = quantize_nvfp4(x, interpret=interpret, key=k if sr else None, **kw)
          xr = x if rht is None else fp4jax.random_hadamard(x, size=rht, axis=kw.get("axis", -1))
          r = fp4jax.quantize(xr, "nvfp4", key=k if sr else None, **ref_kw)
          return (jnp.sum(q.codes != r.codes), jnp.sum(_bits(q.scales) != _bits(r.scales)),
                  jnp.abs(q.amax - r.amax) / r.amax, jnp.sum(jnp.isnan(fp4jax.dequantize(q))))

        worst = [0, 0, 0.0, 0]
        for _ in range(2):
          key, kx, kq = jax.random.split(key, 3)
          res = [np.asarray(v) for v in both(random_input(kx, shape, dtype), kq)]
          worst = [max(worst[0], int(res[0])), max(worst[1], int(res[1])), max(worst[2], float(res[2])),
                   max(worst[3], int(res[3]))]
        n_codes = int(np.prod(shape)) // 2
        frac = worst[0] / n_codes
        if rht is None:  # bit-identical expected
          ok = worst[0] == 0 and worst[1] == 0 and worst[2] == 0 and worst[3] == 0
        else:  # the RHT's float32 sums may differ in the last bit: rare code/scale flips, amax within 1 bf16 ulp
          ok = frac < 1e-3 and worst[1] < 1e-3 * n_codes / 8 and worst[2] <= 2.0**-8 and worst[3] == 0
        rep.add("check", label, frac, "mism.", ok=ok,
                note=f"code bytes differing {worst[0]}/{n_codes}, scales differing {worst[1]}, "
                     f"amax rel diff {worst[2]:.2g}")
      except Exception as e:  # pylint: disable=broad-except
        rep.fail("check", label, e)


GEMM_CONFIGS = [
    ("1x16 @ 1x16 (Fprop, 1D weight)", dict(axis=1), dict(axis=0), (1, 0), "nvfp4"),
    ("1x16 @ 16x16 (Fprop, 2D weight)", dict(axis=1), dict(axis=0, block_2d=True), (1, 0), "nvfp4"),
    ("Dgrad: dY @ W^T, W 2D packed along K", dict(axis=1), dict(axis=0, block_2d=True), (1, 1), "nvfp4"),
    ("Wgrad: x^T @ dY, both blocked along M", dict(axis=0), dict(axis=0), (0, 0), "nvfp4"),
    ("MXFP4 1x32 @ 32x1", dict(axis=1), dict(axis=0), (1, 0), "mxfp4"),
]


def check_gemm(rep: Report, mnk, interpret, key):
  m, n, k = mnk
  for name, ka, kb, contract, fmt in GEMM_CONFIGS:
    label = f"gemm {name} M,N,K={m},{n},{k}"
    if rep.time_left() < 60:
      rep.skip("check", label, "time budget")
      continue
    try:
      a_shape = (m, k) if contract[0] == 1 else (k, m)
      b_shape = (k, n) if contract[1] == 0 else (n, k)

      @jax.jit
      def both(xa, xb, ka=ka, kb=kb, contract=contract, fmt=fmt):
        a, b = fp4jax.quantize(xa, fmt, **ka), fp4jax.quantize(xb, fmt, **kb)
        out = fp4_matmul(a, b, contract=contract, interpret=interpret)
        dims = (((contract[0],), (contract[1],)), ((), ()))
        da, db = fp4jax.dequantize(a), fp4jax.dequantize(b)
        ref = jax.lax.dot_general(da, db, dims, precision=HIGHEST)
        bound = jax.lax.dot_general(jnp.abs(da), jnp.abs(db), dims, precision=HIGHEST)
        return jnp.max(jnp.abs(out - ref) / (bound + 1e-30)), jnp.all(jnp.isfinite(out)), jnp.max(bound) > 0

      worst, finite, nonzero = 0.0, True, True
      for _ in range(2):
        key, k1, k2 = jax.random.split(key, 3)
        err, fin, nz = both(random_input(k1, a_shape, jnp.float32), random_input(k2, b_shape, jnp.float32))
        worst, finite, nonzero = max(worst, float(err)), finite and bool(fin), nonzero and bool(nz)
      rep.add("check", label, worst, "err/bnd", ok=bool(finite and nonzero and worst < 1e-5),
              note="max |out-ref| / (|a|@|b|); f32 summation order only" + ("" if finite else "; NON-FINITE"))
    except Exception as e:  # pylint: disable=broad-except
      rep.fail("check", label, e)


# --- speed -------------------------------------------------------------------------------------------------------

def bench_copy(rep: Report, shape, key) -> float | None:
  try:
    x = random_input(key, shape, jnp.bfloat16)
    t = median_time(jax.jit(lambda x: -x), x)  # one read + one write of every byte: a device-to-device copy
    gbs = 2 * x.nbytes / t / 1e9
    rep.add("copy", f"d2d copy bf16 {shape}", gbs, "GB/s", note=f"{t * 1e6:.1f} us")
    return gbs
  except Exception as e:  # pylint: disable=broad-except
    rep.fail("copy", "d2d copy", e)
    return None


QUANT_BENCH = [
    ("row 1x16 RNE (Fprop x)", dict()),
    ("2d 16x16 RNE (weight)", dict(block_2d=True)),
    ("row SR32 (Dgrad dY)", dict(rounding="stochastic")),
    ("col RHT16 + SR32 (Wgrad dY^T)", dict(axis=0, rht_size=16, rounding="stochastic")),
    ("col RHT16 RNE (Wgrad x^T)", dict(axis=0, rht_size=16)),
]


def bench_quantize(rep: Report, shape, copy_gbs, interpret, key):
  x = random_input(key, shape, jnp.bfloat16)
  n = int(np.prod(shape))
  for name, kw in QUANT_BENCH:
    label = f"quantize {name} bf16 {shape}"
    if rep.time_left() < 45:
      rep.skip("quant", label, "time budget")
      continue
    try:
      sr = kw.get("rounding") == "stochastic"
      k = jax.random.key(1)
      f = jax.jit(lambda x, k, kw=kw, sr=sr: quantize_nvfp4(x, interpret=interpret, key=k if sr else None, **kw))
      t = median_time(f, x, k)
      moved = n * 2 + n // 2 + n // 16 + (4 * n if sr else 0)  # x read, codes + scales written, random bits read
      gbs = moved / t / 1e9
      rep.add("quant", label, gbs, "GB/s", copy_gbs, "copy GB/s", note=f"{t * 1e6:.1f} us")
      rht = kw.get("rht_size")
      ref_kw = {kk: v for kk, v in kw.items() if kk != "rht_size"}

      def xla(x, k, rht=rht, ref_kw=ref_kw, sr=sr, axis=kw.get("axis", -1)):
        xr = x if rht is None else fp4jax.random_hadamard(x, size=rht, axis=axis)
        return fp4jax.quantize(xr, "nvfp4", key=k if sr else None, **ref_kw)

      t_xla = median_time(jax.jit(xla), x, k)
      rep.add("quant", f"  vs fp4jax.quantize (XLA): speedup", t_xla / t, "x", note=f"XLA {t_xla * 1e6:.1f} us")
    except Exception as e:  # pylint: disable=broad-except
      rep.fail("quant", label, e)


GEMM_SIZES = [(16, 8192, 8192), (128, 8192, 8192), (1024, 4096, 4096), (4096, 4096, 4096), (8192, 8192, 8192)]
# Tile variants timed on one compute-bound size, to pick better defaults from the first GPU run.
TILE_VARIANTS = [(128, 128, 128), (128, 256, 64), (64, 128, 128), (256, 128, 64)]


def bench_gemm(rep: Report, sizes, interpret, key, tile_variants_at=None, tile_variants=()):
  for m, n, k in sizes:
    label = f"fp4_matmul nvfp4 M,N,K={m},{n},{k}"
    if rep.time_left() < 45:
      rep.skip("gemm", label, "time budget")
      continue
    try:
      key, k1, k2 = jax.random.split(key, 3)
      xa, xb = random_input(k1, (m, k), jnp.bfloat16), random_input(k2, (k, n), jnp.bfloat16)
      a = jax.jit(lambda x: fp4jax.quantize(x, "nvfp4", axis=1))(xa)
      b = jax.jit(lambda x: fp4jax.quantize(x, "nvfp4", axis=0, block_2d=True))(xb)
      flops = 2.0 * m * n * k
      t = median_time(jax.jit(lambda a, b: fp4_matmul(a, b, interpret=interpret)), a, b)
      t_bf16 = median_time(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)), xa, xb)
      rep.add("gemm", label, flops / t / 1e12, "TFLOP/s", flops / t_bf16 / 1e12, "bf16 jnp.dot",
              note=f"{t * 1e6:.1f} us vs bf16 {t_bf16 * 1e6:.1f} us")
      emu = jax.jit(lambda a, b: jnp.dot(fp4jax.dequantize(a, jnp.bfloat16), fp4jax.dequantize(b, jnp.bfloat16),
                                         preferred_element_type=jnp.float32))
      t_emu = median_time(emu, a, b)
      rep.add("gemm", "  vs XLA dequantize(bf16) + dot: speedup", t_emu / t, "x", note=f"XLA {t_emu * 1e6:.1f} us")
      if (m, n, k) == tile_variants_at:
        for tiles in tile_variants:
          if rep.time_left() < 45:
            break
          try:
            t_v = median_time(jax.jit(lambda a, b, tiles=tiles: fp4_matmul(a, b, interpret=interpret, tiles=tiles)),
                              a, b)
            rep.add("gemm", f"  tiles {tiles}", flops / t_v / 1e12, "TFLOP/s", flops / t / 1e12, "default tiles")
          except Exception as e:  # pylint: disable=broad-except
            rep.fail("gemm", f"  tiles {tiles}", e)
    except Exception as e:  # pylint: disable=broad-except
      rep.fail("gemm", label, e)


def bench_linear(rep: Report, tokens, d_in, d_out, key):
  recipes = getattr(fp4jax, "recipes", None)
  dot_general = getattr(fp4jax, "dot_general", None)
  if recipes is None or dot_general is None or not hasattr(recipes, "nvfp4"):
    rep.skip("linear", "quantized linear fwd+bwd", "fp4jax.dot_general / fp4jax.recipes not found")
    return
  k1, k2, k3 = jax.random.split(key, 3)
  x = random_input(k1, (tokens, d_in), jnp.bfloat16)
  w = random_input(k2, (d_in, d_out), jnp.float32, 0.02)
  dims = (((1,), (0,)), ((), ()))

  def step_fn(recipe):
    def loss(x, w, key):
      y = dot_general(x, w.astype(jnp.bfloat16), dims, recipe=recipe, key=key)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))

  times = {}
  for name, make in (("bf16", lambda: recipes.bf16()), ("nvfp4 xla", lambda: recipes.nvfp4(backend="xla")),
                     ("nvfp4 pallas", lambda: recipes.nvfp4(backend="pallas"))):
    label = f"linear fwd+bwd {name} [{tokens}x{d_in}]@[{d_in}x{d_out}]"
    if rep.time_left() < 40:
      rep.skip("linear", label, "time budget")
      continue
    try:
      recipe = make()
    except Exception as e:  # pylint: disable=broad-except
      rep.skip("linear", label, f"recipe unavailable ({type(e).__name__}: {e})")
      continue
    try:
      times[name] = median_time(step_fn(recipe), x, w, k3, reps=3)
      base = times.get("bf16")
      rep.add("linear", label, times[name] * 1e3, "ms", base * 1e3 if base else None, "bf16 ms")
    except Exception as e:  # pylint: disable=broad-except
      if name == "nvfp4 pallas" and isinstance(e, (ImportError, NotImplementedError, AttributeError)):
        rep.skip("linear", label, f"pallas backend not integrated in fp4jax.dot_general ({type(e).__name__}: {e})")
      else:
        rep.fail("linear", label, e)


# --- main --------------------------------------------------------------------------------------------------------

def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/out")
  parser.add_argument("--budget_s", type=float, default=420.0, help="stop starting new rows after this long")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (CPU): tests the script")
  args = parser.parse_args(argv)

  start = time.time()
  rep = Report(args.out, start + args.budget_s)
  ok, why = pallas_kernels.available(reason=True)
  dev = jax.devices()[0]
  env = (f"jax {jax.__version__}, backend {jax.default_backend()}, device {dev.device_kind}, "
         f"kernels available: {ok} ({why})")
  print(env, flush=True)
  with open(os.path.join(args.out, "env.txt"), "w") as f:
    f.write(env + "\n")
  if not ok and not args.smoke:
    print("Compiled Pallas kernels cannot run here; use --smoke on CPU.", flush=True)
    return 2
  interpret = bool(args.smoke)
  key = jax.random.key(int(time.time()))  # fresh inputs every run
  keys = jax.random.split(key, 8)

  if args.smoke:
    check_quantize(rep, (64, 128), interpret, keys[0])
    check_gemm(rep, (48, 64, 96), interpret, keys[1])
    copy_gbs = bench_copy(rep, (256, 256), keys[2])
    bench_quantize(rep, (256, 256), copy_gbs, interpret, keys[3])
    bench_gemm(rep, [(16, 128, 128), (128, 128, 128)], interpret, keys[4], (128, 128, 128), [(32, 32, 64)])
    bench_linear(rep, 64, 64, 64, keys[5])
  else:
    check_quantize(rep, (2048, 1536), interpret, keys[0])
    check_gemm(rep, (1024, 768, 2048), interpret, keys[1])
    check_gemm(rep, (16, 256, 512), interpret, keys[6])
    copy_gbs = bench_copy(rep, (8192, 8192), keys[2])
    bench_quantize(rep, (8192, 8192), copy_gbs, interpret, keys[3])
    bench_gemm(rep, GEMM_SIZES, interpret, keys[4], (4096, 4096, 4096), TILE_VARIANTS)
    bench_linear(rep, 8192, 4096, 4096, keys[5])

  print(f"\n# pallas_kernels GPU check + benchmark ({time.time() - start:.0f} s)\n{env}\n", flush=True)
  print(rep.table(), flush=True)
  n_fail = sum(r["ok"] is False for r in rep.rows)
  print(f"\n{n_fail} failed rows; full tracebacks in {os.path.join(args.out, 'errors.txt')}", flush=True)
  rep.flush()
  return 1 if n_fail else 0


if __name__ == "__main__":
  sys.exit(main())
