"""Hunts differences between the Pallas quantize kernel and the XLA path on the GPU and saves what decides them.

  python -m benchmarks.gpu.mismatch --out DIR          # on the GPU: counts, and DIR/mismatch.npz
  python -m benchmarks.gpu.mismatch --compare DIR      # on the CPU: which side matches fp4jax on the CPU

For each configuration (row and 2D blocks, RNE; bf16 and float32 input), shape and input source (drawn on the device
as the `check` and `quant` sections do, or by NumPy as `bits` does), it runs the kernel and `fp4jax.quantize` in
separate jits and in one jit, and counts differing code bytes. Where codes differ it saves the 16-row groups holding
them (at most 8 groups) and the group holding the tensor's amax: quantizing that subset reproduces every saved
block (blocks never cross a 16-row group; the global scale depends on the amax alone), so the CPU can tell which
side is wrong without the whole 8192 x 8192 input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CONFIGS = {"row_rne": dict(), "2d_rne": dict(block_2d=True)}
SHAPES = ((1024, 1024), (2048, 1536), (8192, 8192))
MAX_GROUPS = 8


def _numpy_input(shape, seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)


def _groups(diff_rows, x_abs_rows_max):
  """16-row groups to save: those with differences (first MAX_GROUPS) and the one holding the amax."""
  groups = sorted({int(r) // 16 for r in diff_rows})[:MAX_GROUPS]
  g_amax = int(np.argmax(x_abs_rows_max)) // 16
  return sorted(set(groups) | {g_amax})


def save(out: str, dry: bool = False) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import quantize_nvfp4  # pylint: disable=g-import-not-at-top
  from benchmarks.gpu import report  # pylint: disable=g-import-not-at-top
  os.makedirs(out, exist_ok=True)
  u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
  saved = {}
  for shape in ((64, 64),) if dry else SHAPES:
    for dname, dtype in (("bf16", jnp.bfloat16),) + (() if dry else (("f32", jnp.float32),)):
      for source in ("device", "numpy"):
        if source == "device":
          x = report.random_input(jax.random.key(7), shape, dtype)
        else:
          x = jax.device_put(jnp.asarray(_numpy_input(shape, 7), dtype))
        for cname, kw in CONFIGS.items():
          t0 = time.time()
          kern = jax.jit(lambda x, kw=kw: quantize_nvfp4(x, interpret=dry, **kw))
          xla = jax.jit(lambda x, kw=kw: fp4jax.quantize(x, "nvfp4", **kw))
          both = jax.jit(lambda x, kw=kw: (quantize_nvfp4(x, interpret=dry, **kw), fp4jax.quantize(x, "nvfp4", **kw)))
          qk, qx = kern(x), xla(x)
          bk, bx = both(x)
          ck, cx = np.asarray(qk.codes), np.asarray(qx.codes)
          n_sep = int(np.sum(ck != cx))
          n_one = int(np.sum(np.asarray(bk.codes) != np.asarray(bx.codes)))
          n_k = int(np.sum(np.asarray(bk.codes) != ck))
          n_x = int(np.sum(np.asarray(bx.codes) != cx))
          ds = int(np.sum(np.asarray(u8(qk.scales)) != np.asarray(u8(qx.scales))))
          name = f"{cname}.{dname}.{source}.{shape[0]}x{shape[1]}"
          print(f"{name:34s} codes differing: separate jits {n_sep}, one jit {n_one}; kernel vs kernel-in-one-jit "
                f"{n_k}, xla vs xla-in-one-jit {n_x}; scales differing {ds}; amax {float(qk.amax):.9g} / "
                f"{float(qx.amax):.9g} ({time.time() - t0:.1f} s)", flush=True)
          if n_sep or dry:  # dry (CPU, interpret mode): save anyway, to exercise --compare
            rows = np.unique(np.argwhere(ck != cx)[:, 0])
            xa = np.asarray(jnp.abs(x.astype(jnp.float32)))
            gs = _groups(rows, xa.max(axis=1))
            sel = np.concatenate([np.arange(g * 16, g * 16 + 16) for g in gs])
            xs = np.asarray(x)[sel]
            saved[f"{name}.x"] = xs.view(np.uint16 if dname == "bf16" else np.uint32)
            saved[f"{name}.rows"] = sel
            for p, q in (("kernel", qk), ("xla", qx)):
              saved[f"{name}.{p}.codes"] = np.asarray(q.codes)[sel]
              saved[f"{name}.{p}.amax"] = np.asarray(q.amax, np.float32)
            np.savez_compressed(os.path.join(out, "mismatch.npz"), **saved)


def compare(out: str) -> list[tuple[str, str, int]]:
  """Prints and returns (configuration, path, code bytes differing from fp4jax on this machine) per saved one."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  got = np.load(os.path.join(out, "mismatch.npz"))
  rows = []
  names = sorted({k.rsplit(".", 1)[0] for k in got.files if k.endswith(".x")})
  for name in names:
    cname, dname = name.split(".")[:2]
    bits = got[f"{name}.x"]
    x = bits.view(ml_dtypes.bfloat16) if dname == "bf16" else bits.view(np.float32)
    ref = fp4jax.quantize(jnp.asarray(x), "nvfp4", **CONFIGS[cname])
    rc = np.asarray(ref.codes)
    print(f"== {name}: {x.shape[0] // 16} groups; amax cpu {float(ref.amax):.9g}")
    for p in ("kernel", "xla"):
      c = got[f"{name}.{p}.codes"]
      d = np.argwhere(c != rc)
      rows.append((name, p, len(d)))
      print(f"  {p:6s} code bytes differing from the CPU: {len(d)}/{c.size}; amax {float(got[f'{name}.{p}.amax']):.9g}")
      for i in d[:6]:
        r, col = int(i[0]), int(i[1])
        xv = np.asarray(x[r, 2 * col:2 * col + 2], np.float32)
        print(f"    row {int(got[f'{name}.rows'][r])} byte {col}: x {xv} gpu {c[r, col]:#04x} cpu {rc[r, col]:#04x}")
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/out")
  parser.add_argument("--compare", metavar="DIR")
  parser.add_argument("--dry", action="store_true", help="CPU, Pallas interpret mode, a 64 x 64 input")
  args = parser.parse_args(argv)
  if args.compare:
    compare(args.compare)
  else:
    save(args.out, args.dry)
  return 0


if __name__ == "__main__":
  sys.exit(main())
