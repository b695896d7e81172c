"""Shared plumbing of the GPU benchmark sections: rows appended to one JSONL file, timing, inputs, error metrics.

Every section runs in its own process (benchmarks/gpu.sh), so a row is appended and flushed the moment it is
measured: a section killed by its timeout or by a Triton `LLVM ERROR` abort keeps what it wrote. `summary()`
turns the rows into gpu_bench.json and gpu_bench.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

ROWS_FILE = "rows.jsonl"
COLUMNS = ("section", "name", "value", "unit", "baseline", "base_name", "ratio", "err", "ok", "note")


@dataclasses.dataclass
class Section:
  """One section's context: where rows go, its deadline, and whether this is a dry (CPU, interpret) run."""
  name: str
  out: str
  deadline: float
  dry: bool
  run: int = 0  # the `repeat` section: which of its separate processes this is (labels its rows "run K: ...")

  def time_left(self) -> float:
    return self.deadline - time.time()

  def has_time(self, need_s: float) -> bool:
    """Whether `need_s` seconds remain; dry runs always proceed (their rows are tiny)."""
    return self.dry or self.time_left() >= need_s

  def add(self, name, value=None, unit="", baseline=None, base_name="", err=None, ok=None, note="", **extra):
    """Appends one row (COLUMNS, then `extra` keys, which the JSON keeps and the markdown table leaves out)."""
    ratio = value / baseline if isinstance(value, (int, float)) and isinstance(baseline, (int, float)) and baseline \
        else None
    row = dict(section=self.name, name=name, value=value, unit=unit, baseline=baseline, base_name=base_name,
               ratio=ratio, err=err, ok=ok, note=note, **extra)
    append_row(self.out, row)
    print(format_row(row), flush=True)
    return row

  def skip(self, name, why):
    return self.add(name, note=f"skipped: {why}")

  def fail(self, name, exc):
    import traceback  # pylint: disable=g-import-not-at-top
    with open(os.path.join(self.out, "errors.txt"), "a", encoding="utf-8") as f:
      f.write(f"== {self.name} / {name}\n{traceback.format_exc()}\n")
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return self.add(name, ok=False, note=f"ERROR {type(exc).__name__}: {first}")


def append_row(out: str, row: dict) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, ROWS_FILE), "a", encoding="utf-8") as f:
    f.write(json.dumps(row, default=str) + "\n")
    f.flush()


def read_rows(out: str) -> list[dict]:
  path = os.path.join(out, ROWS_FILE)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:  # a line cut by a kill: keep the rest
        continue
  return rows


def _fmt(v) -> str:
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def format_row(r: dict) -> str:
  ok = {True: "PASS", False: "FAIL"}.get(r.get("ok"), "")
  ratio = f"{r['ratio']:.3g}x" if r.get("ratio") is not None else ""
  return (f"| {r['section']} | {r['name']} | {_fmt(r.get('value'))} {r.get('unit', '')} | "
          f"{_fmt(r.get('baseline'))} {r.get('base_name', '')} | {ratio} | {_fmt(r.get('err'))} | {ok} | "
          f"{r.get('note', '')} |")


def summary(out: str) -> str:
  """Writes gpu_bench.json and gpu_bench.md from the rows so far; returns the markdown table."""
  rows = read_rows(out)
  head = "| section | name | value | baseline | ratio | max err | ok | note |\n|---|---|---|---|---|---|---|---|"
  table = "\n".join([head] + [format_row(r) for r in rows])
  with open(os.path.join(out, "gpu_bench.json"), "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=1, default=str)
  with open(os.path.join(out, "gpu_bench.md"), "w", encoding="utf-8") as f:
    f.write(table + "\n")
  return table


# --- measuring (imports jax lazily: the summary/skip paths of the driver stay fast) -------------------------------

def median_time(fn, arg_sets, *, target_s: float = 0.05, reps: int = 5, max_iters: int = 100) -> float:
  """Median seconds per call of jitted `fn` over `reps` runs of back-to-back calls, cycling through `arg_sets`
  (several input sets, so repeated calls do not measure data left in L2). Compiled and warmed up first."""
  import jax  # pylint: disable=g-import-not-at-top
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[0]))
  one = max(time.perf_counter() - t, 1e-6)
  iters = int(min(max(target_s / one, 1), max_iters))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def random_input(key, shape, dtype, scale=1.0):
  """Normal values with log-normal magnitudes (a wide range of block scales), drawn on the device; never zeros."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(jax.random.normal(k2, shape, jnp.float32)) * scale
  return x.astype(dtype)


def rel_errors(out, ref) -> tuple[float, float, bool]:
  """(||out - ref|| / ||ref||, max |out - ref| / max |ref|, all finite) in float32, computed on the device."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  o, r = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
  d = o - r
  fro = float(jnp.linalg.norm(d) / jnp.maximum(jnp.linalg.norm(r), 1e-30))
  mx = float(jnp.max(jnp.abs(d)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))
  return fro, mx, bool(jnp.all(jnp.isfinite(o)))
