"""Helpers shared by the experiments: the sweep's file names, JSON-ready values, Markdown tables, probe results.

Imports nothing from the experiments, so the sweep, the sweep report and the probes all import it without a cycle.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Files of a sweep folder: OUT/sweep.json (runs, labels, reference), OUT/<run>/seed<k>/summary.json (one result).
SWEEP_FILE = "sweep.json"
SUMMARY_FILE = "summary.json"
# What decides a run's numbers beyond its config, recorded in summary.json and results.jsonl (experiments.sweep
# .provenance). A kept run's recipe_spec and gemm_mode must be what the current code and machine train its settings
# with; runs recorded before these fields existed lack them and cannot be checked.
PROVENANCE_FIELDS = ("recipe_spec", "gemm_mode", "jax_version", "platform")
CHECKED_PROVENANCE = ("recipe_spec", "gemm_mode")


def jsonable(value: Any) -> Any:
  """Plain JSON values: str keys, lists for tuples and arrays, Python numbers, str() for any other object.

  Non-finite floats become the strings "nan" / "inf" / "-inf" (strict JSON has none).
  """
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):  # numpy and jax arrays and scalars
    value = np.asarray(value)
    return jsonable(value.item() if value.ndim == 0 else value.tolist())
  if isinstance(value, float):
    return value if math.isfinite(value) else str(value)
  if value is None or isinstance(value, (bool, int, str)):
    return value
  return str(value)


def has_provenance(recorded: Mapping[str, Any]) -> bool:
  """Whether a summary or result row records the checked provenance fields (rows stored before them do not)."""
  return all(recorded.get(k) is not None for k in CHECKED_PROVENANCE)


def fmt(mean: float | None, spread: float | None = None, digits: int = 4, signed: bool = False) -> str:
  """"mean ± spread" with `digits` decimals; "-" for a missing or NaN mean, no spread when it is None or NaN."""
  if mean is None or (isinstance(mean, float) and math.isnan(mean)):
    return "-"
  text = f"{mean:{'+' if signed else ''}.{digits}f}"
  if spread is not None and not math.isnan(spread):
    text += f" ± {spread:.{digits}f}"
  return text


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A Markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


PROBE_RESULTS = "results.json"
# The command that redraws each kind of probe results; a recipe-probes results.json has "runs", the layer probes' not.
PROBE_REPORT_COMMANDS = {"layers": "python -m experiments.probes --report-only --out {out}",
                         "recipes": "python -m experiments.probes recipes --report-only --out {out}"}


def probe_kind(results: Mapping[str, Any]) -> str:
  """"recipes" for experiments.probes recipes' results.json, "layers" for experiments.probes'."""
  return "recipes" if "runs" in results else "layers"


def read_probe_results(out: str | pathlib.Path, kind: str) -> dict[str, Any]:
  """OUT/results.json of a probes run of `kind` ("layers" or "recipes"); a ValueError naming the command for the
  other kind's results (whose report would fail on a missing key), FileNotFoundError where there are none."""
  path = pathlib.Path(out) / PROBE_RESULTS
  if not path.is_file():
    raise FileNotFoundError(f"No {PROBE_RESULTS} in {out}: run the probes first.")
  results = json.loads(path.read_text())
  found = probe_kind(results)
  if found != kind:
    raise ValueError(f"{path} holds the {found} probes' results, not the {kind} probes': redraw it with "
                     f"`{PROBE_REPORT_COMMANDS[found].format(out=out)}`.")
  return results
