"""Precision policy: which linear layers run quantized, which stay BF16, and a late switch to BF16.

The paper keeps ~15% of linear layers in BF16, mostly at the end of the network (12B: the first 2 and last 8 of 62
blocks; at 1.2B all-NVFP4 diverged, last 4 blocks in BF16 stabilised it, first 4 alone did not, first 2 + last 2
worked). Switching to BF16 late in training closes most of the remaining loss gap: forward+backward at 82% of the
run matched FP8; forward only recovered most of it; backward only gave nothing.

A policy is a pure description; `layer_recipes` turns it into a recipe per layer name for a given step, and `apply`
writes those onto a model's `fp4jax.nn.Linear` layers. Recipes are static (part of the jitted graph), so a trainer
recompiles once per `phase`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

import fp4jax.recipes
from fp4jax import cli_values
from fp4jax import formats
from fp4jax.pretrain.options import option

SWITCH_MODES = ("forward", "all")
_BLOCK_OF = re.compile(r"blocks\.(\d+)\.")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """Per-layer precision and an optional late switch to BF16.

  recipe: the quantized recipe; a string form ("nvfp4:stochastic_rounding=false") is parsed once, here.
  first / last: the first / last this many transformer blocks run in BF16.
  blocks: further block indices run in BF16.
  pattern: a regex fully matching layer names ("blocks\\.(0|1)\\..*", ".*mlp\\.down") that run in BF16.
  switch_at: when the rest of the model leaves `recipe`: a fraction of the run in (0, 1) or an absolute step (int).
  switch: "all" -> fully BF16 after the switch; "forward" -> only Fprop in BF16 (Dgrad/Wgrad stay quantized).
  """

  recipe: fp4jax.recipes.Recipe = option(
      help="recipe preset with options, e.g. nvfp4, bf16, mxfp4, fp8, 'nvfp4:rht_size=4,stochastic_rounding=false'",
      factory=fp4jax.recipes.nvfp4)
  first: int = option(0, "first N transformer blocks in BF16", flag="bf16_first")
  last: int = option(0, "last N transformer blocks in BF16", flag="bf16_last")
  blocks: tuple[int, ...] = option((), "more BF16 blocks, e.g. 3,5-7", flag="bf16_blocks")
  pattern: str | None = option(None, "regex fully matching linear-layer names kept in BF16, e.g. '.*mlp\\.down'",
                               flag="bf16_pattern")
  switch_at: float | int | None = option(None, "switch to BF16 at this fraction of the run (0.82) or step (820)")
  switch: str = option("all", "what switches: all | forward")

  def __post_init__(self):
    if isinstance(self.recipe, str):
      object.__setattr__(self, "recipe", parse_recipe(self.recipe))
    if not isinstance(self.recipe, fp4jax.recipes.Recipe):
      raise ValueError(f"PrecisionPolicy.recipe must be a Recipe or a recipe string; got {self.recipe!r}.")
    for field in ("first", "last"):
      value = getattr(self, field)
      if not _is_int(value) or value < 0:
        raise ValueError(f"PrecisionPolicy.{field} must be an int >= 0; got {value!r}.")
    if isinstance(self.blocks, (str, bytes)) or not isinstance(self.blocks, Iterable):
      raise ValueError(f"PrecisionPolicy.blocks must be a sequence of block indices; got {self.blocks!r}.")
    blocks = tuple(self.blocks)
    if any(not _is_int(b) or b < 0 for b in blocks):
      raise ValueError(f"PrecisionPolicy.blocks must hold ints >= 0; got {self.blocks!r}.")
    object.__setattr__(self, "blocks", tuple(sorted(set(blocks))))
    if self.pattern is not None:
      if not isinstance(self.pattern, str) or not self.pattern:
        raise ValueError(f"PrecisionPolicy.pattern must be a non-empty regex string or None; got {self.pattern!r}.")
      try:
        re.compile(self.pattern)
      except re.error as e:
        raise ValueError(f"PrecisionPolicy.pattern {self.pattern!r} is not a valid regex: {e}.") from e
    s = self.switch_at
    if s is not None:
      if isinstance(s, float):
        if not 0.0 < s < 1.0:
          step = (f" For step {int(s)}, write the int {int(s)}." if s >= 1 and math.isfinite(s) and s == int(s)
                  else "")
          raise ValueError(f"PrecisionPolicy.switch_at as a fraction must lie in (0, 1); got {s!r}.{step}")
      elif not _is_int(s) or s < 0:
        raise ValueError(f"PrecisionPolicy.switch_at must be None, a float in (0, 1) or an int step >= 0; got {s!r}.")
    if self.switch not in SWITCH_MODES:
      raise ValueError(f"PrecisionPolicy.switch must be one of {SWITCH_MODES}; got {self.switch!r}.")
    if self.switch != "all" and s is None:
      raise ValueError(f"PrecisionPolicy.switch={self.switch!r} says what switches, but there is no switch: set "
                       "switch_at (--switch-at) too.")

  def switch_step(self, total_steps: int | None = None) -> int | None:
    """The first step that runs switched, or None without a switch. A fraction needs `total_steps`: the step is
    round(switch_at * total_steps), Python's round (halves to even: 0.5 of 5 steps is step 2, of 7 steps step 4),
    as the optimizer's warmup and decay lengths."""
    if self.switch_at is None:
      return None
    if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
      raise ValueError(f"total_steps must be an int >= 1; got {total_steps!r}.")
    if isinstance(self.switch_at, float):
      if total_steps is None:
        raise ValueError(f"switch_at={self.switch_at} is a fraction of the run: total_steps is required.")
      step = round(self.switch_at * total_steps)
      if step == 0:  # a fraction means a late switch; step 0 would silently make the whole run BF16
        raise ValueError(f"switch_at={self.switch_at} of a {total_steps}-step run rounds to step 0, which would run "
                         "all of it switched; pass a larger fraction, an int step, or the BF16 recipe itself.")
    else:
      step = self.switch_at
    if total_steps is not None and step >= total_steps:
      raise ValueError(f"switch_at={self.switch_at} gives step {step}, which a {total_steps}-step run never reaches.")
    return step

  def phase(self, step: int, total_steps: int | None = None) -> int:
    """0 before the switch, 1 from the switch step on (always 0 without a switch)."""
    switch = self.switch_step(total_steps)
    return int(switch is not None and step >= switch)

  def bf16_blocks(self, n_layers: int) -> tuple[int, ...]:
    """Block indices that always run in BF16 (first, last and listed)."""
    if not _is_int(n_layers) or n_layers < 1:
      raise ValueError(f"n_layers must be an int >= 1; got {n_layers!r}.")
    for field in ("first", "last"):
      if getattr(self, field) > n_layers:
        raise ValueError(f"PrecisionPolicy.{field}={getattr(self, field)} exceeds the model's {n_layers} blocks.")
    bad = [b for b in self.blocks if b >= n_layers]
    if bad:
      shown = bad if len(bad) <= 8 else f"[{', '.join(map(str, bad[:4]))}, ..., {bad[-1]}] ({len(bad)} indices)"
      raise ValueError(f"PrecisionPolicy.blocks {shown} out of range for a model with {n_layers} blocks.")
    chosen = set(range(self.first)) | set(range(n_layers - self.last, n_layers)) | set(self.blocks)
    return tuple(sorted(chosen))

  def bf16_layers(self, layer_names: Sequence[str], n_layers: int) -> tuple[str, ...]:
    """Layer names that always run in BF16: in a BF16 block, or fully matched by `pattern`."""
    layer_names = list(layer_names)
    blocks = set(self.bf16_blocks(n_layers))
    matched = set()
    if self.pattern is not None:
      matched = {name for name in layer_names if re.fullmatch(self.pattern, name)}
      if not matched:
        raise ValueError(f"PrecisionPolicy.pattern {self.pattern!r} matches none of the layers "
                         f"({', '.join(layer_names[:4])}, ...); it must match whole names.")
    chosen = []
    for name in layer_names:
      block = _BLOCK_OF.match(name)
      if name in matched or (block is not None and int(block.group(1)) in blocks):
        chosen.append(name)
    return tuple(chosen)

  def quantized_layers(self, layer_names: Sequence[str], n_layers: int) -> tuple[str, ...]:
    """Layer names that run the policy's quantized recipe (before any late switch): none when the recipe is BF16,
    else all but `bf16_layers`."""
    if not self.recipe.is_quantized:
      return ()
    bf16 = set(self.bf16_layers(layer_names, n_layers))
    return tuple(name for name in layer_names if name not in bf16)

  def layer_recipes(self, layer_names: Sequence[str], n_layers: int, step: int = 0,
                    total_steps: int | None = None) -> dict[str, fp4jax.recipes.Recipe]:
    """The recipe of each layer at `step`: BF16 for the selected layers, the (possibly switched) recipe elsewhere."""
    bf16 = fp4jax.recipes.bf16()
    recipe = self.recipe
    if self.phase(step, total_steps):
      recipe = recipe.with_bf16(forward=True, backward=False) if self.switch == "forward" else bf16
    selected = set(self.bf16_layers(layer_names, n_layers))
    return {name: bf16 if name in selected else recipe for name in layer_names}

  def apply(self, model, step: int = 0, total_steps: int | None = None) -> dict[str, fp4jax.recipes.Recipe]:
    """Sets `.recipe` on each of `model.linear_layers()` for `step`; returns the recipes set. Call outside jit."""
    layers = model.linear_layers()
    recipes = self.layer_recipes(list(layers), len(model.blocks), step, total_steps)
    for name, layer in layers.items():
      layer.recipe = recipes[name]
    return recipes

  def describe(self, n_layers: int, layer_names: Sequence[str] | None = None, total_steps: int | None = None) -> str:
    """Readable summary: the BF16 blocks (and layers, given names), the recipe table and the switch (with the step a
    fraction resolves to, given `total_steps`)."""
    blocks = self.bf16_blocks(n_layers)
    lines = [f"Precision policy: recipe {self._recipe_label()}",
             f"BF16 blocks: {list(blocks) if blocks else 'none'} ({len(blocks)} of {n_layers} blocks"
             f" = {100 * len(blocks) / n_layers:.0f}%)"]
    if self.pattern is not None:
      lines.append(f"BF16 pattern: {self.pattern!r}")
    if layer_names is not None:
      names = self.bf16_layers(layer_names, n_layers)
      lines.append(f"BF16 linear layers: {len(names)} of {len(layer_names)} "
                   f"({100 * len(names) / max(len(layer_names), 1):.0f}%)")
    if self.switch_at is None:
      lines.append("Switch: none")
    else:
      # As given (.6g): a rounded percentage could disagree with the step it resolves to (0.825 -> "82%", step 165).
      when = (f"{self.switch_at * 100:.6g}% of the run" if isinstance(self.switch_at, float)
              else f"step {self.switch_at}")
      if isinstance(self.switch_at, float) and total_steps is not None:
        when += f" (step {self.switch_step(total_steps)} of {total_steps})"
      what = "forward (Fprop) to BF16" if self.switch == "forward" else "all GEMMs to BF16"
      # Accepted rather than refused (a sweep may set one switch across recipes), but said: nothing changes.
      idle = "" if self.recipe.is_quantized else " (no effect: the recipe is unquantized)"
      lines.append(f"Switch: at {when}, {what}{idle}")
    lines += ["Recipe:", str(self.recipe)]
    return "\n".join(lines)

  def _recipe_label(self) -> str:
    return recipe_spec(self.recipe) or self.recipe.name

  def to_dict(self) -> dict:
    """JSON-ready form (for checkpoint metadata); `from_dict` inverts it."""
    return {"recipe": recipe_to_json(self.recipe), "first": self.first, "last": self.last,
            "blocks": list(self.blocks), "pattern": self.pattern, "switch_at": self.switch_at,
            "switch": self.switch}

  @classmethod
  def from_dict(cls, data: dict) -> PrecisionPolicy:
    """Inverse of `to_dict`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
      raise ValueError(f"Unknown PrecisionPolicy field(s) {unknown}; valid fields: {sorted(fields)}.")
    data = dict(data)
    if "blocks" in data:
      data["blocks"] = tuple(data["blocks"])
    if "recipe" in data:
      data["recipe"] = recipe_from_json(data["recipe"])
    return cls(**data)


# --- the recipe boundary: strings become Recipes here, once; a Recipe goes back to its canonical string ---------

# Canonical spec of each recipe parsed so far (Recipes are frozen and hashable). Equal recipes share one spec.
_SPECS: dict[fp4jax.recipes.Recipe, str] = {}


def canonical_spec(spec: str) -> str:
  """ "NVFP4: stochastic_rounding=false , rht_size=4" -> "nvfp4:rht_size=4,stochastic_rounding=false"."""
  name, _, args = spec.partition(":")
  items = sorted("=".join(p.strip() for p in a.split("=", 1)) for a in args.split(",") if a.strip())
  return name.strip().lower() + (":" + ",".join(items) if items else "")


def parse_recipe(spec: str) -> fp4jax.recipes.Recipe:
  """The Recipe of a CLI recipe string (fp4jax.recipes.get_recipe); remembers its canonical string."""
  recipe = fp4jax.recipes.get_recipe(spec)
  _SPECS.setdefault(recipe, canonical_spec(spec))
  return recipe


def recipe_spec(recipe: fp4jax.recipes.Recipe) -> str | None:
  """The canonical string `recipe` was parsed from, a preset's name, or None for a hand-built recipe."""
  if recipe in _SPECS:
    return _SPECS[recipe]
  for name, preset in fp4jax.recipes.PRESETS.items():
    if preset() == recipe:
      return name
  return None


