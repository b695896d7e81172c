"""Training metrics: per-layer quantization statistics and the append-only metrics.jsonl log.

Quantization statistics, per quantizable linear layer, for the weight (2D blocks, as Fprop sees it) and for the
layer's input activations (1D blocks along the features), quantized with an FP4 format:
  zero: fraction of elements whose E2M1 code is +-0;  sat: fraction at +-6 (the top of the grid);
  err: relative Frobenius error ||dequantize(quantize(t)) - t|| / ||t||.
Inputs are captured with a separate forward pass through layer taps (fp4jax.analysis.taps); statistics are
taken whatever the layer's own recipe is (BF16 layers included), so layers can be compared.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp4jax import formats
from fp4jax import norms
from fp4jax.analysis import taps
from fp4jax.quantize import dequantize, quantize

METRICS_FILE = "metrics.jsonl"


# --- quantization statistics -------------------------------------------------------------------------------------

def tensor_stats(x: jax.Array, fmt, *, axis: int = -1, block_2d: bool = False) -> dict[str, jax.Array]:
  """{"zero", "sat", "err"} of `x` quantized to the FP4 format `fmt` (round-to-nearest, padded to whole blocks)."""
  fmt = formats.get_format(fmt)
  if not fmt.is_fp4:
    raise ValueError(f"Quantization statistics count FP4 codes; got format {fmt.name}.")
  q = quantize(x, fmt, axis=axis, block_2d=block_2d, pad=True)
  # Padding elements would count as zero codes: look at the original extent only.
  magnitude = q.unpacked_codes()[tuple(slice(0, n) for n in q.orig_shape)] & 7
  err = norms.relative_error(dequantize(q, jnp.float32), x)  # scaled first: |x| of ~1e19 overflowed the squares
  return {"zero": jnp.mean(magnitude == 0), "sat": jnp.mean(magnitude == 7), "err": err}


def quant_stats(graphdef, params, tokens_BxT: jax.Array, key: jax.Array | None, fmt="nvfp4"
                ) -> dict[str, dict[str, jax.Array]]:
  """Per-layer statistics {layer: {w_zero, w_sat, w_err, x_zero, x_sat, x_err}}; pure, jit with graphdef static."""
  fmt = formats.get_format(fmt)
  model = nnx.merge(graphdef, params)
  kernels = {name: layer.kernel[...] for name, layer in model.linear_layers().items()}
  inputs = taps.capture_inputs(model, tokens_BxT, key)  # taps the merged copy, not the caller's model
  out = {}
  for name, kernel_KxN in kernels.items():
    # Weight blocks as Fprop sees them (2D tiles); activations in 1D blocks along the contraction (feature) axis.
    w = tensor_stats(kernel_KxN, fmt, axis=0, block_2d=True)
    x = tensor_stats(inputs[name].reshape(-1, kernel_KxN.shape[0]), fmt, axis=-1)
    out[name] = {**{f"w_{k}": v for k, v in w.items()}, **{f"x_{k}": v for k, v in x.items()}}
  return out


def summarize_stats(stats: dict[str, dict[str, Any]]) -> dict[str, float]:
  """Means over layers of each statistic (for progress bars and quick plots)."""
  if not stats:
    return {}
  keys = next(iter(stats.values())).keys()
  return {k: float(np.mean([float(s[k]) for s in stats.values()])) for k in keys}


# --- metrics.jsonl -----------------------------------------------------------------------------------------------

def _jsonable(value):
  """Plain JSON values; non-finite floats become the strings "nan" / "inf" / "-inf" (strict JSON has none)."""
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    value = np.asarray(value).item() if np.ndim(value) == 0 else np.asarray(value).tolist()
    return _jsonable(value)
  if isinstance(value, float) and not math.isfinite(value):
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
  return value


class MetricsLog:
  """Appends one JSON object per line to <out>/metrics.jsonl, flushed after each record."""

  def __init__(self, out_dir: str | pathlib.Path):
    self.path = pathlib.Path(out_dir) / METRICS_FILE
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with

  def write(self, record: dict[str, Any]) -> None:
    """Appends `record` as one JSON line and flushes it (a killed run keeps what it logged)."""
    self._file.write(json.dumps(_jsonable(record)) + "\n")
    self._file.flush()

  def close(self) -> None:
    """Closes the file."""
    self._file.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _parse_lines(text, path):
  """([(line as written, record)], torn) of a metrics.jsonl text: one JSON object per line.

  A last line that has no newline and does not parse is a record whose write a dying process cut short (killed,
  out of memory, disk full): it comes back as `torn`, not as an error, so the run can still be read and resumed.
  Any other line that does not parse is a ValueError naming the file and line.
  """
  lines = text.split("\n")
  last = len(lines) - 1  # the text after the final newline ("" for a complete file)
  parsed, torn = [], None
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      parsed.append((line, json.loads(line)))
    except json.JSONDecodeError as e:
      if i == last:
        torn = line
        continue
      raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e.msg}): {line[:80]!r}") from None
  return parsed, torn


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """All records of a metrics.jsonl file (or of <path>/metrics.jsonl for a run folder); an unfinished last line
  (a write cut short, see _parse_lines) is left out."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / METRICS_FILE
  if not path.is_file():
    raise FileNotFoundError(f"No metrics file at {path}.")
  return [record for _, record in _parse_lines(path.read_text(encoding="utf-8"), path)[0]]


def truncate_metrics(out_dir: str | pathlib.Path, after_step: int, *,
                     keep_dropped: str | pathlib.Path | None = None, log=None) -> int:
  """Drops step records beyond `after_step` (logged after the checkpoint a run resumes from); returns how many.

  keep_dropped: a file to write the dropped records to first (the records of a branch the run abandons).
  An unfinished last line (a write cut short, see _parse_lines) is removed too, said through `log` if given.
  """
  path = pathlib.Path(out_dir) / METRICS_FILE
  if not path.is_file():
    return 0
  text = path.read_text(encoding="utf-8")
  parsed, torn = _parse_lines(text, path)
  lines = [line for line, _ in parsed]
  later = [record.get("step", -1) > after_step for _, record in parsed]
  keep = [line for line, drop in zip(lines, later) if not drop]
  # A torn last line goes too, and a whole last record without its newline gets one: the run appends after it.
  if len(keep) != len(lines) or torn is not None or not text.endswith("\n") and text:
    if keep_dropped is not None and len(keep) != len(lines):
      keep_dropped = pathlib.Path(keep_dropped)
      keep_dropped.parent.mkdir(parents=True, exist_ok=True)
      keep_dropped.write_text("".join(line + "\n" for line, drop in zip(lines, later) if drop), encoding="utf-8")
    if torn is not None and log is not None:
      log(f"Note: the last line of {path} was cut short (a process died writing it); removed: {torn[:80]!r}")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    tmp.replace(path)
  return len(lines) - len(keep)
