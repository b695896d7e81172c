"""Sections `gemm` and `tiles`: FP4 GEMM throughput against bf16 `jnp.dot` and against fp4jax's xla path.

`gemm`: for M x N x K = 16 x 8192 x 8192 (memory-bound) and 8192^3 (compute-bound), then 128 and 1024 tokens if
time allows: TFLOP/s (2MNK / median time) of
  * bf16 `jnp.dot` (float32 accumulation) on the unquantized operands: the baseline;
  * the xla path, float32 HIGHEST on dequantized operands (fp4jax's reference GEMM; its output is `ref`);
  * the xla path in its default bf16-operand mode (gemm_mode="bf16": code x block scale in bf16);
  * `pallas_kernels.fp4_matmul` with default tiles and split-K.
Operands as in Fprop: x [M, K] 1x16 blocks along K, W [K, N] 16x16 blocks. Every output is compared with `ref`
(err = ||out - ref|| / ||ref||; bf16 jnp.dot against a float32 HIGHEST dot of its own inputs). Weight sets rotate
so that a 36 MB packed weight is not served from the 60 MB L2. The last row proposes fp4jax.backends.GEMM_ROUTES.
`tiles`: tile, warp and split-K variants at 8192^3 and at M=16, each also compared with `ref`.
"""

from __future__ import annotations

from benchmarks.gpu import report

GEMM_SIZES = [(16, 8192, 8192), (8192, 8192, 8192), (128, 8192, 8192), (1024, 8192, 8192)]
DRY_SIZES = [(16, 64, 128), (64, 64, 128)]
TILE_VARIANTS = [  # (tiles, split_k, num_warps) at 8192^3, most informative first
    ((128, 256, 64), 1, 8), ((128, 128, 64), 1, 8), ((128, 256, 128), 1, 8), ((256, 128, 64), 1, 8),
    ((128, 128, 128), 1, 4), ((64, 256, 128), 1, 4), ((128, 128, 256), 1, 8)]
SKINNY_VARIANTS = [  # at M=16
    ((16, 64, 256), 1, 4), ((16, 64, 256), 4, 4), ((16, 64, 256), 8, 4), ((16, 128, 256), 2, 4),
    ((16, 64, 512), 2, 4), ((16, 32, 256), 2, 4)]


