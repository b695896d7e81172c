"""Plots of a probes results.json: per-layer errors, bias vs K, layer sensitivity, continuations (PNG, Agg)."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from experiments.probes import summary
from experiments.probes.presets import MAIN, REFERENCE


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plot_layer_errors(results, path: pathlib.Path) -> pathlib.Path:
  """Relative error vs BF16 per layer (x) and recipe (lines), one panel per GEMM."""
  plt = _pyplot()
  layers = results["layers"]["layers"]
  names = list(layers)
  recipes = [r for r in next(iter(layers.values())) if r != REFERENCE]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
  for ax, gemm in zip(axes, ("fprop", "dgrad", "wgrad")):
    for i, r in enumerate(recipes):
      values = [summary.layer_value(layers[n][r], f"{gemm}_err") for n in names]
      ax.plot(range(len(names)), values, "o-", ms=3, lw=1, color=f"C{i}", label=r)
    ax.set_title(f"{gemm.capitalize()} relative error vs BF16")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("blocks.", "").replace("attn.", "").replace("mlp.", "") for n in names],
                       rotation=90, fontsize=6)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot_bias(results, path: pathlib.Path) -> pathlib.Path:
  """Gradient bias vs K (log-log) against the exact-gradient reference, mean over the longest-curve layers."""
  plt = _pyplot()
  layers = results["layers"]["layers"]
  longest = max(len(next(iter(v.values()))["bias"]["dgrad"]["bf16"]["K"]) for v in layers.values())
  names = [n for n, v in layers.items() if len(next(iter(v.values()))["bias"]["dgrad"]["bf16"]["K"]) == longest]
  recipes = [r for r in next(iter(layers.values())) if r != REFERENCE]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  panels = (("dgrad", "exact_grad", "Dgrad vs exact-gradient reference"),
            ("wgrad", "exact_grad", "Wgrad vs exact-gradient reference"),
            ("dgrad", "chain", "Dgrad vs quantized forward's gradient"))
  for ax, (gemm, ref, title) in zip(axes, panels):
    for i, r in enumerate(recipes):
      curves = [layers[n][r]["bias"][gemm][ref] for n in names if r in layers[n]]
      k = np.asarray(curves[0]["K"])
      mean = np.mean([c["mean"] for c in curves], axis=0)
      se = np.mean([[float(s) for s in c["se"]] for c in curves], axis=0)
      ax.errorbar(k, mean, yerr=se, fmt="o-", ms=3, lw=1, capsize=2, color=f"C{i}", label=r)
    k = np.asarray(curves[0]["K"], np.float64)
    first = np.mean([layers[n][MAIN]["bias"][gemm][ref]["mean"][0] for n in names]) if MAIN in recipes else 1.0
    ax.plot(k, first / np.sqrt(k), "k--", lw=0.8, label="K^-1/2 (unbiased)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("K (averaged SR draws)")
    ax.set_ylabel("||mean_K - ref|| / ||ref||")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def _nan0(value) -> float:
  value = float(value)
  return 0.0 if math.isnan(value) else value


def plot_sensitivity(results, path: pathlib.Path) -> pathlib.Path:
  """Per block: dloss with only that block quantized, and dloss recovered by keeping it in BF16."""
  plt = _pyplot()
  mp = results["model"]
  n = mp["n_layers"]
  fig, ax = plt.subplots(figsize=(6, 3.8))
  x = np.arange(n)
  if mp.get("only"):
    ax.bar(x - 0.2, [mp["only"][str(i)]["dloss"] for i in range(n)], 0.4,
           yerr=[_nan0(mp["only"][str(i)]["dloss_se"]) for i in range(n)], capsize=3,
           label=f"only block i in {MAIN}: dloss")
  if mp.get("all_but"):
    recovered = [summary.recovered_dloss(mp, i) for i in range(n)]
    ax.bar(x + 0.2, [r[0] for r in recovered], 0.4, yerr=[_nan0(r[1]) for r in recovered], capsize=3,
           label="block i in BF16: dloss recovered")
  ax.set_xticks(x)
  ax.set_xlabel("block")
  ax.set_ylabel("loss change (± SE over sequences)")
  ax.axhline(0, color="k", lw=0.6)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def plot_continuation(results, path: pathlib.Path) -> pathlib.Path:
  """Validation-loss change vs BF16 after the continuations (mean ± SE over paired seeds)."""
  plt = _pyplot()
  deltas = {k: v for k, v in summary.continuation_deltas(results["continuation"]).items() if "delta_own" in v}
  fig, ax = plt.subplots(figsize=(6, 3.8))
  names = list(deltas)
  x = np.arange(len(names))
  for off, key, label in ((-0.2, "delta_own", "own forward"), (0.2, "delta_bf16", "BF16 forward")):
    mean = [deltas[n][key][0] for n in names]
    se = [0.0 if math.isnan(deltas[n][key][1]) else deltas[n][key][1] for n in names]
    ax.bar(x + off, mean, 0.4, yerr=se, capsize=3, label=label)
  ax.set_xticks(x)
  ax.set_xticklabels(names, rotation=20, fontsize=8)
  ax.axhline(0, color="k", lw=0.6)
  ax.set_ylabel("val loss - BF16 (paired by seed)")
  ax.set_title(f"{results['continuation']['steps']}-step continuations", fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
