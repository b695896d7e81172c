"""Report of `python -m experiments.probes recipes`: OUT/report.md, OUT/results.csv and OUT/bias_vs_k.png from
OUT/results.json."""

from __future__ import annotations

import csv
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fp4jax.analysis import gemm_probes
from fp4jax.analysis import probes

from experiments.common import PROBE_RESULTS, fmt, read_probe_results, table

RESULTS_FILE = PROBE_RESULTS
REPORT_FILE = "report.md"
CSV_FILE = "results.csv"
PLOT_FILE = "bias_vs_k.png"


def _num(v) -> float:
  """A JSON number back to float ("nan" / "inf" strings included)."""
  return float(v)


def _curve(c: Mapping[str, Any]) -> dict[str, Any]:
  return {"K": c["K"], "mean": [_num(v) for v in c["mean"]], "se": [_num(v) for v in c["se"]],
          "groups": [[_num(v) for v in g] for g in c["groups"]]}


def layer_row(res: Mapping[str, Any]) -> dict[str, float]:
  """Scalars of one layer x recipe: errors, bias at K = 1 and K = max and floors, slopes, chain gaps, maxima."""
  row = {}
  for g in gemm_probes.GEMMS:
    err = np.asarray([_num(v) for v in res["err"][g]])
    row[f"{g}_err"], row[f"{g}_err_se"] = float(err.mean()), probes.standard_error(err)
  for g, ref in gemm_probes.SERIES:
    c = _curve(res["bias"][g][ref])
    row[f"{g}_{ref}_K1"], row[f"{g}_{ref}_Kmax"] = c["mean"][0], c["mean"][-1]
    row[f"{g}_{ref}_Kmax_se"] = c["se"][-1]
    nan = any(math.isnan(m) for m in c["mean"])
    row[f"{g}_{ref}_floor"] = float("nan") if nan else probes.bias_floor(c)
    row[f"{g}_{ref}_slope"] = float("nan") if nan else probes.decay_slope(c)
  for g in ("dgrad", "wgrad"):
    chain = np.asarray([_num(v) for v in res["chain"][g]])
    row[f"{g}_chain"] = float(chain.mean())
    m = np.asarray([_num(v) for v in res["maxima"][g]])
    row[f"{g}_maxima"] = float(m.mean())
    row[f"{g}_maxima_se"] = probes.standard_error(m) if not np.isnan(m).any() else float("nan")
  return row


def recipe_summary(results: Mapping[str, Any]) -> dict[str, dict[str, float]]:
  """{run: {metric: mean over the probed layers}} (SEs pooled as sqrt(mean SE^2) / sqrt(layers))."""
  layers = results["layers"]
  out = {}
  for run in results["runs"]:
    rows = [layer_row(layers[n][run]) for n in layers if run in layers[n]]
    summary = {}
    for k in rows[0]:
      v = np.asarray([r[k] for r in rows], np.float64)
      summary[k] = (float(np.sqrt(np.mean(np.square(v))) / np.sqrt(len(v))) if k.endswith("_se")
                    else float(np.mean(v)))
    out[run] = summary
  return out


def _pct(mean, se=None) -> str:
  if mean is None or math.isnan(mean):
    return "-"
  return f"{100 * mean:+.2f}%" + ("" if se is None or math.isnan(se) else f" ± {100 * se:.2f}%")


def _slope(v) -> str:
  return "-" if math.isnan(v) else f"{v:+.2f}"