# Types a stored hand-built recipe may contain; recipes are trees of these frozen dataclasses over plain values.
_RECIPE_TYPES = {t.__name__: t for t in (fp4jax.recipes.Recipe, fp4jax.recipes.GemmConfig,
                                         fp4jax.recipes.OperandConfig, formats.NVFP4, formats.MXFP4, formats.FP8)}


def recipe_to_json(recipe: fp4jax.recipes.Recipe):
  """The recipe's canonical string, or (hand-built recipes) its fields as tagged dicts."""
  spec = recipe_spec(recipe)
  return spec if spec is not None else _tree_to_json(recipe)


def recipe_from_json(value) -> fp4jax.recipes.Recipe:
  """Inverse of `recipe_to_json`: a string is parsed (once), a tagged dict rebuilt."""
  return parse_recipe(value) if isinstance(value, str) else _tree_from_json(value)


def _tree_to_json(value):
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    if type(value).__name__ not in _RECIPE_TYPES:
      raise ValueError(f"Cannot store a {type(value).__name__} inside a recipe.")
    out = {"__type__": type(value).__name__}
    out.update({f.name: _tree_to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init})
    return out
  if isinstance(value, tuple):
    return [_tree_to_json(v) for v in value]
  if value is None or isinstance(value, (str, int, float, bool)):
    return value
  raise ValueError(f"Cannot store {value!r} ({type(value).__name__}) inside a recipe.")