class Gemm:
  """One GEMM size: inputs, quantized operands, and the reference output."""

  def __init__(self, sec: report.Section, m: int, n: int, k: int, key):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import fp4jax  # pylint: disable=g-import-not-at-top
    import fp4jax.gemm  # pylint: disable=g-import-not-at-top
    self.sec, self.m, self.n, self.k = sec, m, n, k
    self.flops = 2.0 * m * n * k
    sets = 1 if sec.dry else max(1, min(4, int(2 * 60e6 // (n * k * 0.5625)) + 1))  # > 2x L2 in packed weights
    keys = jax.random.split(key, 2 * sets)
    self.x = [report.random_input(keys[2 * i], (m, k), jnp.bfloat16) for i in range(sets)]
    self.w = [report.random_input(keys[2 * i + 1], (k, n), jnp.bfloat16) for i in range(sets)]
    qa = jax.jit(lambda x: fp4jax.quantize(x, "nvfp4", axis=1))
    qb = jax.jit(lambda w: fp4jax.quantize(w, "nvfp4", axis=0, block_2d=True))
    self.a = [qa(x) for x in self.x]
    self.b = [qb(w) for w in self.w]
    # The library's xla-path GEMM, in its float32 HIGHEST mode: the reference every timed path is checked against.
    self.recipe = fp4jax.recipes.nvfp4().replace(gemm_mode="f32")
    self.xla_gemm = fp4jax.gemm.gemm
    self.ref = jax.jit(lambda a, b: self.xla_gemm(a, b, (1, 0), self.recipe))(self.a[0], self.b[0])

  def label(self) -> str:
    return f"M,N,K={self.m},{self.n},{self.k}"

  def time(self, fn, operands: str = "q"):
    """(seconds, rel err vs ref, max err, finite) of jitted fn over the rotating operand sets."""
    import jax  # pylint: disable=g-import-not-at-top
    sets = list(zip(self.a, self.b)) if operands == "q" else list(zip(self.x, self.w))
    jfn = jax.jit(fn)
    t = report.median_time(jfn, sets, target_s=0.02 if self.sec.dry else 0.1, reps=2 if self.sec.dry else 5)
    return (t, *report.rel_errors(jfn(*sets[0]), self.ref))


def _tflops(g: Gemm, t: float) -> float:
  return g.flops / t / 1e12


def bench_size(sec: report.Section, g: Gemm) -> dict:
  """The rows of one size; returns {path: seconds} for the dispatch proposal."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fp4_matmul  # pylint: disable=g-import-not-at-top
  times = {}
  # bf16 baseline, checked against a float32 HIGHEST dot of its own inputs.
  bf16 = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
  t = report.median_time(jax.jit(bf16), list(zip(g.x, g.w)), target_s=0.1, reps=2 if sec.dry else 5)
  own_ref = jnp.dot(g.x[0].astype(jnp.float32), g.w[0].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  fro, mx, fin = report.rel_errors(jax.jit(bf16)(g.x[0], g.w[0]), own_ref)
  times["bf16"] = t
  sec.add(f"bf16 jnp.dot {g.label()}", _tflops(g, t), "TFLOP/s", err=mx, ok=fin,
          note=f"{t * 1e6:.1f} us; err vs f32 dot of the same bf16 inputs: rel {fro:.2g}")
  paths = [("xla f32 HIGHEST (reference)", lambda a, b: g.xla_gemm(a, b, (1, 0), g.recipe))]
  bf16_recipe = g.recipe.replace(gemm_mode="bf16")
  paths.append(("xla bf16-operand (gemm_mode='bf16', the default)", lambda a, b: g.xla_gemm(a, b, (1, 0), bf16_recipe)))
  paths.append(("pallas fp4_matmul", lambda a, b: fp4_matmul(a, b, interpret=sec.dry)))
  for name, fn in paths:
    if not sec.has_time(12):
      sec.skip(f"{name} {g.label()}", "time budget")
      continue
    try:
      t, fro, mx, fin = g.time(fn)
      times[name] = t
      tol = 1e-5 if "bf16-operand" not in name and "reference" not in name else 1e-4
      sec.add(f"{name} {g.label()}", _tflops(g, t), "TFLOP/s", _tflops(g, times["bf16"]), "bf16 TFLOP/s",
              err=mx, ok=bool(fin and fro < tol) if "reference" not in name else fin,
              note=f"{t * 1e6:.1f} us; rel err {fro:.2g}")
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(f"{name} {g.label()}", e)
  pallas = times.get("pallas fp4_matmul")
  for name, t in times.items():
    if pallas and name.startswith("xla"):
      sec.add(f"  pallas speedup vs {name.split(' (')[0]} {g.label()}", t / pallas, "x")
  return times


def propose_routes(sec: report.Section, measured: dict) -> None:
  """The GEMM_ROUTES rows these timings support: pallas up to the largest min-dim where it beat the best xla path
  at every measured size up to it, xla above. Printed for a person to paste; nothing is changed automatically."""
  import jax  # pylint: disable=g-import-not-at-top
  kind = jax.devices()[0].device_kind
  wins = []
  for mnk, times in sorted(measured.items(), key=lambda kv: min(kv[0])):
    xla = [t for n, t in times.items() if n.startswith("xla")]
    if "pallas fp4_matmul" in times and xla:
      wins.append((min(mnk), times["pallas fp4_matmul"] < min(xla)))
  if not wins:
    sec.add("dispatch proposal", note="no size has both a pallas and an xla time")
    return
  limit = 0
  for dim, win in wins:
    if not win:
      break
    limit = dim
  rows = []
  if limit:
    rows.append(f"GemmRoute({kind!r}, {limit}, 'pallas', 'benchmarks/gpu.sh gemm, jax {jax.__version__}')")
  if not all(w for _, w in wins):
    rows.append(f"GemmRoute({kind!r}, 1 << 62, 'xla', 'benchmarks/gpu.sh gemm, jax {jax.__version__}')")
  sec.add("dispatch proposal", note="GEMM_ROUTES = (" + ", ".join(rows) + ",)  # pallas wins by min(M,N,K): " +
          ", ".join(f"{d}:{'pallas' if w else 'xla'}" for d, w in wins))


def run(sec: report.Section) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  key = jax.random.key(int(time.time()))
  measured = {}
  for i, (m, n, k) in enumerate(DRY_SIZES if sec.dry else GEMM_SIZES):
    if not sec.has_time(25 if i < 2 else 20):
      sec.skip(f"gemm M,N,K={m},{n},{k}", "time budget")
      continue
    try:
      measured[(m, n, k)] = bench_size(sec, Gemm(sec, m, n, k, jax.random.fold_in(key, i)))
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(f"gemm M,N,K={m},{n},{k}", e)
  propose_routes(sec, measured)


def run_tiles(sec: report.Section) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fp4_matmul  # pylint: disable=g-import-not-at-top
  key = jax.random.key(int(time.time()))
  if sec.dry:
    plan = [((16, 64, 128), [((16, 32, 64), 2, 4)]), ((64, 64, 128), [((32, 32, 64), 1, 4)])]
  else:
    plan = [((16, 8192, 8192), SKINNY_VARIANTS), ((8192, 8192, 8192), TILE_VARIANTS)]
  for i, (mnk, variants) in enumerate(plan):
    if not sec.has_time(20):
      sec.skip(f"tiles M,N,K={mnk}", "time budget")
      continue
    try:
      g = Gemm(sec, *mnk, jax.random.fold_in(key, i))
      t0, fro, mx, fin = g.time(lambda a, b: fp4_matmul(a, b, interpret=sec.dry))
      sec.add(f"default tiles {g.label()}", _tflops(g, t0), "TFLOP/s", err=mx, ok=bool(fin and fro < 1e-5),
              note=f"{t0 * 1e6:.1f} us; rel err {fro:.2g}")
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(f"tiles M,N,K={mnk}", e)
      continue
    for tiles, split, warps in variants:
      label = f"tiles {tiles} split_k={split} warps={warps} {g.label()}"
      if not sec.has_time(8):
        sec.skip(label, "time budget")
        continue
      try:
        t, fro, mx, fin = g.time(lambda a, b, tiles=tiles, split=split, warps=warps: fp4_matmul(
            a, b, interpret=sec.dry, tiles=tiles, split_k=split, num_warps=warps))
        sec.add(label, _tflops(g, t), "TFLOP/s", _tflops(g, t0), "default", err=mx, ok=bool(fin and fro < 1e-5),
                note=f"{t * 1e6:.1f} us; rel err {fro:.2g}")
      except Exception as e:  # pylint: disable=broad-except
        sec.fail(label, e)
