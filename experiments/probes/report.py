"""The Markdown report of a probes run: OUT/report.md (and the plots) from OUT/results.json."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fp4jax.analysis import probes

from experiments.common import PROBE_RESULTS, fmt, read_probe_results, table
from experiments.probes import plots
from experiments.probes import summary
from experiments.probes.presets import MAIN
from experiments.probes.summary import layer_value

RESULTS_FILE = PROBE_RESULTS
REPORT_FILE = "report.md"


def write_report(out: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes OUT/report.md and the PNG plots from OUT/results.json; returns the written paths."""
  out = pathlib.Path(out)
  results = read_probe_results(out, "layers")
  written = [write_markdown(results, out / REPORT_FILE), plots.plot_layer_errors(results, out / "layer_errors.png"),
             plots.plot_bias(results, out / "bias_vs_k.png")]
  if results.get("model", {}).get("only") or results.get("model", {}).get("all_but"):
    written.append(plots.plot_sensitivity(results, out / "sensitivity.png"))
  if results.get("continuation"):
    written.append(plots.plot_continuation(results, out / "continuation.png"))
  return written


def write_markdown(results: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
  """The Markdown tables of a results.json."""
  lp = results["layers"]
  layers = lp["layers"]
  recipes = list(next(iter(layers.values())))
  lines = [f"# Low-noise probes ({results['preset']})", "",
           f"Checkpoint: `{results['checkpoint']}` step {results['step']} (BF16 loss on the probe tokens "
           f"{lp['bf16_loss']:.4f}); model {results['model_name']}; {lp['tokens']} probe tokens; "
           f"{len(layers)} linear layers. Errors are relative Frobenius errors vs the BF16 GEMM on the same x, W, dY.",
           ""]

  # 1. Component effects.
  lines += ["## Component effects (paired over layers)", "",
            "Effect = variant - baseline, mean over layers ± standard error across layers; 'k/n' = layers where "
            "the variant is larger. '(no effect)': |effect| < 2 SE.", ""]
  rows = []
  for e in summary.component_effects(results):
    rows.append([e["what"], e["metric"], fmt(e["a"]), fmt(e["b"]), fmt(e["mean"], e["se"], signed=True),
                 f"{e['positive']}/{e['n']}", summary.significance(e["mean"], e["se"])])
  lines += [table(["change", "metric", "baseline", "variant", "effect", "k/n", "z"], rows), ""]

  # 2. Recipe summary.
  lines += ["## Per recipe, mean over layers (± SE across layers)", ""]
  rows = []
  for r in recipes:
    res = [layers[n][r] for n in layers if r in layers[n]]
    cell = lambda f: fmt(*summary.mean_se([f(x) for x in res]))
    rows.append([r, cell(lambda x: x["fprop_err"]), cell(lambda x: layer_value(x, "dgrad_err")),
                 cell(lambda x: layer_value(x, "wgrad_err")), cell(lambda x: layer_value(x, "dgrad_cos")),
                 cell(lambda x: layer_value(x, "wgrad_cos")), cell(lambda x: x["chain_dgrad"]),
                 cell(lambda x: x["chain_wgrad"]), cell(lambda x: x["weight_mismatch"])])
  lines += [table(["recipe", "Fprop err", "Dgrad err", "Wgrad err", "Dgrad cos", "Wgrad cos", "chain gap Dgrad",
                    "chain gap Wgrad", "W mismatch"], rows), ""]

  # 3. Bias vs K.
  lines += ["## Gradient bias vs number of averaged SR draws K", "",
            "||mean of K draws - reference|| / ||reference||, mean over the layers with the longest curves "
            "(± SE across groups of draws, averaged over layers). Noise decays like K^-1/2 (slope -0.5); a bias "
            "flattens (slope -> 0). 'floor': the bias with the noise removed, sqrt((K_max e_Kmax^2 - e_1^2) / "
            "(K_max - 1)).", ""]
  longest = max(len(next(iter(layers[n].values()))["bias"]["dgrad"]["bf16"]["K"]) for n in layers)
  bias_names = [n for n in layers if len(next(iter(layers[n].values()))["bias"]["dgrad"]["bf16"]["K"]) == longest]
  ks = next(iter(layers[bias_names[0]].values()))["bias"]["dgrad"]["bf16"]["K"]
  rows = []
  for r in recipes:
    for gemm in ("dgrad", "wgrad"):
      for ref in probes.BIAS_REFERENCES:
        curves = [layers[n][r]["bias"][gemm][ref] for n in bias_names if r in layers[n]]
        means = np.mean([c["mean"] for c in curves], axis=0)
        ses = np.mean([[s if isinstance(s, float) else float(s) for s in c["se"]] for c in curves], axis=0)
        slope = float(np.mean([probes.decay_slope(c) for c in curves]))
        floor = float(np.mean([probes.bias_floor(c) for c in curves]))
        rows.append([r, gemm, ref] + [fmt(m, s, 4) for m, s in zip(means, ses)]
                    + ["-" if math.isnan(slope) else f"{slope:+.2f}", fmt(floor)])
  lines += [f"Layers: {', '.join(bias_names)}.", "",
            table(["recipe", "GEMM", "reference"] + [f"K={k}" for k in ks] + ["slope", "floor"], rows), ""]

  # 4. Codes and scales.
  lines += ["## Codes and block scales per quantized operand (mean over layers)", "",
            "zero / sat: fraction of E2M1 codes that are ±0 / ±6. scale lo/hi: smallest / largest non-zero block "
            "scale (NVFP4: stored E4M3 value, range [2^-9, 448]; MXFP4: 2^e), median over layers; octaves: "
            "log2(hi/lo); zero-scale: blocks whose scale is 0; subnormal: NVFP4 blocks with an E4M3 scale < 2^-6.",
            ""]
  rows = []
  for r in recipes:
    ops = next(iter(layers.values()))[r]["stats"]
    for op in probes.OPERANDS:
      if op not in ops:
        continue
      st = [layers[n][r]["stats"][op] for n in layers if r in layers[n] and op in layers[n][r]["stats"]]
      med = lambda k: float(np.median([float(s[k]) for s in st]))
      mean = lambda k: float(np.mean([float(s[k]) for s in st]))
      rows.append([r, op, f"{100 * mean('zero'):.1f}%", f"{100 * mean('sat'):.1f}%", f"{med('amax'):.3g}",
                   f"{med('scale_lo'):.3g}", f"{med('scale_hi'):.3g}", f"{mean('octaves'):.1f}",
                   f"{100 * mean('scale_zero'):.2f}%", f"{100 * mean('scale_subnormal'):.2f}%"])
  lines += [table(["recipe", "operand", "zero", "sat", "amax (median)", "scale lo", "scale hi", "octaves",
                    "zero-scale", "subnormal"], rows), ""]

  # 5. Whole model.
  mp = results.get("model")
  if mp:
    lines += ["## Whole model on the probe tokens", "",
              f"BF16 loss {mp['reference_loss']:.4f}. dloss: loss with the variant's forward minus BF16 (no SR "
              "noise: the forward has no randomness), ± SE over the probe sequences. Gradient error / cosine vs the "
              "BF16 parameter gradient, mean ± SE over SR draws; 'mean-of-draws err': error of the average gradient "
              "(the part SR noise cannot explain).", ""]
    rows = []
    for name, v in mp["variants"].items():
      rows.append([name, fmt(v["dloss"], v["dloss_se"], signed=True), fmt(*summary.mean_se(v["grad_err"])),
                   fmt(*summary.mean_se(v["grad_cos"])), fmt(v["grad_bias"])])
    lines += [table(["variant", "dloss", "grad err", "grad cos", "mean-of-draws err"], rows), ""]
    only, all_but = mp.get("only") or {}, mp.get("all_but") or {}
    if only or all_but:
      n = mp["n_layers"]
      lines += [f"### Layer sensitivity ({MAIN}; which blocks to keep in BF16)", "",
                "only i: block i quantized, the rest BF16. recovered: dloss(all quantized) - dloss(block i in "
                "BF16), the loss gained by keeping block i in BF16 (larger = more sensitive); grad err: of the "
                "whole model's gradient with block i in BF16.", ""]
      header, rows = ["block"], [[i] for i in range(n)]
      if only:
        header += ["only i: dloss", "only i: grad err"]
        for i, row in enumerate(rows):
          row += [fmt(only[str(i)]["dloss"], only[str(i)]["dloss_se"], signed=True),
                  fmt(*summary.mean_se(only[str(i)]["grad_err"]))]
      if all_but:
        header += ["recovered dloss", "block i BF16: grad err"]
        for i, row in enumerate(rows):
          row += [fmt(*summary.recovered_dloss(mp, i), signed=True), fmt(*summary.mean_se(all_but[str(i)]["grad_err"]))]
      lines += [table(header, rows), ""]
      ranking = summary.sensitivity_ranking(mp) if n > 1 else [0]
      which = "the last" if ranking[0] == n - 1 else "the first" if ranking[0] == 0 else f"block {ranking[0]}"
      if n > 1:
        lines += [f"Ranking ({'recovered dloss' if all_but else 'only-i dloss'}, most sensitive first): {ranking}. "
                  f"The paper keeps the last blocks in BF16; here the most sensitive block is {which}.", ""]

  # 6. Continuations.
  cont = results.get("continuation")
  if cont:
    lines += ["## Continuations from the shared checkpoint", "",
              f"{cont['steps']} steps from step {cont['start_step']} (validation loss there {cont['start_val']:.4f}),"
              f" seeds {cont['seeds']} (each seed: its own data order and SR draws, the same for every variant). "
              "delta: validation loss minus BF16 continued with the same seed, mean ± SE over seeds; 'own fwd': "
              "evaluated with the variant's forward, 'BF16 fwd': the same weights evaluated in BF16.", ""]
    rows = []
    for name, d in summary.continuation_deltas(cont).items():
      rows.append([name, fmt(*d["val_own"]), fmt(*d.get("delta_own", (float("nan"), None)), signed=True),
                   fmt(*d.get("delta_bf16", (float("nan"), None)), signed=True), d["seeds"]])
    lines += [table(["variant", "val loss (own fwd)", "delta (own fwd)", "delta (BF16 fwd)", "seeds"], rows), ""]

  # 7. Per layer detail.
  lines += ["## Per layer", ""]
  rows = []
  for n, by_recipe in layers.items():
    for r, x in by_recipe.items():
      rows.append([n, r, fmt(x["fprop_err"]), fmt(layer_value(x, "dgrad_err")), fmt(layer_value(x, "wgrad_err")),
                   fmt(x["chain_dgrad"]), fmt(x["chain_wgrad"]), fmt(summary.top_bias(x, "dgrad", "exact_grad")[1]),
                   fmt(summary.top_bias(x, "wgrad", "exact_grad")[1])])
  lines += [table(["layer", "recipe", "Fprop err", "Dgrad err", "Wgrad err", "chain gap Dgrad", "chain gap Wgrad",
                    "Dgrad bias (K max)", "Wgrad bias (K max)"], rows), ""]
  path.write_text("\n".join(lines))
  return path
