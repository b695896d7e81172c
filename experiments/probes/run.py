"""Runs a probes preset: layer probes, whole-model probes and continuations; writes OUT/results.json and the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from fp4jax import cli_values
from fp4jax.analysis import model_probes
from fp4jax.analysis import probes
from fp4jax.pretrain import model as model_lib

import experiments.probes
from experiments.common import jsonable
from experiments.probes import presets
from experiments.probes import report
from experiments.probes import training
from experiments.probes.presets import MAIN, ProbePreset


def run_layer_probes(preset: ProbePreset, model, batch, *, seed: int = 0, log=print) -> dict[str, Any]:
  """{"bf16_loss", "tokens", "layers": {layer: {recipe: probe_layer result}}} on the captured BF16 tensors."""
  t0 = time.perf_counter()
  loss, tensors = model_probes.capture_layer_tensors(model, batch)
  log(f"Captured x, W, dY of {len(tensors)} linear layers (BF16 loss {loss:.4f}) in {time.perf_counter() - t0:.0f}s.")
  variants = probes.recipe_variants()
  names = [n for n in tensors if preset.layers is None or re.fullmatch(preset.layers, n)]
  if not names:
    raise ValueError(f"layers regex {preset.layers!r} matches no linear layer.")
  out = {}
  for name in names:
    draws = preset.bias_draws if preset.bias_layers and re.fullmatch(preset.bias_layers, name) else preset.num_draws
    key = model_lib.layer_key(jax.random.key(seed), name)
    t1 = time.perf_counter()
    out[name] = {r: probes.probe_layer(tensors[name], variants[r], key, num_draws=draws) for r in preset.recipes}
    log(f"  {name}: {len(preset.recipes)} recipes x {draws} draws in {time.perf_counter() - t1:.1f}s")
  m = next(iter(tensors.values())).x_MxK.shape[0]
  return {"bf16_loss": loss, "tokens": m, "layers": out}


def run_model_probes(preset: ProbePreset, model, batch, *, seed: int = 0, log=print) -> dict[str, Any]:
  """Whole-model loss change and gradient error per variant, and per-block sensitivity of the main recipe."""
  names, n_layers = list(model.linear_layers()), len(model.blocks)
  t0 = time.perf_counter()
  reference = model_probes.reference_gradient(model, batch)
  key = jax.random.fold_in(jax.random.key(seed), 7)
  done: dict[tuple, dict] = {}

  def probe(recipes):
    signature = tuple(recipes[n] for n in names)
    if signature not in done:
      t1 = time.perf_counter()
      done[signature] = model_probes.model_probe(model, batch, recipes, key, reference=reference,
                                                 num_draws=preset.model_draws)
      log(f"    ({time.perf_counter() - t1:.1f}s)")
    return done[signature]

  out = {"reference_loss": reference.loss, "variants": {}, "only": {}, "all_but": {}, "n_layers": n_layers}
  for variant in preset.model_variants:
    log(f"  model: {variant}")
    out["variants"][variant] = probe(presets.variant_recipes(variant, names, n_layers))
  unknown = set(preset.sensitivity) - {"only", "all_but"}
  if unknown:
    raise ValueError(f"sensitivity entries must be 'only' or 'all_but'; got {sorted(unknown)}.")
  main_recipe = probes.recipe_variants()[MAIN]
  if preset.sensitivity and MAIN not in out["variants"]:
    out["variants"][MAIN] = probe(presets.variant_recipes(MAIN, names, n_layers))
  for i in range(n_layers):
    if "only" in preset.sensitivity:
      log(f"  model: only block {i} in {MAIN}")
      others = [b for b in range(n_layers) if b != i]
      out["only"][i] = probe(presets.blocks_recipes(main_recipe, others, names, n_layers))
    if "all_but" in preset.sensitivity:
      log(f"  model: block {i} in BF16, rest {MAIN}")
      out["all_but"][i] = probe(presets.blocks_recipes(main_recipe, [i], names, n_layers))
  log(f"Model probes: {len(done)} settings in {time.perf_counter() - t0:.0f}s.")
  return out


def run_continuations(preset: ProbePreset, config, model, state, dataset, *, log=print) -> dict[str, Any]:
  """Each continuation variant continued `cont_steps` steps from `state` with seeds 1..cont_seeds (paired data)."""
  names, n_layers = list(model.linear_layers()), len(model.blocks)
  start = int(state.step)
  cont = training.continuation(config, dataset, start_step=start, steps=preset.cont_steps)
  runs: dict[str, dict[int, dict]] = {}
  t0 = time.perf_counter()
  for seed in range(1, preset.cont_seeds + 1):
    for variant in preset.cont_variants:
      t1 = time.perf_counter()
      result = training.continue_training(model, state, presets.variant_recipes(variant, names, n_layers), cont,
                                          steps=preset.cont_steps, seed=seed)
      result.pop("state")
      runs.setdefault(variant, {})[seed] = result
      log(f"  continue {variant} seed {seed}: val {result['val_own']:.4f} (BF16 forward {result['val_bf16']:.4f}) "
          f"in {time.perf_counter() - t1:.1f}s")
  start_val = training.validation_loss(cont, training.bf16_graphdef(model), state.params, None)
  log(f"Continuations: {time.perf_counter() - t0:.0f}s.")
  return {"start_step": start, "steps": preset.cont_steps, "seeds": list(range(1, preset.cont_seeds + 1)),
          "start_val": start_val, "runs": runs}


def run(preset_name: str, out: str | pathlib.Path, *, checkpoint: str | None = None, retrain_base: bool = False,
        skip_continuations: bool = False, log=print) -> dict[str, Any]:
  """Runs every probe of `preset_name`, writes OUT/results.json, OUT/report.md and plots; returns the results."""
  preset = presets.get_preset(preset_name)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  run_dir = pathlib.Path(checkpoint) if checkpoint else training.ensure_base(preset, out, retrain=retrain_base, log=log)
  config, model, state, step, dataset = training.restore_run(run_dir, log=log)
  batch = training.probe_batch(dataset, preset, config)
  results = {"preset": preset_name, "checkpoint": str(run_dir), "step": step,
             "model_name": training.model_name(preset.model, preset.model_overrides, config, checkpoint, log=log),
             "preset_settings": dataclasses.asdict(preset)}
  results["layers"] = run_layer_probes(preset, model, batch, log=log)
  results["model"] = run_model_probes(preset, model, batch, log=log)
  if not skip_continuations and preset.cont_variants:
    results["continuation"] = run_continuations(preset, config, model, state, dataset, log=log)
  results["seconds"] = time.perf_counter() - t0
  (out / report.RESULTS_FILE).write_text(json.dumps(jsonable(results)))
  paths = report.write_report(out)
  log(f"Done in {results['seconds']:.0f}s: {', '.join(str(p) for p in paths)}")
  return results


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m experiments.probes`; returns the exit code. `python -m experiments.probes recipes ...` runs the
  recipes comparison's GEMM probes (experiments.probes.recipe_gemms)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "recipes":
    from experiments.probes import recipe_gemms  # pylint: disable=g-import-not-at-top
    return recipe_gemms.main(argv[1:])
  parser = cli_values.ArgumentParser(prog="python -m experiments.probes", description=experiments.probes.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", choices=sorted(presets.PRESETS), default="smoke")
  parser.add_argument("--out", required=True, help="output folder (the BF16 base run goes to OUT/base)")
  parser.add_argument("--checkpoint", default=None, help="probe this fp4jax training run folder instead of OUT/base")
  parser.add_argument("--retrain-base", action="store_true", help="replace OUT/base even if it holds another run")
  parser.add_argument("--skip-continuations", action="store_true", help="only the fixed-tensor probes")
  parser.add_argument("--report-only", action="store_true", help="redraw report.md and plots from OUT/results.json")
  parser.add_argument("--list", action="store_true", help="print the preset's settings and the base run's config, "
                      "run nothing")
  args = parser.parse_args(argv)
  from fp4jax.pretrain import compile_cache, distributed  # pylint: disable=g-import-not-at-top
  distributed.init_distributed()  # before any JAX use; a no-op without the FP4JAX_* variables
  compile_cache.enable(log=lambda line: print(line, file=sys.stderr))  # before the first compile
  try:
    if args.list:
      preset = presets.get_preset(args.preset)
      print(f"probes ({args.preset}):")
      for name, value in dataclasses.asdict(preset).items():
        print(f"  {name:<18} {value}")
      print(f"  base run           {training.base_config(preset, pathlib.Path(args.out)).to_dict()}")
      return 0
    if args.report_only:
      for p in report.write_report(args.out):
        print(p)
      return 0
    run(args.preset, args.out, checkpoint=args.checkpoint, retrain_base=args.retrain_base,
        skip_continuations=args.skip_continuations, log=lambda s: print(s, flush=True))
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
