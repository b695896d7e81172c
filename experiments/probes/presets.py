"""Presets of `python -m experiments.probes` and the whole-model variants they name ("nvfp4+last1")."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from fp4jax.analysis import probes
from fp4jax.pretrain import policy

# The recipe whose components are ablated, and the BF16 reference.
MAIN, REFERENCE = "nvfp4", "bf16"
_VARIANT = re.compile(r"(?P<recipe>[A-Za-z0-9_-]+)(?:\+first(?P<first>\d+))?(?:\+last(?P<last>\d+))?")


@dataclasses.dataclass(frozen=True)
class ProbePreset:
  """What one preset trains, captures and measures.

  model / model_overrides: the fp4jax.pretrain.model preset and field changes. base_*: the BF16 checkpoint's run
  (constant LR after 5% warmup). probe_batches: fixed validation batches (probe_batch_size, default batch_size,
  x seq_len each) concatenated for the probes.
  num_draws: SR draws per layer and recipe (bias curves for K = 1 .. num_draws / 2). bias_draws / bias_layers: more
  draws for the layers whose names match the regex (longer bias curves). layers: regex of the layers probed (None:
  all). recipes: names from fp4jax.analysis.probes.recipe_variants(). model_variants: whole-model settings
  "RECIPE[+firstA][+lastB]" (B blocks at the end / A at the start in BF16). model_draws: SR draws per model
  setting. sensitivity: "only" quantizes one block at a time (the rest BF16), "all_but" keeps one block at a time
  in BF16 (the rest quantized). cont_*: continuation variants, steps per continuation and seeds.
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
    "gpu": ProbePreset(model="paper_1b", model_overrides=(("remat", True), ("scan_layers", True)), base_steps=4000,
                       batch_size=64, seq_len=4096, lr=3e-4, eval_batches=16, probe_batches=1, probe_batch_size=4,
                       num_draws=16, bias_draws=64, bias_layers=r"blocks\.(0|19)\..*",
                       model_variants=("nvfp4", "nvfp4-noRHT", "nvfp4-noSR", "nvfp4-no2D", "mxfp4", "nvfp4+last2",
                                       "nvfp4+first2+last2"),
                       model_draws=4, cont_variants=("bf16", "nvfp4", "nvfp4-noRHT", "nvfp4-noSR", "nvfp4-no2D",
                                                     "mxfp4", "nvfp4+last2"),
                       cont_steps=200, cont_seeds=3),
}


def get_preset(name: str) -> ProbePreset:
  """The preset called `name` (ValueError naming the valid ones otherwise)."""
  if name not in PRESETS:
    raise ValueError(f"Unknown preset {name!r}; valid presets: {', '.join(PRESETS)}.")
  return PRESETS[name]


# --- variants -----------------------------------------------------------------------------------------------------

def parse_variant(variant: str) -> tuple[str, int, int]:
  """ "nvfp4+first1+last2" -> ("nvfp4", 1, 2): a recipe from recipe_variants() and its BF16 blocks."""
  match = _VARIANT.fullmatch(variant)
  if match is None or match.group("recipe") not in probes.recipe_variants():
    raise ValueError(f"Bad variant {variant!r}: expected RECIPE[+firstA][+lastB] with RECIPE one of "
                     f"{list(probes.recipe_variants())}.")
  return match.group("recipe"), int(match.group("first") or 0), int(match.group("last") or 0)


def variant_recipes(variant: str, layer_names: Sequence[str], n_layers: int) -> dict[str, Any]:
  """{layer name: Recipe} for a variant string (see parse_variant)."""
  name, first, last = parse_variant(variant)
  pol = policy.PrecisionPolicy(recipe=probes.recipe_variants()[name], first=first, last=last)
  return pol.layer_recipes(list(layer_names), n_layers)


def blocks_recipes(recipe, bf16_blocks: Sequence[int], layer_names: Sequence[str], n_layers: int) -> dict[str, Any]:
  """{layer name: Recipe}: `recipe` everywhere except the blocks `bf16_blocks`, which run BF16."""
  return policy.PrecisionPolicy(recipe=recipe, blocks=tuple(bf16_blocks)).layer_recipes(list(layer_names), n_layers)
