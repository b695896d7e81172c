"""Summaries of a probes results.json: paired component effects, continuation deltas, layer sensitivity."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fp4jax.analysis import probes

from experiments.probes.presets import MAIN, REFERENCE


def mean_se(values) -> tuple[float, float]:
  """Mean and standard error of the mean of `values`."""
  v = np.asarray(values, np.float64)
  return float(np.mean(v)), probes.standard_error(v)


def layer_value(res: Mapping[str, Any], metric: str) -> float:
  """A per-layer scalar: per-draw arrays are averaged over draws."""
  return float(np.mean(res[metric]))


def top_bias(res: Mapping[str, Any], gemm: str, ref: str) -> tuple[int, float, float]:
  """(K, mean, SE) of the longest-K point of a bias curve."""
  curve = res["bias"][gemm][ref]
  return curve["K"][-1], curve["mean"][-1], curve["se"][-1]


def paired_effect(layers: Mapping[str, Mapping], a: str, b: str, value) -> dict[str, Any]:
  """value(layer result of b) - value(layer result of a) over the layers probed with both: mean, SE, sign counts."""
  diffs = [value(res[b]) - value(res[a]) for res in layers.values() if a in res and b in res]
  if not diffs:
    return {"n": 0}
  mean, se = mean_se(diffs)
  return {"n": len(diffs), "mean": mean, "se": se, "positive": int(np.sum(np.asarray(diffs) > 0)),
          "a": float(np.mean([value(res[a]) for res in layers.values() if a in res and b in res])),
          "b": float(np.mean([value(res[b]) for res in layers.values() if a in res and b in res]))}


def component_effects(results: Mapping[str, Any]) -> list[dict[str, Any]]:
  """The requested comparisons as rows: what, metric, baseline value, variant value, effect (variant - baseline)."""
  layers = results["layers"]["layers"]
  rows = []

  def add(what, metric, a, b, value, note=""):
    eff = paired_effect(layers, a, b, value)
    if eff["n"]:
      rows.append({"what": what, "metric": metric, "a": a, "b": b, **eff, "note": note})

  add("RHT on -> off", "Wgrad rel. error vs BF16", MAIN, "nvfp4-noRHT", lambda r: layer_value(r, "wgrad_err"))
  add("RHT on -> off", "Wgrad cosine vs BF16", MAIN, "nvfp4-noRHT", lambda r: layer_value(r, "wgrad_cos"))
  add("RHT on -> off", "Wgrad bias floor vs exact-gradient ref. (noise removed)", MAIN, "nvfp4-noRHT",
      lambda r: probes.bias_floor(r["bias"]["wgrad"]["exact_grad"]))
  add("RHT on -> off", "Wgrad bias floor vs BF16 (noise removed)", MAIN, "nvfp4-noRHT",
      lambda r: probes.bias_floor(r["bias"]["wgrad"]["bf16"]))
  for gemm in ("dgrad", "wgrad"):
    add("SR on -> off", f"{gemm.capitalize()} bias vs exact-gradient ref. (K = max)", MAIN, "nvfp4-noSR",
        lambda r, g=gemm: top_bias(r, g, "exact_grad")[1])
    add("SR on -> off", f"{gemm.capitalize()} bias floor (noise removed)", MAIN, "nvfp4-noSR",
        lambda r, g=gemm: probes.bias_floor(r["bias"][g]["exact_grad"]))
    add("SR on -> off", f"{gemm.capitalize()} single-draw rel. error vs BF16", MAIN, "nvfp4-noSR",
        lambda r, g=gemm: layer_value(r, f"{g}_err"))
  add("2D -> 1D weights", "chain-rule gap: Dgrad W vs Fprop W", MAIN, "nvfp4-no2D", lambda r: r["chain_dgrad"])
  add("2D -> 1D weights", "Dgrad bias vs quantized forward's gradient (K = max)", MAIN, "nvfp4-no2D",
      lambda r: top_bias(r, "dgrad", "chain")[1])
  add("2D -> 1D weights", "Fprop rel. error vs BF16", MAIN, "nvfp4-no2D", lambda r: r["fprop_err"])
  for gemm in ("fprop", "dgrad", "wgrad"):
    add("NVFP4 -> MXFP4", f"{gemm.capitalize()} rel. error vs BF16", MAIN, "mxfp4",
        lambda r, g=gemm: layer_value(r, f"{g}_err"))
  return rows


def significance(mean: float, se: float) -> str:
  """"+2.5 SE", with "(no effect)" below 2 SE; "exact" when the SE is 0."""
  if se is None or math.isnan(se) or se == 0:
    return "exact" if se == 0 else "-"
  z = mean / se
  return f"{z:+.1f} SE" + ("" if abs(z) >= 2 else " (no effect)")


def continuation_deltas(cont: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """Per variant: val-loss change vs BF16 continued with the same seed (own forward and BF16 forward), mean +- SE."""
  runs = cont["runs"]
  ref = runs.get(REFERENCE)
  out = {}
  for variant, by_seed in runs.items():
    seeds = sorted(by_seed, key=int)
    own = [by_seed[s]["val_own"] for s in seeds]
    row = {"val_own": mean_se(own), "val_bf16": mean_se([by_seed[s]["val_bf16"] for s in seeds]),
           "seeds": len(seeds)}
    if ref is not None and variant != REFERENCE:
      row["delta_own"] = mean_se([by_seed[s]["val_own"] - ref[s]["val_own"] for s in seeds if s in ref])
      row["delta_bf16"] = mean_se([by_seed[s]["val_bf16"] - ref[s]["val_bf16"] for s in seeds if s in ref])
    out[variant] = row
  return out


def recovered_dloss(mp: Mapping[str, Any], block: int) -> tuple[float, float]:
  """dloss(all quantized) - dloss(block in BF16): mean and SE over the probe sequences (paired)."""
  diff = np.asarray(mp["variants"][MAIN]["seq_dloss"], np.float64) - np.asarray(
      mp["all_but"][str(block)]["seq_dloss"], np.float64)
  return mean_se(diff)


def sensitivity_ranking(mp: Mapping[str, Any]) -> list[int]:
  """Blocks, most sensitive first: by the loss recovered when each alone is kept in BF16 ("all_but"), else by the
  loss change when each alone is quantized ("only")."""
  n = mp["n_layers"]
  if mp.get("all_but"):
    return sorted(range(n), key=lambda i: -recovered_dloss(mp, i)[0])
  return sorted(range(n), key=lambda i: -mp["only"][str(i)]["dloss"])
