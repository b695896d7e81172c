"""Numerics demo: what each format loses on a tensor with outlier channels, with and without the RHT.

  python -m fp4jax.analysis.inspection [--size 4096] [--cols 1024] [--outliers 8] [--outlier-scale 50] [--seed 0]

The sample is a standard normal [size, cols] activation-like tensor whose `outliers` columns (channels) are scaled
by `outlier-scale`. Blocks run along the last axis (the GEMM's contraction axis), so every 16- or 32-element block
that holds an outlier channel has its scale set by the outlier. Each format is applied directly and after a
16-point random Hadamard transform along the blocked axis (the error is measured after transforming back).
Columns: relative Frobenius error, SNR in dB, fraction of zero codes (elements quantized to +-0), fraction of
saturated elements (clipped: larger in magnitude than the largest value their block can represent, by more than
float32 rounding; for NVFP4 these are mostly block maxima whose E4M3 scale rounded down, for MXFP4 "floor" maxima in
(6, 8) x 2^e; FP8 and MXFP4 "ceil" clip nothing), bits/element.

On such a tensor the RHT halves the zero codes and lowers MXFP4's error, but raises NVFP4's and FP8's: a 16-point
transform of a tile holding one large outlier puts every element of the tile near the outlier's magnitude / 4,
where the coarse top of the E2M1 grid (4, 6) or FP8's relative rounding applies to all of them.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import formats
from fp4jax import norms
from fp4jax import rht
from fp4jax.qarray import QArray
from fp4jax.quantize import dequantize, quantize

# (label, format) rows of the demo: the paper's format, the OCP MXFP4 scale rule and the paper's, two FP8 baselines.
DEFAULT_FORMATS = (
    ("nvfp4", formats.NVFP4()),
    ("mxfp4 (floor)", formats.MXFP4(scale_rule="floor")),
    ("mxfp4 (ceil)", formats.MXFP4(scale_rule="ceil")),
    ("fp8 (block)", formats.FP8(scaling="block")),
    ("fp8 (tensor)", formats.FP8(scaling="tensor")),
)


def sample_tensor(seed: int = 0, rows: int = 4096, cols: int = 1024, outliers: int = 8, outlier_scale: float = 50.0):
  """Standard normal float32 [rows, cols] with `outliers` distinct random columns multiplied by `outlier_scale`.

  Drawn with NumPy (fast, and fixed by `seed` whatever JAX's PRNG settings are).
  """
  if rows < 1 or cols < 1:
    raise ValueError(f"sample_tensor needs rows, cols >= 1; got {rows}x{cols}.")
  if not 0 <= outliers <= cols:
    raise ValueError(f"outliers must be in [0, cols={cols}]; got {outliers}.")
  if not np.isfinite(outlier_scale):
    raise ValueError(f"outlier_scale must be finite; got {outlier_scale}.")
  rng = np.random.default_rng(seed)
  x_RxC = rng.standard_normal((rows, cols), dtype=np.float32)
  x_RxC[:, rng.choice(cols, outliers, replace=False)] *= np.float32(outlier_scale)
  return jnp.asarray(x_RxC)


# Relative excess over the block's largest value below which an element counts as represented, not clipped.
_CLIP_TOLERANCE = 2.0**-16


def _code_stats(q: QArray, x_q, dq):
  """(fraction of zero codes, fraction of clipped elements) of the quantized tensor `x_q` (before any inverse RHT)."""
  if q.fmt.is_fp4:
    magnitude = q.unpacked_codes() & 7
    is_zero, at_max = magnitude == 0, magnitude == 7
  else:
    value = jnp.abs(q.codes.astype(jnp.float32))
    is_zero, at_max = value == 0, value == q.fmt.elem_max
  # At the largest code, an element whose magnitude exceeds its dequantized value lay beyond the block's range; by
  # more than float32 rounding of the scale (amax / 448 * 448 can fall an ulp short of amax: not a clip).
  clipped = at_max & (jnp.abs(x_q.astype(jnp.float32)) > jnp.abs(dq) * (1 + _CLIP_TOLERANCE))
  return jnp.mean(is_zero.astype(jnp.float32)), jnp.mean(clipped.astype(jnp.float32))


def _measure(x, fmt, use_rht: bool, rht_size: int, axis: int, signs):
  """(squared error, squared norm, zero fraction, clipped fraction) of one format on x; the squares of x and of
  x_hat - x both scaled by one power of two."""
  x_q = rht.random_hadamard(x, size=rht_size, axis=axis, signs=signs) if use_rht else x
  q = quantize(x_q, fmt, axis=axis)
  dq = dequantize(q)
  x_hat = rht.random_hadamard(dq, size=rht_size, axis=axis, signs=signs, inverse=True) if use_rht else dq
  # Both scaled by one power of two (exact: the ratio keeps its bits): squares of |x| ~ 1e19 overflowed float32.
  x32, x_hat = norms.unit_scaled(x, x_hat)
  zero, clipped = _code_stats(q, x_q, dq)
  return jnp.stack([jnp.sum(jnp.square(x_hat - x32)), jnp.sum(jnp.square(x32)), zero, clipped])


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _measure_all(x, fmts, rht_size, axis, use_rht, signs):
  # One compilation for the whole table: compiling per format dominated the demo's run time.
  return jnp.stack([_measure(x, fmt, r, rht_size, axis, signs) for fmt in fmts for r in use_rht])


def compare_formats(x, fmts=DEFAULT_FORMATS, *, rht_size: int = 16, axis: int = -1, signs=None) -> list[dict]:
  """Quantization error of each format on `x`, without and with a `rht_size`-point RHT along `axis`.

  Args:
    x: float32/bfloat16 array; the blocked axis `axis` must be divisible by every format's block size and rht_size.
    fmts: (label, format) pairs; formats may also be names from fp4jax.FORMAT_NAMES (the label is then the name).
    rht_size: Hadamard tile size; signs: the RHT sign vector (None: the reference's fixed vector).

  Returns:
    One dict per (format, rht) pair, in order: format (label), rht (bool), rel_error (||x_hat - x|| / ||x||),
    snr_db, zero_frac (codes equal to +-0), saturated_frac (elements clipped at the format's largest value),
    bits_per_element (codes + scales + amax).
  """
  x = jnp.asarray(x)
  if x.ndim < 1 or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}.")
  axis = axis % x.ndim
  labels, fmt_list = [], []
  for entry in fmts:
    label, fmt = entry if isinstance(entry, tuple) else (entry, entry)
    labels.append(str(label))
    fmt_list.append(formats.get_format(fmt))
  if not fmt_list:
    raise ValueError("compare_formats needs at least one format in fmts.")
  # Checked here: the quantizer's own error would suggest a pad=True that compare_formats does not take.
  n = x.shape[axis]
  for label, fmt in zip(labels, fmt_list):
    if not fmt.per_tensor and n % fmt.block_size:
      raise ValueError(f"compare_formats: axis {axis} has length {n}, not a multiple of the {label} block size "
                       f"{fmt.block_size} (x {tuple(x.shape)}); pad it first: fp4jax.pad_to_blocks(x, fmt, axis={axis}) "
                       "for each format's block size.")
  if signs is not None:  # checked here, outside _measure_all's trace, where the +-1 values can be read
    signs = rht.resolve_signs(rht_size, signs)
  use_rht = (False, True)
  stats = np.asarray(_measure_all(x, tuple(fmt_list), rht_size, axis, use_rht, signs), np.float64)
  rows = []
  for i, (label, fmt) in enumerate((l, f) for l, f in zip(labels, fmt_list) for _ in use_rht):
    err, norm, zero, clipped = stats[i]
    nbytes = jax.eval_shape(lambda x, fmt=fmt: quantize(x, fmt, axis=axis), x).nbytes
    # As fp4jax.analysis.probes.rel_error: 0 when both are zero, inf when only x is; NaN stays NaN in both columns.
    rel = math.sqrt(err / norm) if norm > 0 else (0.0 if err == 0 else err * math.inf)
    snr = -20.0 * math.log10(rel) if 0 < rel < math.inf else (math.inf if rel == 0 else -rel)
    rows.append(dict(format=label, rht=use_rht[i % len(use_rht)], rel_error=rel, snr_db=snr,
                     zero_frac=float(zero), saturated_frac=float(clipped), bits_per_element=8.0 * nbytes / x.size))
  return rows


def format_rows(rows: list[dict]) -> str:
  """The rows of compare_formats as an aligned text table."""
  headers = ["format", "RHT", "rel. error", "SNR dB", "zero codes", "saturated", "bits/elem"]
  cells = [headers] + [[r["format"], "yes" if r["rht"] else "no", f"{r['rel_error']:.4f}", f"{r['snr_db']:.2f}",
                        f"{100 * r['zero_frac']:.2f}%", f"{100 * r['saturated_frac']:.3f}%",
                        f"{r['bits_per_element']:.2f}"] for r in rows]
  widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
  lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  """`python -m fp4jax.analysis.inspection`: prints the format comparison table of a sample tensor; returns its rows."""
  parser = argparse.ArgumentParser(prog="python -m fp4jax.analysis.inspection", description=__doc__.split("\n")[0])
  parser.add_argument("--size", type=int, default=4096, help="rows (tokens) of the sample tensor (default 4096)")
  parser.add_argument("--cols", type=int, default=1024, help="columns, the blocked axis; a multiple of 128")
  parser.add_argument("--outliers", type=int, default=8, help="number of outlier channels (columns)")
  parser.add_argument("--outlier-scale", type=float, default=50.0, help="factor applied to the outlier channels")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.size < 1:
    parser.error(f"--size must be >= 1; got {args.size}.")
  if args.cols < 128 or args.cols % 128:
    parser.error(f"--cols must be a positive multiple of 128 (the FP8 block); got {args.cols}.")
  if not 0 <= args.outliers <= args.cols:
    parser.error(f"--outliers must be in [0, {args.cols}]; got {args.outliers}.")
  if args.seed < 0:
    parser.error(f"--seed must be >= 0 (NumPy's seed); got {args.seed}.")
  if not np.isfinite(args.outlier_scale):
    parser.error(f"--outlier-scale must be a finite number; got {args.outlier_scale}.")

  start = time.perf_counter()
  x = sample_tensor(args.seed, args.size, args.cols, args.outliers, args.outlier_scale)
  rows = compare_formats(x)
  print(f"sample: normal {args.size}x{args.cols} float32, {args.outliers} outlier channels x{args.outlier_scale:g} "
        f"(seed {args.seed}); blocks and RHT (size 16) along the last axis")
  print(format_rows(rows))
  print(f"({time.perf_counter() - start:.1f} s)")
  return rows


if __name__ == "__main__":
  main()
