"""Low-noise ablations: recipe components measured on the fixed tensors of one trained model, and short paired
continuations from one shared checkpoint.

End-to-end loss at CPU scale cannot tell recipe components apart (stochastic-rounding noise between seeds moves the
validation loss about as much as a component does). Here every recipe sees the SAME layer inputs, weights and output
gradients (captured from a BF16 forward/backward on fixed validation batches), so what differs is the recipe alone:

  1. per layer and GEMM: error and cosine vs BF16; gradient bias vs the number K of averaged SR draws; chain-rule
     consistency (Dgrad weight vs Fprop weight); zero / saturated code fractions and block-scale ranges;
  2. whole model: loss change and gradient error per recipe, per BF16-layer policy, and with one block quantized at
     a time (layer sensitivity: which blocks to keep in BF16);
  3. continuations: each recipe continued for N steps from the shared checkpoint with S seeds; the validation-loss
     change against BF16 continued with the same seed (same data, paired), mean +- standard error.

    python -m experiments.probes --preset smoke --out runs/probes_smoke     # under a minute
    python -m experiments.probes --preset cpu --out runs/probes_cpu         # ~15 min on 2 CPU cores
    python -m experiments.probes --preset gpu --out runs/probes_gpu         # the paper's 1.2B model (GPU)
    python -m experiments.probes --report-only --out runs/probes_cpu        # redraw tables and plots

The checkpoint is a BF16 run of the preset's model (constant learning rate after warmup, so it stops in the stable
phase, as the paper's ablations resumed mid-run), trained with fp4jax.pretrain.trainer.train into OUT/base and reused when
present; --checkpoint RUN_DIR probes another run instead. Outputs: OUT/results.json, OUT/report.md, OUT/*.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
BASE_DIR = "base"
# The recipe whose components are ablated, and the BF16 reference.
MAIN, REFERENCE = "nvfp4", "bf16"
_VARIANT = re.compile(r"(?P<recipe>[A-Za-z0-9_-]+)(?:\+first(?P<first>\d+))?(?:\+last(?P<last>\d+))?")


@dataclasses.dataclass(frozen=True)
class ProbePreset:
  """What one preset trains, captures and measures.

  model / model_overrides: the fp4jax.pretrain.model preset and field changes. base_*: the BF16 checkpoint's run (constant LR
  after 5% warmup). probe_batches: fixed validation batches (probe_batch_size, default batch_size, x seq_len each)
  concatenated for the probes.
  num_draws: SR draws per layer and recipe (bias curves for K = 1 .. num_draws / 2). bias_draws / bias_layers: more
  draws for the layers whose names match the regex (longer bias curves). layers: regex of the layers probed (None:
  all). recipes: names from fp4jax.analysis.probes.recipe_variants(). model_variants: whole-model settings
  "RECIPE[+firstA][+lastB]" (B blocks at the end / A at the start in BF16). model_draws: SR draws per model
  setting. sensitivity: "only" quantizes one block at a time (the rest BF16), "all_but" keeps one block at a time
  in BF16 (the rest quantized). cont_*: continuation variants, steps
  per continuation and seeds.
  """

  model: str
  model_overrides: tuple[tuple[str, Any], ...] = ()
  base_steps: int = 300
  batch_size: int = 16
  seq_len: int = 64
  lr: float = 1e-2
  eval_batches: int = 4
  probe_batches: int = 2
  probe_batch_size: int | None = None
  num_draws: int = 16
  bias_draws: int = 128
  bias_layers: str | None = None
  layers: str | None = None
  recipes: tuple[str, ...] = ("bf16", "nvfp4", "nvfp4-noRHT", "nvfp4-noSR", "nvfp4-no2D", "mxfp4")
  model_variants: tuple[str, ...] = ("nvfp4", "nvfp4-noRHT", "nvfp4-noSR", "nvfp4-no2D", "mxfp4")
  model_draws: int = 4
  sensitivity: tuple[str, ...] = ("only", "all_but")
  cont_variants: tuple[str, ...] = ("bf16", "nvfp4")
  cont_steps: int = 50
  cont_seeds: int = 3


PRESETS: dict[str, ProbePreset] = {
    # Seconds (mostly compilation): a 1-block tiny model whose linear layers are all 64 x 64 (one compiled probe per
    # recipe), 8 BF16 steps, one batch of 4 x 32 tokens, 8 draws, 2-step continuations with 2 seeds.
    "smoke": ProbePreset(model="tiny", model_overrides=(("n_layers", 1), ("d_ff", 64), ("n_kv_heads", 4)),
                         base_steps=8, batch_size=4, seq_len=32, lr=1e-2, eval_batches=1, probe_batches=1,
                         num_draws=8, bias_draws=8, recipes=("bf16", "nvfp4", "nvfp4-noSR", "mxfp4"),
                         model_variants=("nvfp4",), model_draws=2, cont_variants=("bf16", "nvfp4"), cont_steps=2,
                         cont_seeds=2),
    # ~16 minutes on a shared 2-core CPU (mostly compilation): the sweeps' CPU model (tiny, 4 blocks), 300 BF16 steps
    # of 16 x 64 tokens at lr 1e-2; probes on 2048 tokens with 128 draws (bias curves to K = 64) on every layer;
    # whole-model probes of 3 recipes and of each block kept in BF16; 40-step continuations with 3 seeds.
    "cpu": ProbePreset(model="tiny", model_overrides=(("n_layers", 4),), base_steps=300, batch_size=16, seq_len=64,
                       lr=1e-2, eval_batches=4, probe_batches=2, num_draws=128, bias_draws=128,
                       model_variants=("nvfp4", "nvfp4-noSR", "mxfp4"), model_draws=4, sensitivity=("all_but",),
                       cont_variants=("bf16", "nvfp4", "nvfp4-noSR", "nvfp4+last1"), cont_steps=40, cont_seeds=3),
    # The paper's 1.2B ablation model on a GPU: 4000 BF16 steps of 64 x 4096 tokens; probes on 4 x 4096 tokens
    # (bias sums keep num_draws-level copies of each gradient: memory ~ levels x 16k x 6144 floats).
    "gpu": ProbePreset(model="paper_1b", model_overrides=(("remat", True),), base_steps=4000, batch_size=64,
                       seq_len=4096, lr=3e-4, eval_batches=16, probe_batches=1, probe_batch_size=4, num_draws=16,
                       bias_draws=64, bias_layers=r"blocks\.(0|19)\..*",
                       model_variants=("nvfp4", "nvfp4-noRHT", "nvfp4-noSR", "nvfp4-no2D", "mxfp4", "nvfp4+last2",
                                       "nvfp4+first2+last2"),
                       model_draws=4, cont_variants=("bf16", "nvfp4", "nvfp4-noRHT", "nvfp4-noSR", "nvfp4-no2D",
                                                     "mxfp4", "nvfp4+last2"),
                       cont_steps=200, cont_seeds=3),
}


def get_preset(name: str) -> ProbePreset:
  if name not in PRESETS:
    raise ValueError(f"Unknown preset {name!r}; valid presets: {', '.join(PRESETS)}.")
  return PRESETS[name]


# --- variants -----------------------------------------------------------------------------------------------------

def parse_variant(variant: str) -> tuple[str, int, int]:
  """ "nvfp4+first1+last2" -> ("nvfp4", 1, 2): a recipe from recipe_variants() and its BF16 blocks."""
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  match = _VARIANT.fullmatch(variant)
  if match is None or match.group("recipe") not in probes.recipe_variants():
    raise ValueError(f"Bad variant {variant!r}: expected RECIPE[+firstA][+lastB] with RECIPE one of "
                     f"{list(probes.recipe_variants())}.")
  return match.group("recipe"), int(match.group("first") or 0), int(match.group("last") or 0)


def variant_recipes(variant: str, layer_names: Sequence[str], n_layers: int) -> dict[str, Any]:
  """{layer name: Recipe} for a variant string (see parse_variant)."""
  from fp4jax.pretrain import policy
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  name, first, last = parse_variant(variant)
  pol = policy.PrecisionPolicy(recipe=probes.recipe_variants()[name], first=first, last=last)
  return pol.layer_recipes(list(layer_names), n_layers)


def _blocks_recipes(recipe, bf16_blocks: Sequence[int], layer_names: Sequence[str], n_layers: int):
  from fp4jax.pretrain import policy  # pylint: disable=g-import-not-at-top
  return policy.PrecisionPolicy(recipe=recipe, blocks=tuple(bf16_blocks)).layer_recipes(list(layer_names), n_layers)


# --- checkpoint ---------------------------------------------------------------------------------------------------

def base_config(preset: ProbePreset, out: pathlib.Path):
  """The TrainConfig of the preset's BF16 base run in OUT/base."""
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  model = model_lib.get_model_config(preset.model, **dict(preset.model_overrides))
  return TrainConfig(out=str(out / BASE_DIR), model=model, recipe="bf16", steps=preset.base_steps,
                     batch_size=preset.batch_size, seq_len=preset.seq_len, lr=preset.lr, warmup_fraction=0.05,
                     decay_fraction=0.0, eval_every=max(preset.base_steps // 4, 1), eval_batches=preset.eval_batches,
                     checkpoint_every=preset.base_steps, keep_checkpoints=1, progress=False, seed=0)


def ensure_base(preset: ProbePreset, out: pathlib.Path, *, retrain: bool = False, log=print) -> pathlib.Path:
  """Trains the BF16 base run into OUT/base unless a finished run with the same config is there; returns its folder."""
  from fp4jax.pretrain import checkpoint as ckpt  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  config = base_config(preset, out)
  run_dir = pathlib.Path(config.out)
  stored = run_dir / trainer.CONFIG_FILE
  if stored.exists() and not retrain:
    from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
    free = ("out", "progress")
    want = {k: v for k, v in config.to_dict().items() if k not in free}
    try:  # through TrainConfig, so fields added since the run was stored take their defaults
      have = {k: v for k, v in TrainConfig.from_dict(json.loads(stored.read_text())).to_dict().items() if k not in free}
    except (TypeError, ValueError):
      have = {}
    if want != have:
      changed = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
      raise ValueError(f"{run_dir} holds a base run with other settings ({changed}); pass --retrain-base to "
                       "replace it, or choose another --out.")
    if ckpt.checkpoint_dir(run_dir).is_dir():
      manager = ckpt.open_manager(run_dir, create=False)
      try:
        if config.steps in ckpt.available_steps(manager):
          log(f"Reusing the BF16 base checkpoint in {run_dir} (step {config.steps}).")
          return run_dir
      finally:
        manager.close()
  log(f"Training the BF16 base run into {run_dir} ({config.steps} steps)...")
  t0 = time.perf_counter()
  trainer.train(config.replace(overwrite=run_dir.exists()), log=None)
  log(f"  done in {time.perf_counter() - t0:.0f}s.")
  return run_dir


def restore_run(run_dir: str | pathlib.Path, step: int | None = None):
  """(TrainConfig, model with the restored params, TrainState, step) of a `fp4jax train` run's checkpoint."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import checkpoint as ckpt  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  manager = ckpt.open_manager(run_dir, create=False)
  try:
    step, meta = ckpt.restore_meta(manager, step)
    config = TrainConfig.from_dict(meta["config"])
    model = trainer.build_model(config, trainer.run_keys(config.seed)["init"])
    params = nnx.state(model, nnx.Param)
    target = steps_lib.TrainState(params=params, opt_state=optimizer_lib.make_optimizer(config).init(params),
                              step=jnp.asarray(0, jnp.int32))
    step, restored, _ = ckpt.restore(manager, target._asdict(), step)
  finally:
    manager.close()
  state = steps_lib.TrainState(**restored)
  nnx.update(model, state.params)
  return config, model, state, step


# --- measurements -------------------------------------------------------------------------------------------------

def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return _jsonable(value.tolist())
  if isinstance(value, (np.floating, float)):
    v = float(value)
    return v if math.isfinite(v) else str(v)
  if isinstance(value, np.integer):
    return int(value)
  return value


def probe_batch(dataset, preset: ProbePreset, config) -> dict[str, np.ndarray]:
  """The fixed validation batches of the probes, concatenated along the batch axis."""
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  batches = data.val_batches(dataset, batch_size=preset.probe_batch_size or preset.batch_size,
                             seq_len=config.train_seq_len, num_batches=preset.probe_batches)
  return {k: np.concatenate([b[k] for b in batches]) for k in ("inputs", "targets")}


def run_layer_probes(preset: ProbePreset, model, batch, *, seed: int = 0, log=print) -> dict[str, Any]:
  """{"bf16_loss", "tokens", "layers": {layer: {recipe: probe_layer result}}} on the captured BF16 tensors."""
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  loss, tensors = probes.capture_layer_tensors(model, batch)
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
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  names, n_layers = list(model.linear_layers()), len(model.blocks)
  t0 = time.perf_counter()
  reference = probes.reference_gradient(model, batch)
  key = jax.random.fold_in(jax.random.key(seed), 7)
  done: dict[tuple, dict] = {}

  def probe(recipes):
    signature = tuple(recipes[n] for n in names)
    if signature not in done:
      t1 = time.perf_counter()
      done[signature] = probes.model_probe(model, batch, recipes, key, reference=reference,
                                           num_draws=preset.model_draws)
      log(f"    ({time.perf_counter() - t1:.1f}s)")
    return done[signature]

  out = {"reference_loss": reference.loss, "variants": {}, "only": {}, "all_but": {}, "n_layers": n_layers}
  for variant in preset.model_variants:
    log(f"  model: {variant}")
    out["variants"][variant] = probe(variant_recipes(variant, names, n_layers))
  unknown = set(preset.sensitivity) - {"only", "all_but"}
  if unknown:
    raise ValueError(f"sensitivity entries must be 'only' or 'all_but'; got {sorted(unknown)}.")
  main = probes.recipe_variants()[MAIN]
  if preset.sensitivity and MAIN not in out["variants"]:
    out["variants"][MAIN] = probe(variant_recipes(MAIN, names, n_layers))
  for i in range(n_layers):
    if "only" in preset.sensitivity:
      log(f"  model: only block {i} in {MAIN}")
      out["only"][i] = probe(_blocks_recipes(main, [b for b in range(n_layers) if b != i], names, n_layers))
    if "all_but" in preset.sensitivity:
      log(f"  model: block {i} in BF16, rest {MAIN}")
      out["all_but"][i] = probe(_blocks_recipes(main, [i], names, n_layers))
  log(f"Model probes: {len(done)} settings in {time.perf_counter() - t0:.0f}s.")
  return out


def run_continuations(preset: ProbePreset, config, model, state, dataset, *, log=print) -> dict[str, Any]:
  """Each continuation variant continued `cont_steps` steps from `state` with seeds 1..cont_seeds (paired data)."""
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import steps as steps_lib  # pylint: disable=g-import-not-at-top
  names, n_layers = list(model.linear_layers()), len(model.blocks)
  start = int(state.step)
  cont_config = config.replace(steps=start + preset.cont_steps, warmup_fraction=0.0, decay_fraction=0.0)
  optimizer = optimizer_lib.make_optimizer(cont_config)  # constant LR: the base run's stable phase
  val = data.val_batches(dataset, batch_size=config.batch_size, seq_len=config.train_seq_len,
                         num_batches=config.eval_batches)
  cache = steps_lib.CompileCache()
  runs: dict[str, dict[int, dict]] = {}
  t0 = time.perf_counter()
  for seed in range(1, preset.cont_seeds + 1):
    for variant in preset.cont_variants:
      t1 = time.perf_counter()
      result = probes.continue_training(model, state, variant_recipes(variant, names, n_layers), optimizer=optimizer,
                                        dataset=dataset, batch_size=config.batch_size, seq_len=config.train_seq_len,
                                        steps=preset.cont_steps, seed=seed, val_batches=val, cache=cache)
      result.pop("state")
      runs.setdefault(variant, {})[seed] = result
      log(f"  continue {variant} seed {seed}: val {result['val_own']:.4f} (BF16 forward {result['val_bf16']:.4f}) "
          f"in {time.perf_counter() - t1:.1f}s")
  bf16_graphdef = nnx_graphdef(model)
  eval_fn = cache.get(("probe_eval", bf16_graphdef), lambda: jax.jit(steps_lib.make_eval_step(bf16_graphdef)))
  start_val = float(np.mean([float(eval_fn(state.params, b, None)) for b in val]))
  log(f"Continuations: {time.perf_counter() - t0:.0f}s.")
  return {"start_step": start, "steps": preset.cont_steps, "seeds": list(range(1, preset.cont_seeds + 1)),
          "start_val": start_val, "runs": runs}


def nnx_graphdef(model):
  """The graphdef of `model` with every linear layer in BF16."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax import recipes  # pylint: disable=g-import-not-at-top
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  return nnx.graphdef(probes.with_recipes(model, recipes.bf16()))


# --- summaries ----------------------------------------------------------------------------------------------------

def _mean_se(values) -> tuple[float, float]:
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  v = np.asarray(values, np.float64)
  return float(np.mean(v)), probes.standard_error(v)


def _fmt(mean: float, se: float | None = None, digits: int = 4, signed: bool = False) -> str:
  if mean is None or (isinstance(mean, float) and math.isnan(mean)):
    return "-"
  sign = "+" if signed else ""
  text = f"{mean:{sign}.{digits}f}"
  if se is not None and not math.isnan(se):
    text += f" ± {se:.{digits}f}"
  return text


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _layer_value(res: Mapping[str, Any], metric: str) -> float:
  """A per-layer scalar: per-draw arrays are averaged over draws."""
  return float(np.mean(res[metric]))


def _top_bias(res: Mapping[str, Any], gemm: str, ref: str) -> tuple[int, float, float]:
  curve = res["bias"][gemm][ref]
  return curve["K"][-1], curve["mean"][-1], curve["se"][-1]


def paired_effect(layers: Mapping[str, Mapping], a: str, b: str, value) -> dict[str, Any]:
  """value(layer result of b) - value(layer result of a) over the layers probed with both: mean, SE, sign counts."""
  diffs = [value(res[b]) - value(res[a]) for res in layers.values() if a in res and b in res]
  if not diffs:
    return {"n": 0}
  mean, se = _mean_se(diffs)
  return {"n": len(diffs), "mean": mean, "se": se, "positive": int(np.sum(np.asarray(diffs) > 0)),
          "a": float(np.mean([value(res[a]) for res in layers.values() if a in res and b in res])),
          "b": float(np.mean([value(res[b]) for res in layers.values() if a in res and b in res]))}


def component_effects(results: Mapping[str, Any]) -> list[dict[str, Any]]:
  """The requested comparisons as rows: what, metric, baseline value, variant value, effect (variant - baseline)."""
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
  layers = results["layers"]["layers"]
  rows = []

  def add(what, metric, a, b, value, note=""):
    eff = paired_effect(layers, a, b, value)
    if eff["n"]:
      rows.append({"what": what, "metric": metric, "a": a, "b": b, **eff, "note": note})

  add("RHT on -> off", "Wgrad rel. error vs BF16", MAIN, "nvfp4-noRHT", lambda r: _layer_value(r, "wgrad_err"))
  add("RHT on -> off", "Wgrad cosine vs BF16", MAIN, "nvfp4-noRHT", lambda r: _layer_value(r, "wgrad_cos"))
  add("RHT on -> off", "Wgrad bias floor vs exact-gradient ref. (noise removed)", MAIN, "nvfp4-noRHT",
      lambda r: probes.bias_floor(r["bias"]["wgrad"]["exact_grad"]))
  add("RHT on -> off", "Wgrad bias floor vs BF16 (noise removed)", MAIN, "nvfp4-noRHT",
      lambda r: probes.bias_floor(r["bias"]["wgrad"]["bf16"]))
  for gemm in ("dgrad", "wgrad"):
    add("SR on -> off", f"{gemm.capitalize()} bias vs exact-gradient ref. (K = max)", MAIN, "nvfp4-noSR",
        lambda r, g=gemm: _top_bias(r, g, "exact_grad")[1])
    add("SR on -> off", f"{gemm.capitalize()} bias floor (noise removed)", MAIN, "nvfp4-noSR",
        lambda r, g=gemm: probes.bias_floor(r["bias"][g]["exact_grad"]))
    add("SR on -> off", f"{gemm.capitalize()} single-draw rel. error vs BF16", MAIN, "nvfp4-noSR",
        lambda r, g=gemm: _layer_value(r, f"{g}_err"))
  add("2D -> 1D weights", "chain-rule gap: Dgrad W vs Fprop W", MAIN, "nvfp4-no2D", lambda r: r["chain_dgrad"])
  add("2D -> 1D weights", "Dgrad bias vs quantized forward's gradient (K = max)", MAIN, "nvfp4-no2D",
      lambda r: _top_bias(r, "dgrad", "chain")[1])
  add("2D -> 1D weights", "Fprop rel. error vs BF16", MAIN, "nvfp4-no2D", lambda r: r["fprop_err"])
  for gemm in ("fprop", "dgrad", "wgrad"):
    add("NVFP4 -> MXFP4", f"{gemm.capitalize()} rel. error vs BF16", MAIN, "mxfp4",
        lambda r, g=gemm: _layer_value(r, f"{g}_err"))
  return rows


def _significance(mean: float, se: float) -> str:
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
    row = {"val_own": _mean_se(own), "val_bf16": _mean_se([by_seed[s]["val_bf16"] for s in seeds]),
           "seeds": len(seeds)}
    if ref is not None and variant != REFERENCE:
      row["delta_own"] = _mean_se([by_seed[s]["val_own"] - ref[s]["val_own"] for s in seeds if s in ref])
      row["delta_bf16"] = _mean_se([by_seed[s]["val_bf16"] - ref[s]["val_bf16"] for s in seeds if s in ref])
    out[variant] = row
  return out


def write_report(out: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes OUT/report.md and the PNG plots from OUT/results.json; returns the written paths."""
  out = pathlib.Path(out)
  results = json.loads((out / RESULTS_FILE).read_text())
  written = [write_markdown(results, out / REPORT_FILE), plot_layer_errors(results, out / "layer_errors.png"),
             plot_bias(results, out / "bias_vs_k.png")]
  if results.get("model", {}).get("only") or results.get("model", {}).get("all_but"):
    written.append(plot_sensitivity(results, out / "sensitivity.png"))
  if results.get("continuation"):
    written.append(plot_continuation(results, out / "continuation.png"))
  return written


def write_markdown(results: Mapping[str, Any], path: pathlib.Path) -> pathlib.Path:
  """The Markdown tables of a results.json."""
  from fp4jax.analysis import probes  # pylint: disable=g-import-not-at-top
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
  for e in component_effects(results):
    rows.append([e["what"], e["metric"], _fmt(e["a"]), _fmt(e["b"]), _fmt(e["mean"], e["se"], signed=True),
                 f"{e['positive']}/{e['n']}", _significance(e["mean"], e["se"])])
  lines += [_table(["change", "metric", "baseline", "variant", "effect", "k/n", "z"], rows), ""]

  # 2. Recipe summary.
  lines += ["## Per recipe, mean over layers (± SE across layers)", ""]
  rows = []
  for r in recipes:
    res = [layers[n][r] for n in layers if r in layers[n]]
    cell = lambda f: _fmt(*_mean_se([f(x) for x in res]))
    rows.append([r, cell(lambda x: x["fprop_err"]), cell(lambda x: _layer_value(x, "dgrad_err")),
                 cell(lambda x: _layer_value(x, "wgrad_err")), cell(lambda x: _layer_value(x, "dgrad_cos")),
                 cell(lambda x: _layer_value(x, "wgrad_cos")), cell(lambda x: x["chain_dgrad"]),
                 cell(lambda x: x["chain_wgrad"]), cell(lambda x: x["weight_mismatch"])])
  lines += [_table(["recipe", "Fprop err", "Dgrad err", "Wgrad err", "Dgrad cos", "Wgrad cos", "chain gap Dgrad",
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
        rows.append([r, gemm, ref] + [_fmt(m, s, 4) for m, s in zip(means, ses)]
                    + ["-" if math.isnan(slope) else f"{slope:+.2f}", _fmt(floor)])
  lines += [f"Layers: {', '.join(bias_names)}.", "",
            _table(["recipe", "GEMM", "reference"] + [f"K={k}" for k in ks] + ["slope", "floor"], rows), ""]

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
  lines += [_table(["recipe", "operand", "zero", "sat", "amax (median)", "scale lo", "scale hi", "octaves",
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
      rows.append([name, _fmt(v["dloss"], v["dloss_se"], signed=True), _fmt(*_mean_se(v["grad_err"])),
                   _fmt(*_mean_se(v["grad_cos"])), _fmt(v["grad_bias"])])
    lines += [_table(["variant", "dloss", "grad err", "grad cos", "mean-of-draws err"], rows), ""]
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
          row += [_fmt(only[str(i)]["dloss"], only[str(i)]["dloss_se"], signed=True),
                  _fmt(*_mean_se(only[str(i)]["grad_err"]))]
      if all_but:
        header += ["recovered dloss", "block i BF16: grad err"]
        for i, row in enumerate(rows):
          row += [_fmt(*recovered_dloss(mp, i), signed=True), _fmt(*_mean_se(all_but[str(i)]["grad_err"]))]
      lines += [_table(header, rows), ""]
      ranking = sensitivity_ranking(mp) if n > 1 else [0]
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
    for name, d in continuation_deltas(cont).items():
      rows.append([name, _fmt(*d["val_own"]), _fmt(*d.get("delta_own", (float("nan"), None)), signed=True),
                   _fmt(*d.get("delta_bf16", (float("nan"), None)), signed=True), d["seeds"]])
    lines += [_table(["variant", "val loss (own fwd)", "delta (own fwd)", "delta (BF16 fwd)", "seeds"], rows), ""]

  # 7. Per layer detail.
  lines += ["## Per layer", ""]
  rows = []
  for n, by_recipe in layers.items():
    for r, x in by_recipe.items():
      rows.append([n, r, _fmt(x["fprop_err"]), _fmt(_layer_value(x, "dgrad_err")), _fmt(_layer_value(x, "wgrad_err")),
                   _fmt(x["chain_dgrad"]), _fmt(_top_bias(x, "dgrad", "exact_grad")[1]),
                   _fmt(_top_bias(x, "wgrad", "exact_grad")[1])])
  lines += [_table(["layer", "recipe", "Fprop err", "Dgrad err", "Wgrad err", "chain gap", "Dgrad bias (K max)",
                    "Wgrad bias (K max)"], rows), ""]
  path.write_text("\n".join(lines))
  return path


def recovered_dloss(mp: Mapping[str, Any], block: int) -> tuple[float, float]:
  """dloss(all quantized) - dloss(block in BF16): mean and SE over the probe sequences (paired)."""
  diff = np.asarray(mp["variants"][MAIN]["seq_dloss"], np.float64) - np.asarray(
      mp["all_but"][str(block)]["seq_dloss"], np.float64)
  return _mean_se(diff)


def sensitivity_ranking(mp: Mapping[str, Any]) -> list[int]:
  """Blocks, most sensitive first: by the loss recovered when each alone is kept in BF16 ("all_but"), else by the
  loss change when each alone is quantized ("only")."""
  n = mp["n_layers"]
  if mp.get("all_but"):
    return sorted(range(n), key=lambda i: -recovered_dloss(mp, i)[0])
  return sorted(range(n), key=lambda i: -mp["only"][str(i)]["dloss"])


# --- plots --------------------------------------------------------------------------------------------------------

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
      values = [_layer_value(layers[n][r], f"{gemm}_err") for n in names]
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
    recovered = [recovered_dloss(mp, i) for i in range(n)]
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
  deltas = {k: v for k, v in continuation_deltas(results["continuation"]).items() if "delta_own" in v}
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


# --- main ---------------------------------------------------------------------------------------------------------

def run(preset_name: str, out: str | pathlib.Path, *, checkpoint: str | None = None, retrain_base: bool = False,
        skip_continuations: bool = False, log=print) -> dict[str, Any]:
  """Runs every probe of `preset_name`, writes OUT/results.json, OUT/report.md and plots; returns the results."""
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  preset = get_preset(preset_name)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  run_dir = pathlib.Path(checkpoint) if checkpoint else ensure_base(preset, out, retrain=retrain_base, log=log)
  config, model, state, step = restore_run(run_dir)
  dataset = data.load_dataset(config.data)
  batch = probe_batch(dataset, preset, config)
  results = {"preset": preset_name, "checkpoint": str(run_dir), "step": step,
             "model_name": f"{preset.model} {dict(preset.model_overrides)}",
             "preset_settings": dataclasses.asdict(preset)}
  results["layers"] = run_layer_probes(preset, model, batch, log=log)
  results["model"] = run_model_probes(preset, model, batch, log=log)
  if not skip_continuations and preset.cont_variants:
    results["continuation"] = run_continuations(preset, config, model, state, dataset, log=log)
  results["seconds"] = time.perf_counter() - t0
  (out / RESULTS_FILE).write_text(json.dumps(_jsonable(results)))
  paths = write_report(out)
  log(f"Done in {results['seconds']:.0f}s: {', '.join(str(p) for p in paths)}")
  return results


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.probes", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
  parser.add_argument("--out", required=True, help="output folder (the BF16 base run goes to OUT/base)")
  parser.add_argument("--checkpoint", default=None, help="probe this `fp4jax train` run folder instead of OUT/base")
  parser.add_argument("--retrain-base", action="store_true", help="replace OUT/base even if it holds another run")
  parser.add_argument("--skip-continuations", action="store_true", help="only the fixed-tensor probes")
  parser.add_argument("--report-only", action="store_true", help="redraw report.md and plots from OUT/results.json")
  args = parser.parse_args(argv)
  from fp4jax.pretrain import distributed  # pylint: disable=g-import-not-at-top
  distributed.init_distributed()  # before any JAX use; a no-op without the FP4JAX_* variables
  try:
    if args.report_only:
      for p in write_report(args.out):
        print(p)
      return 0
    run(args.preset, args.out, checkpoint=args.checkpoint, retrain_base=args.retrain_base,
        skip_continuations=args.skip_continuations, log=lambda s: print(s, flush=True))
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