def _tree_from_json(value):
  if isinstance(value, dict):
    kind = value.get("__type__")
    if kind not in _RECIPE_TYPES:
      raise ValueError(f"Stored recipe has unknown type {kind!r}; expected one of {sorted(_RECIPE_TYPES)}.")
    fields = {k: _tree_from_json(v) for k, v in value.items() if k != "__type__"}
    if kind == "Recipe":
      # Recipes stored before `sr_bits` existed drew their SR bits with threefry: resume them with the same bits.
      fields.setdefault("sr_bits", "threefry")
    return _RECIPE_TYPES[kind](**fields)
  if isinstance(value, list):
    return tuple(_tree_from_json(v) for v in value)
  return value


def policy_from_strings(recipe: str, first=0, last=0, blocks="", pattern=None, switch_at=None,
                        switch="all") -> PrecisionPolicy:
  """A policy from CLI-style strings: --bf16-first 2 --bf16-last 2 --bf16-blocks 3,5-7 --bf16-pattern REGEX
  --switch-at 0.82 --switch forward."""
  return PrecisionPolicy(recipe=recipe, first=cli_values.parse_int(first), last=cli_values.parse_int(last),
                         blocks=cli_values.parse_int_list(blocks or ""), pattern=pattern or None,
                         switch_at=cli_values.parse_number(switch_at), switch=switch)
