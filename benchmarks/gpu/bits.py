"""Saves the NVFP4 codes and scales that the GPU computes, for a bit-for-bit comparison on the CPU.

  python -m benchmarks.gpu.bits --out DIR [--xla-only] [--tag NAME]    # on the GPU (or any backend)
  python -m benchmarks.gpu.bits --compare DIR                          # on the CPU: against fp4jax on the CPU

The inputs are drawn by NumPy from fixed seeds (normal values with log-normal magnitudes, rounded to bfloat16), so
the CPU regenerates them exactly. For each configuration the GPU run saves `fp4jax.quantize` (the XLA path, jitted
with the RHT when there is one, as a training step fuses them) and, unless --xla-only, the Pallas kernel's QArray
(codes, scale bits, amax) to DIR/bits_TAG.npz, one configuration at a time (a run cut short keeps what it saved).
`--compare` recomputes every configuration with fp4jax on the CPU (bit-exact against the NumPy float64 reference
in tests/) and prints, per configuration and path, the code bytes and scales that differ, with the first few
differing elements (input, scale, code on each side).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.gpu import report  # noqa: E402  pylint: disable=wrong-import-position

SHAPE = (1024, 1024)  # ~6 MB of codes per run: what comes back from a lent GPU is limited
# name: (quantize kwargs, RHT size or None, input dtype)
CONFIGS = {
    "row_rne_bf16": (dict(), None, "bfloat16"),
    "row_rne_bf16_ties": (dict(), None, "bfloat16"),
    "2d_rne_bf16_ties": (dict(block_2d=True), None, "bfloat16"),
    "2d_rne_bf16": (dict(block_2d=True), None, "bfloat16"),
    "col_rht_sr_bf16": (dict(axis=0, rounding="stochastic"), 16, "bfloat16"),
    "row_sr_bf16": (dict(rounding="stochastic"), None, "bfloat16"),
    "row_rne_f32": (dict(), None, "float32"),
    "col_rht_sr_f32": (dict(axis=0, rounding="stochastic"), 16, "float32"),
}


def make_input(name: str) -> np.ndarray:
  """The configuration's input, identical on every machine (NumPy's generator, then a cast). `_ties`: x = k/8
  (|k| <= 48), 6 in every 16th column and amax 10.5 = 2688 / 2^8: the global decode scale is 2^-8, nearly every
  block scale 256, so y = x exactly and 13 % of the elements sit on E2M1 rounding midpoints (0.25, 0.75, ...,
  5): a test of each side's tie rule."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  seed = sorted(CONFIGS).index(name)
  rng = np.random.default_rng(1000 + seed)
  if name.endswith("_ties"):
    x = (rng.integers(-48, 49, SHAPE) / 8.0).astype(np.float32)
    x[:, ::16] = 6.0
    x[0, 0] = 10.5
    return x.astype(ml_dtypes.bfloat16)
  x = (rng.standard_normal(SHAPE) * np.exp(rng.standard_normal(SHAPE))).astype(np.float32)
  dtype = CONFIGS[name][2]
  return x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x


def _xla_fn(name):
  import jax  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  kw, rht, _ = CONFIGS[name]

  @jax.jit
  def f(x, key):
    xr = x if rht is None else fp4jax.random_hadamard(x, size=rht, axis=kw.get("axis", -1))
    sr = kw.get("rounding") == "stochastic"
    return fp4jax.quantize(xr, "nvfp4", key=key if sr else None, **kw)
  return f


def _kernel_fn(name):
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import quantize_nvfp4  # pylint: disable=g-import-not-at-top
  kw, rht, _ = CONFIGS[name]
  sr = kw.get("rounding") == "stochastic"
  return jax.jit(lambda x, key: quantize_nvfp4(x, key=key if sr else None, rht_size=rht, **kw))


def _arrays(q) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return dict(codes=np.asarray(q.codes), scales=np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)),
              amax=np.asarray(q.amax, np.float32))


