"""Section `check`: the kernels against the XLA reference on fresh random inputs, before anything is timed.

Quantizer: codes, scale bits and amax of `pallas_kernels.quantize_nvfp4` vs `fp4jax.quantize` for bf16 and float32
input in each layout (bit-identical expected; RHT rows may flip rare codes: Triton and XLA sum the 16 RHT products
in different orders). GEMM: `fp4_matmul` vs dequantize + float32 HIGHEST matmul (fp4jax's xla path) for each
operand layout and a split-K case: max |out - ref| / (|a| @ |b|) must stay under 1e-5 (summation order only).
Two draws per configuration, so an output buffer left over from an earlier run cannot pass.
"""

from __future__ import annotations

from benchmarks.gpu import report

QUANT_CONFIGS = [
    ("row 1x16 RNE", dict()),
    ("col 16x1 (axis 0) RNE", dict(axis=0)),
    ("2d 16x16 RNE", dict(block_2d=True)),
    ("2d 16x16 packed along rows", dict(block_2d=True, axis=0)),
    ("row SR32", dict(rounding="stochastic")),
    ("col RHT16 + SR32 (Wgrad dY^T)", dict(axis=0, rht_size=16, rounding="stochastic")),
]
GEMM_CONFIGS = [  # label, a quantize kwargs, b quantize kwargs, contract, format, split_k
    ("Fprop 1x16 @ 1x16", dict(axis=1), dict(axis=0), (1, 0), "nvfp4", None),
    ("Fprop 1x16 @ 16x16 (2D weight)", dict(axis=1), dict(axis=0, block_2d=True), (1, 0), "nvfp4", None),
    ("Dgrad dY @ W^T, W 2D packed along K", dict(axis=1), dict(axis=0, block_2d=True), (1, 1), "nvfp4", None),
    ("Wgrad x^T @ dY, both blocked along M", dict(axis=0), dict(axis=0), (0, 0), "nvfp4", None),
    ("MXFP4 1x32 @ 32x1", dict(axis=1), dict(axis=0), (1, 0), "mxfp4", None),
    ("Fprop 2D weight, split_k=4", dict(axis=1), dict(axis=0, block_2d=True), (1, 0), "nvfp4", 4),
]


def check_quantize(sec: report.Section, shape, key, configs=QUANT_CONFIGS) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import quantize_nvfp4  # pylint: disable=g-import-not-at-top
  bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
  for name, kw in configs:
    for dtype in (jnp.bfloat16, jnp.float32):
      label = f"quantize {name} {jnp.dtype(dtype).name} {shape}"
      if not sec.has_time(8):
        sec.skip(label, "time budget")
        continue
      try:
        sr, rht = kw.get("rounding") == "stochastic", kw.get("rht_size")
        ref_kw = {k: v for k, v in kw.items() if k != "rht_size"}

        @jax.jit
        def both(x, k, kw=kw, rht=rht, ref_kw=ref_kw, sr=sr):
          q = quantize_nvfp4(x, interpret=sec.dry, key=k if sr else None, **kw)
          xr = x if rht is None else fp4jax.random_hadamard(x, size=rht, axis=kw.get("axis", -1))
          r = fp4jax.quantize(xr, "nvfp4", key=k if sr else None, **ref_kw)
          return (jnp.sum(q.codes != r.codes), jnp.sum(bits(q.scales) != bits(r.scales)),
                  jnp.abs(q.amax - r.amax) / r.amax, jnp.sum(jnp.isnan(fp4jax.dequantize(q))))

        worst = np.zeros(4)
        for _ in range(2):
          key, kx, kq = jax.random.split(key, 3)
          res = np.array([float(v) for v in both(report.random_input(kx, shape, dtype), kq)])
          worst = np.maximum(worst, res)
        n_codes = int(np.prod(shape)) // 2
        frac = worst[0] / n_codes
        if rht is None:
          ok = not worst.any()
        else:
          ok = frac < 1e-3 and worst[1] < 1e-3 * n_codes / 8 and worst[2] <= 2.0**-8 and worst[3] == 0
        sec.add(label, frac, "mismatch", err=float(frac), ok=bool(ok),
                note=f"code bytes differing {int(worst[0])}/{n_codes}, scales differing {int(worst[1])}, "
                     f"amax rel diff {worst[2]:.2g}, NaN after dequantize {int(worst[3])}")
      except Exception as e:  # pylint: disable=broad-except
        sec.fail(label, e)


def check_gemm(sec: report.Section, mnk, key, configs=GEMM_CONFIGS) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import fp4_matmul  # pylint: disable=g-import-not-at-top
  highest = jax.lax.Precision.HIGHEST
  m, n, k = mnk
  for name, ka, kb, contract, fmt, split in configs:
    label = f"gemm {name} M,N,K={m},{n},{k}"
    if not sec.has_time(10):
      sec.skip(label, "time budget")
      continue
    try:
      a_shape = (m, k) if contract[0] == 1 else (k, m)
      b_shape = (k, n) if contract[1] == 0 else (n, k)

      @jax.jit
      def both(xa, xb, ka=ka, kb=kb, contract=contract, fmt=fmt, split=split):
        a, b = fp4jax.quantize(xa, fmt, **ka), fp4jax.quantize(xb, fmt, **kb)
        out = fp4_matmul(a, b, contract=contract, interpret=sec.dry, split_k=split)
        dims = (((contract[0],), (contract[1],)), ((), ()))
        da, db = fp4jax.dequantize(a), fp4jax.dequantize(b)
        ref = jax.lax.dot_general(da, db, dims, precision=highest)
        bound = jax.lax.dot_general(jnp.abs(da), jnp.abs(db), dims, precision=highest)
        return (jnp.max(jnp.abs(out - ref) / (bound + 1e-30)), jnp.all(jnp.isfinite(out)), jnp.max(bound) > 0,
                jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

      worst, fro, finite, nonzero = 0.0, 0.0, True, True
      for _ in range(2):
        key, k1, k2 = jax.random.split(key, 3)
        e, fin, nz, f = both(report.random_input(k1, a_shape, jnp.float32), report.random_input(k2, b_shape,
                                                                                                jnp.float32))
        worst, fro = max(worst, float(e)), max(fro, float(f))
        finite, nonzero = finite and bool(fin), nonzero and bool(nz)
      sec.add(label, worst, "err/bnd", err=fro, ok=bool(finite and nonzero and worst < 1e-5),
              note="max |out-ref| / (|a|@|b|), err = ||out-ref||/||ref||" + ("" if finite else "; NON-FINITE"))
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(label, e)


def run(sec: report.Section) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  keys = jax.random.split(jax.random.key(int(time.time())), 3)  # fresh inputs every run
  if sec.dry:
    check_quantize(sec, (32, 64), keys[0], QUANT_CONFIGS[:1] + QUANT_CONFIGS[2:3])
    check_gemm(sec, (24, 48, 64), keys[1], GEMM_CONFIGS[2:3] + GEMM_CONFIGS[-1:])
    return
  check_gemm(sec, (1024, 768, 2048), keys[1])
  check_gemm(sec, (16, 512, 4096), keys[2], GEMM_CONFIGS[:1] + GEMM_CONFIGS[-1:])
  check_quantize(sec, (2048, 1536), keys[0])