def write_markdown(results: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
  """The tables of a results.json."""
  s = recipe_summary(results)
  runs = results["runs"]
  kmax = results["num_draws"] // 2
  lines = [f"# GEMM probes of the recipes comparison ({results['preset']})", "",
           f"Every run of `python -m experiments.recipes` (its recipe string) on the same tensors: x, W, dY of "
           f"{len(results['layers'])} linear layers ({', '.join(results['layers'])}; [K, N] "
           f"{', '.join(str(tuple(v)) for v in results['shapes'].values())}) captured once from a BF16 model "
           f"({results['model_name']}, step {results['step']}, {results['tokens']} tokens, loss "
           f"{results['bf16_loss']:.4f}; layers of blocks the FP4 runs quantize); {results['num_draws']} draws (layer keys) per recipe and layer; GEMMs in "
           "float32 from the dequantized operands. Values are means over the probed layers.", ""]
  lines += ["## Error and bias against the exact product", "",
            "err: ||out - exact|| / ||exact|| for one draw (mean over draws); exact = the float64 product of the "
            f"captured tensors. bias K={kmax}: the same for the mean of {kmax} draws (± SE across groups of draws); "
            "floor: the bias with the noise removed, sqrt((K e_K^2 - e_1^2) / (K - 1)). Fprop is deterministic in "
            "every recipe here: its error is all bias.", ""]
  rows = []
  for run, r in s.items():
    rows.append([run, f"`{runs[run]['spec']}`", fmt(r["fprop_err"]), fmt(r["dgrad_err"]), fmt(r["wgrad_err"]),
                 fmt(r["dgrad_exact_Kmax"], r["dgrad_exact_Kmax_se"]), fmt(r["dgrad_exact_floor"]),
                 fmt(r["wgrad_exact_Kmax"], r["wgrad_exact_Kmax_se"]), fmt(r["wgrad_exact_floor"])])
  lines += [table(["run", "recipe", "Fprop err", "Dgrad err", "Wgrad err", f"Dgrad bias K={kmax}", "Dgrad floor",
                   f"Wgrad bias K={kmax}", "Wgrad floor"], rows), ""]
  lines += ["## Backward against the quantized forward's gradient", "",
            "Reference: dY Q(W)^T (Dgrad) and Q(x)^T dY (Wgrad), Q the Fprop operands (straight-through gradient of "
            "the forward the model computes). slope: of log bias vs log K (-0.5: the backward is an unbiased "
            "estimate of that gradient; towards 0: a bias). chain gap: the backward with its dY left unrounded vs "
            "that gradient (its other operand's distance from Fprop's; mean over draws). maxima: signed relative "
            "error of the stochastically rounded dY operand at its block maxima v, sum sign(v) (q - v) / sum |v| "
            "(± SE over draws; negative: they shrink; 0 for unbiased scales).", ""]
  rows = []
  for run, r in s.items():
    rows.append([run, fmt(r["dgrad_qfwd_Kmax"], r["dgrad_qfwd_Kmax_se"]), _slope(r["dgrad_qfwd_slope"]),
                 fmt(r["dgrad_qfwd_floor"]), fmt(r["wgrad_qfwd_Kmax"], r["wgrad_qfwd_Kmax_se"]),
                 _slope(r["wgrad_qfwd_slope"]), fmt(r["wgrad_qfwd_floor"]), fmt(r["dgrad_chain"]),
                 fmt(r["wgrad_chain"]), _pct(r["dgrad_maxima"], r["dgrad_maxima_se"]),
                 _pct(r["wgrad_maxima"], r["wgrad_maxima_se"])])
  lines += [table(["run", f"Dgrad bias K={kmax}", "slope", "floor", f"Wgrad bias K={kmax}", "slope", "floor",
                   "chain gap Dgrad", "chain gap Wgrad", "maxima Dgrad dY", "maxima Wgrad dY"], rows), ""]
  lines += ["## Per layer: error and bias floors", ""]
  rows = []
  for name, by_run in results["layers"].items():
    for run, res in by_run.items():
      r = layer_row(res)
      rows.append([name, run, fmt(r["fprop_err"]), fmt(r["dgrad_err"]), fmt(r["wgrad_err"]),
                   fmt(r["dgrad_exact_floor"]), fmt(r["wgrad_exact_floor"]), fmt(r["dgrad_qfwd_floor"]),
                   fmt(r["wgrad_qfwd_floor"]), _pct(r["dgrad_maxima"])])
  lines += [table(["layer", "run", "Fprop err", "Dgrad err", "Wgrad err", "Dgrad floor (exact)",
                   "Wgrad floor (exact)", "Dgrad floor (qfwd)", "Wgrad floor (qfwd)", "maxima Dgrad dY"], rows), ""]
  path.write_text("\n".join(lines))
  return path


def write_csv(results: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
  """One row per run, layer and GEMM: error, bias curve vs each reference, floors, slopes, chain gap, maxima."""
  fields = ["run", "recipe", "layer", "gemm", "err", "err_se"]
  ks = None
  rows = []
  for name, by_run in results["layers"].items():
    for run, res in by_run.items():
      r = layer_row(res)
      for g in gemm_probes.GEMMS:
        row = {"run": run, "recipe": results["runs"][run]["spec"], "layer": name, "gemm": g, "err": r[f"{g}_err"],
               "err_se": r[f"{g}_err_se"]}
        for ref in gemm_probes.REFERENCES:
          if ref not in res["bias"][g]:
            continue
          c = _curve(res["bias"][g][ref])
          ks = c["K"]
          row.update({f"bias_{ref}_K{k}": m for k, m in zip(c["K"], c["mean"])})
          row[f"floor_{ref}"], row[f"slope_{ref}"] = r[f"{g}_{ref}_floor"], r[f"{g}_{ref}_slope"]
        if g != "fprop":
          row.update({"chain_gap": r[f"{g}_chain"], "maxima": r[f"{g}_maxima"], "maxima_se": r[f"{g}_maxima_se"]})
        rows.append(row)
  for ref in gemm_probes.REFERENCES:
    fields += [f"bias_{ref}_K{k}" for k in ks] + [f"floor_{ref}", f"slope_{ref}"]
  fields += ["chain_gap", "maxima", "maxima_se"]
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    for row in rows:
      writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
  return path


def plot_bias(results: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
  """Bias vs K per recipe (log-log, mean over layers): vs the exact product (top), vs the quantized forward's
  gradient (bottom), and the block-maxima bias of the SR dY operands (bottom right)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  layers = results["layers"]
  runs = list(results["runs"])
  fig, axes = plt.subplots(2, 3, figsize=(15, 8.4))
  panels = [(axes[0, i], g, "exact") for i, g in enumerate(gemm_probes.GEMMS)]
  panels += [(axes[1, 0], "dgrad", "qfwd"), (axes[1, 1], "wgrad", "qfwd")]
  titles = {"exact": "vs exact product", "qfwd": "vs quantized forward's gradient"}
  for ax, g, ref in panels:
    first = []
    for i, run in enumerate(runs):
      curves = [_curve(layers[n][run]["bias"][g][ref]) for n in layers if run in layers[n]]
      mean = np.mean([c["mean"] for c in curves], axis=0)
      if np.all(np.isnan(mean)) or np.all(mean < 1e-5):  # e.g. BF16's exact Wgrad: off a log scale
        continue
      se = np.nan_to_num(np.mean([c["se"] for c in curves], axis=0))
      k = np.asarray(curves[0]["K"], np.float64)
      ax.errorbar(k, mean, yerr=se, fmt="o-", ms=3, lw=1, capsize=2, color=f"C{i}", label=run)
      first.append(mean[0])
    if first:
      ax.plot(k, max(first) / np.sqrt(k), "k--", lw=0.8, label="K^-1/2 (unbiased)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("K (averaged draws)")
    ax.set_ylabel("||mean_K - ref|| / ||ref||")
    ax.set_title(f"{g.capitalize()} {titles[ref]}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
  axes[0, 0].legend(fontsize=7)
  ax = axes[1, 2]
  s = recipe_summary(results)
  x = np.arange(len(runs))
  for off, g in ((-0.2, "dgrad"), (0.2, "wgrad")):
    vals = [100 * np.nan_to_num(s[r][f"{g}_maxima"]) for r in runs]
    errs = [100 * np.nan_to_num(s[r][f"{g}_maxima_se"]) for r in runs]
    ax.bar(x + off, vals, 0.4, yerr=errs, capsize=2, label=f"{g.capitalize()} dY")
  ax.set_xticks(x)
  ax.set_xticklabels(runs, rotation=30, ha="right", fontsize=7)
  ax.axhline(0, color="k", lw=0.6)
  ax.set_ylabel("sum sign(v)(q - v) / sum |v| at block maxima (%)")
  ax.set_title("SR bias at block maxima", fontsize=10)
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def write_report(out: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes OUT/report.md, OUT/results.csv and OUT/bias_vs_k.png from OUT/results.json; returns their paths."""
  out = pathlib.Path(out)
  results = read_probe_results(out, "recipes")
  return [write_markdown(results, out / REPORT_FILE), write_csv(results, out / CSV_FILE),
          plot_bias(results, out / PLOT_FILE)]