def save(out: str, tag: str, xla_only: bool) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  os.makedirs(out, exist_ok=True)
  key = jax.random.key(5)
  saved = {}
  path = os.path.join(out, f"bits_{tag}.npz")
  for name in CONFIGS:
    t0 = time.time()
    x = jax.device_put(make_input(name))
    paths = {"xla": _xla_fn(name)} if xla_only else {"xla": _xla_fn(name), "kernel": _kernel_fn(name)}
    for p, fn in paths.items():
      for k, v in _arrays(fn(x, key)).items():
        saved[f"{name}.{p}.{k}"] = v
    if name == "row_rne_bf16":  # the same computation compiled again: does the GPU compiler pick the same code?
      jax.clear_caches()
      for k, v in _arrays(_xla_fn(name)(x, key)).items():
        saved[f"{name}.xla_recompiled.{k}"] = v
    if name in ("row_rne_bf16", "col_rht_sr_bf16"):  # the compiled XLA path: fusions, converts kept or removed
      with open(os.path.join(out, f"hlo_{tag}.txt"), "a", encoding="utf-8") as f:
        f.write(f"#### {name}\n" + _xla_fn(name).lower(x, key).compile().as_text())
    np.savez_compressed(path, **saved)
    if not xla_only:  # a first look on the device: the kernel against the XLA path (the CPU comparison decides)
      dc = int(np.sum(saved[f"{name}.kernel.codes"] != saved[f"{name}.xla.codes"]))
      ds = int(np.sum(saved[f"{name}.kernel.scales"] != saved[f"{name}.xla.scales"]))
      report.append_row(out, dict(section="bits", name=f"bits {name} kernel vs xla", value=dc, unit="code bytes",
                                  baseline=None, base_name="", ratio=None, err=dc / saved[f"{name}.xla.codes"].size,
                                  ok=None, note=f"scales differing {ds}; saved to {os.path.basename(path)} for "
                                                f"`python -m benchmarks.gpu.bits --compare`"))
    print(f"{name}: {time.time() - t0:.1f} s", flush=True)


def compare(out: str) -> list[tuple[str, str, str, int, int]]:
  """Prints and returns (file, configuration, path, code bytes differing, scales differing) for every saved result,
  against fp4jax on this machine."""
  import jax  # pylint: disable=g-import-not-at-top
  key = jax.random.key(5)
  rows = []
  for path in sorted(glob.glob(os.path.join(out, "bits_*.npz"))):
    got = np.load(path)
    print(f"== {os.path.basename(path)}")
    for name in CONFIGS:
      ps = sorted({k.split(".")[1] for k in got.files if k.startswith(name + ".")})
      if not ps:
        continue
      x = make_input(name)
      ref = _arrays(_xla_fn(name)(x, key))
      for p in ps:
        codes, scales, amax = (got[f"{name}.{p}.{k}"] for k in ("codes", "scales", "amax"))
        dc = np.argwhere(codes != ref["codes"])
        ds = int(np.sum(scales != ref["scales"]))
        rows.append((os.path.basename(path), name, p, len(dc), ds))
        print(f"{name:16s} {p:15s} code bytes differing {len(dc)}/{codes.size}, scales differing {ds}, "
              f"amax {float(amax):.9g} vs {float(ref['amax']):.9g}")
        for i in dc[:4]:
          i = tuple(int(v) for v in i)
          print(f"    byte {i}: gpu {codes[i]:#04x} cpu {ref['codes'][i]:#04x}")
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/out")
  parser.add_argument("--tag", default="default")
  parser.add_argument("--xla-only", action="store_true")
  parser.add_argument("--compare", metavar="DIR")
  args = parser.parse_args(argv)
  if args.compare:
    compare(args.compare)
  else:
    save(args.out, args.tag, args.xla_only)
  return 0


if __name__ == "__main__":
  sys.exit(main())
