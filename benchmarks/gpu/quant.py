"""Section `quant`: fused quantizer bandwidth against a device copy measured in the same run, and against XLA.

Copy: `-x` on a bf16 tensor (one read and one write of every byte), the memory ceiling. Quantizer GB/s counts the
fewest bytes it must move: the input read, packed codes (0.5 B/element) and E4M3 scales (1/16 B/element) written
(stochastic rounding's hash bits are computed in the kernel since 2026-12-04; the first H200 run counted 4 B/element
of bits read, drawn by XLA, in the SR rows' GB/s). Each kernel's output is compared
with `fp4jax.quantize` (XLA) on the same input: the fraction of differing code bytes (0 expected without RHT).
The double-block row (TetraJet-v2) also writes one float32 amax per 1x128 group (1/32 B/element, not counted).
The 4/6 rows (`four_over_six`'s Fprop x and Wgrad dY^T) and the MS-EDEN row (`quartet2`'s Wgrad dY^T) are against
XLA's 4/6 and MS-EDEN, whose block errors and group corrections are separate passes.
"""

from __future__ import annotations

from benchmarks.gpu import report

QUANT_BENCH = [
    ("row 1x16 RNE (Fprop x)", dict()),
    ("2d 16x16 RNE (weight)", dict(block_2d=True)),
    ("row SR32 (Dgrad dY)", dict(rounding="stochastic")),
    ("col RHT16 + SR32 (Wgrad dY^T)", dict(axis=0, rht_size=16, rounding="stochastic")),
    # TetraJet-v2's Wgrad dY^T: one FP32 scale per 1x128 group, from the kernel's own tile (one pass, no amax pass).
    ("col RHT16 + SR32 double-block (tetrajet_v2 Wgrad dY^T)",
     dict(axis=0, rht_size=16, rounding="stochastic", double_block=True)),
    ("row 1x16 RNE 4/6 (four_over_six Fprop x)", dict(scale_rule="4over6")),
    ("col RHT16 + SR32 4/6 (four_over_six Wgrad dY^T)", dict(axis=0, rht_size=16, rounding="stochastic",
                                                             scale_rule="4over6")),
    ("col RHT128 + MS-EDEN SR scales (quartet2 Wgrad dY^T)", dict(axis=0, rht_size=128, rounding="stochastic",
                                                                  scale_rule="eden")),
]
# QUANT_BENCH keys that pick the NVFP4 variant, not quantizer arguments.
FORMAT_KEYS = ("double_block", "scale_rule", "headroom", "select", "select_on", "eden_group")


def format_and_args(kw):
  """(fp4jax.NVFP4 variant, the quantizer's other keyword arguments) of a QUANT_BENCH entry."""
  import fp4jax  # pylint: disable=g-import-not-at-top
  return (fp4jax.NVFP4(**{k: v for k, v in kw.items() if k in FORMAT_KEYS}),
          {k: v for k, v in kw.items() if k not in FORMAT_KEYS})


def run(sec: report.Section) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import quantize_nvfp4  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  shape = (256, 256) if sec.dry else (8192, 8192)
  reps = 2 if sec.dry else 5
  key = jax.random.key(int(time.time()))
  xs = [report.random_input(k, shape, jnp.bfloat16) for k in jax.random.split(key, 2)]  # 2 x 128 MB > L2
  n = xs[0].size
  copy_gbs = None
  try:
    neg = jax.jit(lambda x: -x)
    t = report.median_time(neg, [(x,) for x in xs], reps=reps)
    fro, mx, fin = report.rel_errors(neg(xs[0]), -xs[0].astype(jnp.float32))
    copy_gbs = 2 * xs[0].nbytes / t / 1e9
    sec.add(f"device copy bf16 {shape}", copy_gbs, "GB/s", err=mx, ok=fin, note=f"{t * 1e6:.1f} us")
  except Exception as e:  # pylint: disable=broad-except
    sec.fail("device copy", e)
  k = jax.random.key(1)
  for name, kw in QUANT_BENCH:
    label = f"quantize {name} bf16 {shape}"
    if not sec.has_time(10):
      sec.skip(label, "time budget")
      continue
    try:
      sr, rht = kw.get("rounding") == "stochastic", kw.get("rht_size")
      fmt, kw = format_and_args(kw)
      ref_kw = {kk: v for kk, v in kw.items() if kk != "rht_size"}
      kernel = jax.jit(lambda x, k, kw=kw, sr=sr, fmt=fmt: quantize_nvfp4(x, interpret=sec.dry, key=k if sr else None,
                                                                          fmt=fmt, **kw))

      def xla(x, k, rht=rht, ref_kw=ref_kw, sr=sr, axis=kw.get("axis", -1), fmt=fmt):
        xr = x if rht is None else fp4jax.random_hadamard(x, size=rht, axis=axis)
        return fp4jax.quantize(xr, fmt, key=k if sr else None, **ref_kw)

      xla = jax.jit(xla)
      t = report.median_time(kernel, [(x, k) for x in xs], reps=reps)
      t_xla = report.median_time(xla, [(x, k) for x in xs], reps=reps)
      q, r = kernel(xs[0], k), xla(xs[0], k)
      mismatch = float(jnp.mean((q.codes != r.codes).astype(jnp.float32)))
      scales_differ = int(jnp.sum(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
                                  != jax.lax.bitcast_convert_type(r.scales, jnp.uint8)))
      moved = n * 2 + n // 2 + n // 16  # x in, codes and scales out (the hash bits are computed in the kernel)
      gbs = moved / t / 1e9
      ok = mismatch == 0 and scales_differ == 0 if rht is None else mismatch < 1e-3
      sec.add(label, gbs, "GB/s", copy_gbs, "copy GB/s", err=mismatch, ok=bool(ok),
              note=f"{t * 1e6:.1f} us; XLA fp4jax.quantize {t_xla * 1e6:.1f} us (kernel speedup {t_xla / t:.2f}x); "
                   f"code bytes differing {mismatch:.2g}, scales differing {scales_differ}")
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(label, e)
