"""`python -m experiments.probes recipes --preset {smoke,cpu} --out DIR`: every recipe of the recipes comparison
(experiments.recipes) on the same captured GEMM tensors.

End-to-end loss at CPU scale cannot order the recipes (seed noise is as large as their published gaps). Here one BF16
model, trained briefly (OUT/base, reused when present; or --checkpoint RUN_DIR), gives each probed layer's x, W and
dY ONCE; then every run of experiments.recipes's cpu sweep (its "recipe" override, so new runs are picked up) has its
Fprop, Dgrad and Wgrad measured on those same tensors by fp4jax.analysis.gemm_probes: error against the exact
product, bias against the number K of averaged draws (vs the exact product and vs the quantized forward's
gradient), the chain-rule gap and the stochastic-rounding bias at block maxima. Outputs: OUT/results.json,
OUT/report.md (tables), OUT/results.csv (one row per run, layer and GEMM), OUT/bias_vs_k.png.

    python -m experiments.probes recipes --preset smoke --out runs/recipe_probes_smoke   # under a minute
    python -m experiments.probes recipes --preset cpu --out runs/recipe_probes_cpu       # ~3 min on 2 CPU cores
    python -m experiments.probes recipes --report-only --out runs/recipe_probes_cpu      # redraw from results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

import fp4jax.recipes as recipes_lib
from fp4jax import cli_values
from fp4jax.analysis import gemm_probes
from fp4jax.analysis import model_probes
from fp4jax.pretrain import model as model_lib

from experiments import recipes as recipes_experiment
from experiments.common import jsonable
from experiments.probes import recipe_gemms_report as report
from experiments.probes import training
from experiments.probes.presets import ProbePreset


@dataclasses.dataclass(frozen=True)
class RecipeProbePreset:
  """What `probes recipes` trains, captures and measures.

  base: the BF16 base run and probe batches (fields of experiments.probes.presets.ProbePreset used by
  experiments.probes.training). layers: the linear layers probed (none of the last block, which the comparison's FP4
  runs keep in BF16). num_draws: draws per layer and recipe (bias levels K = 1 .. num_draws / 2). sweep_preset: the
  experiments.recipes preset whose runs are compared.
  """

  base: ProbePreset
  layers: tuple[str, ...]
  num_draws: int
  sweep_preset: str = "cpu"


PRESETS: dict[str, RecipeProbePreset] = {
    # A 1-block tiny model with 64 x 64 layers, 8 BF16 steps, 4 x 32 tokens, one layer, 16 draws.
    "smoke": RecipeProbePreset(
        base=ProbePreset(model="tiny", model_overrides=(("n_layers", 1), ("d_ff", 64), ("n_kv_heads", 4)),
                         base_steps=8, batch_size=4, seq_len=32, lr=1e-2, eval_batches=1, probe_batches=1),
        layers=("blocks.0.mlp.up",), num_draws=16),
    # ~3 min on a shared 2-core CPU. The sweeps' CPU model (tiny, 4 blocks), batch and learning rate (300 steps of
    # 16 x 64 tokens at lr 1e-2, constant after warmup); 16 x 64 = 1024 probe tokens; five layers from blocks 0-2
    # in two shapes (one compilation per shape and recipe: most of the time); 128 draws (K up to 64).
    "cpu": RecipeProbePreset(
        base=ProbePreset(model="tiny", model_overrides=(("n_layers", 4),), base_steps=300, batch_size=16, seq_len=64,
                         lr=1e-2, eval_batches=4, probe_batches=1),
        layers=("blocks.0.attn.q", "blocks.0.mlp.down", "blocks.1.attn.o", "blocks.2.attn.q", "blocks.2.mlp.down"),
        num_draws=128),
}


# The run overrides a GEMM probe represents: the recipe (BF16 blocks are not probed, see RecipeProbePreset.layers).
GEMM_OVERRIDES = ("recipe", "bf16_last")


def get_preset(name: str) -> RecipeProbePreset:
  """The preset called `name` (ValueError naming the valid ones otherwise)."""
  if name not in PRESETS:
    raise ValueError(f"Unknown preset {name!r}; valid presets: {', '.join(PRESETS)}.")
  return PRESETS[name]


def comparison_recipes(sweep_preset: str = "cpu", only: Sequence[str] | None = None, log=print
                       ) -> dict[str, dict[str, Any]]:
  """{run name: {"spec": recipe string, "label", "recipe": Recipe}} of experiments.recipes's `sweep_preset` sweep.

  Runs without a "recipe" override, or with training options besides it (e.g. OutControl's, whose GEMMs depend on
  the channels a training run selects), are skipped (logged); a recipe string that does not parse raises a
  ValueError naming the run. `only`: run names to keep (ValueError for unknown ones).
  """
  runs = recipes_experiment.get_config(sweep_preset).runs
  names = [r.name for r in runs]
  unknown = sorted(set(only or ()) - set(names))
  if unknown:
    raise ValueError(f"Unknown run(s) {unknown}; experiments.recipes ({sweep_preset}) has {names}.")
  out = {}
  for run in runs:
    if only and run.name not in only:
      continue
    spec = run.overrides.get("recipe")
    if spec is None:
      log(f"  {run.name}: no 'recipe' override, nothing to probe at the GEMM level; skipped.")
      continue
    extra = sorted(set(run.overrides) - set(GEMM_OVERRIDES))
    if extra:
      log(f"  {run.name}: sets training options ({', '.join(extra)}) the GEMM probes do not model; skipped.")
      continue
    try:
      recipe = recipes_lib.get_recipe(spec)
    except (ValueError, TypeError) as e:
      raise ValueError(f"experiments.recipes run {run.name!r}: recipe {spec!r} does not parse: {e}") from e
    out[run.name] = {"spec": str(spec) if not isinstance(spec, recipes_lib.Recipe) else spec.name,
                     "label": run.label or run.name, "recipe": recipe}
  if not out:
    raise ValueError(f"No run of experiments.recipes ({sweep_preset}) sets a recipe to probe.")
  return out


def probe_recipes(tensors, layers: Sequence[str], recipes: dict[str, dict[str, Any]], *, num_draws: int,
                  seed: int = 0, log=print) -> dict[str, dict[str, Any]]:
  """{layer: {run: gemm_probes.probe_gemms result}}: every recipe on the same tensors and layer keys."""
  missing = [n for n in layers if n not in tensors]
  if missing:
    raise ValueError(f"layers {missing} are not linear layers of the model; it has {list(tensors)}.")
  out = {}
  for name in layers:
    key = model_lib.layer_key(jax.random.key(seed), name)
    out[name] = {}
    for run, r in recipes.items():
      t0 = time.perf_counter()
      out[name][run] = gemm_probes.probe_gemms(tensors[name], r["recipe"], key, num_draws=num_draws)
      log(f"  {name} {run}: {time.perf_counter() - t0:.1f}s")
  return out


def run(preset_name: str, out: str | pathlib.Path, *, checkpoint: str | None = None, retrain_base: bool = False,
        only: Sequence[str] | None = None, log=print) -> dict[str, Any]:
  """Captures the tensors, probes every recipe, writes OUT/results.json and the report; returns the results."""
  preset = get_preset(preset_name)
  recipes = comparison_recipes(preset.sweep_preset, only, log=log)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  run_dir = (pathlib.Path(checkpoint) if checkpoint
             else training.ensure_base(preset.base, out, retrain=retrain_base, log=log))
  config, model, _, step, dataset = training.restore_run(run_dir, log=log)
  batch = training.probe_batch(dataset, preset.base, config)
  loss, tensors = model_probes.capture_layer_tensors(model, batch)
  m = next(iter(tensors.values())).x_MxK.shape[0]
  log(f"Captured x, W, dY of {len(tensors)} layers ({m} tokens, BF16 loss {loss:.4f}); probing {len(recipes)} "
      f"recipes on {len(preset.layers)} layers x {preset.num_draws} draws.")
  results = {"preset": preset_name, "checkpoint": str(run_dir), "step": step, "bf16_loss": loss, "tokens": m,
             "model_name": training.model_name(preset.base.model, preset.base.model_overrides, config, checkpoint,
                                               log=log),
             "num_draws": preset.num_draws,
             "runs": {k: {"spec": v["spec"], "label": v["label"], "recipe": v["recipe"].name}
                      for k, v in recipes.items()},
             "shapes": {n: [int(tensors[n].x_MxK.shape[1]), int(tensors[n].w_KxN.shape[1])] for n in preset.layers}}
  results["layers"] = probe_recipes(tensors, preset.layers, recipes, num_draws=preset.num_draws, log=log)
  results["seconds"] = time.perf_counter() - t0
  (out / report.RESULTS_FILE).write_text(json.dumps(jsonable(results)))
  paths = report.write_report(out)
  log(f"Done in {results['seconds']:.0f}s: {', '.join(str(p) for p in paths)}")
  return results


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m experiments.probes recipes`; returns the exit code."""
  parser = cli_values.ArgumentParser(prog="python -m experiments.probes recipes", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
  parser.add_argument("--out", required=True, help="output folder (the BF16 base run goes to OUT/base)")
  parser.add_argument("--checkpoint", default=None, help="capture from this fp4jax training run folder instead")
  parser.add_argument("--retrain-base", action="store_true", help="replace OUT/base even if it holds another run")
  parser.add_argument("--runs", default=None, help="comma-separated run names of experiments.recipes (default all)")
  parser.add_argument("--report-only", action="store_true", help="redraw the report from OUT/results.json")
  parser.add_argument("--list", action="store_true", help="print the preset and the recipes compared, run nothing")
  args = parser.parse_args(argv)
  only = [r.strip() for r in args.runs.split(",") if r.strip()] if args.runs else None
  try:
    if args.report_only:
      for p in report.write_report(args.out):
        print(p)
      return 0
    if args.list:
      preset = get_preset(args.preset)
      print(f"probes recipes ({args.preset}): layers {list(preset.layers)}, {preset.num_draws} draws, base run "
            f"{dataclasses.asdict(preset.base)}")
      for name, r in comparison_recipes(preset.sweep_preset, only).items():
        print(f"  {name:<20} {r['spec']:<40} {r['label']}")
      return 0
    run(args.preset, args.out, checkpoint=args.checkpoint, retrain_base=args.retrain_base, only=only,
        log=lambda s: print(s, flush=True))
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
