"""fp4jax.quantize_model: quantize the linear layers of a Flax model you did not write, picked by module path.

Rules are an ordered list of (regex, recipe) pairs; a layer's path ("blocks.0.attn.query", dots between names, as
`--bf16-pattern` writes them) is matched with `re.fullmatch` against each rule in turn and the first match wins. A
recipe of None or "bf16" (any unquantized recipe) leaves the layer's own computation untouched, so an early
("head", None) rule keeps the head in high precision whatever later rules say. Layers are NNX Linear,
LinearGeneral and linear-layer Einsum, or Linen Dense and DenseGeneral; stochastic-rounding keys come from a
"quant" RNG stream, fresh on every call. This module is Flax-free: the Flax parts load on first use.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, NamedTuple

from fp4jax import recipes as recipes_lib


@dataclasses.dataclass(frozen=True)
class Rule:
  """One rule: layers whose path fully matches `pattern` run `recipe` (None: left alone)."""

  pattern: str
  recipe: recipes_lib.Recipe | None

  @property
  def quantizes(self) -> bool:
    """Whether the rule's recipe quantizes (None and BF16 rules leave a layer alone)."""
    return self.recipe is not None and self.recipe.is_quantized


def compile_rules(rules) -> tuple[Rule, ...]:
  """Validates `rules` (an ordered sequence of (regex, recipe-or-name-or-None) pairs) into Rules."""
  if isinstance(rules, (str, bytes)) or not hasattr(rules, "__iter__"):
    if isinstance(rules, str):
      raise ValueError(f"rules must be a list of (regex, recipe) pairs; got the string {rules!r}. For every layer: "
                       f"[('.*', {rules!r})].")
    raise ValueError(f"rules must be a list of (regex, recipe) pairs (for every layer: [('.*', recipe)]); got "
                     f"{type(rules).__name__} {str(rules)[:80]!r}.")
  if isinstance(rules, dict):  # iterating it would give bare patterns: "rule 0 ... got '.*'"
    raise ValueError("rules must be a list of (regex, recipe) pairs; got a dict: pass list(rules.items()) (first "
                     "match wins, in that order).")
  out = []
  for i, rule in enumerate(rules):
    if isinstance(rule, Rule):
      out.append(rule)
      continue
    if isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], re.Pattern):
      # Rules keep the pattern string (reports print it); taking .pattern would drop the compiled flags.
      raise ValueError(f"rule {i}: pass the regex as a string, not a compiled re.Pattern: {rule[0].pattern!r} "
                       f"(flags inline, e.g. '(?i)attn.*').")
    if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"rule {i} must be a (regex, recipe) pair; got {rule!r}.")
    pattern, recipe = rule
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"rule {i}: {pattern!r} is not a valid regex: {e}.") from e
    try:
      recipe = None if recipe is None else recipes_lib.get_recipe(recipe)
    except (ValueError, TypeError) as e:
      raise ValueError(f"rule {i} ({pattern!r}): {e}") from e
    out.append(Rule(pattern, recipe))
  return tuple(out)


def first_match(rules: tuple[Rule, ...], path: str) -> int | None:
  """Index of the first rule whose pattern fully matches `path`, or None."""
  for i, rule in enumerate(rules):
    if re.fullmatch(rule.pattern, path):
      return i
  return None


def path_name(parts) -> str:
  """A layer's path as the rules match it: its parts joined by dots ("blocks.0.attn.q")."""
  return ".".join(str(p) for p in parts)


def shown(path: str) -> str:
  """A layer path for messages: the model itself (a layer quantized on its own) has the empty path."""
  return path or "(the model itself)"


class Layer(NamedTuple):
  path: str
  kind: str  # the layer's class name
  rule: int | None  # index of the first matching rule
  # fp4jax's own layers (nn.Linear, linen.Dense): the recipe they run by themselves, which no rule changes
  own: recipes_lib.Recipe | None = None


@dataclasses.dataclass(frozen=True)
class Report:
  """Which linear layers matched which rule, and which rules matched none. `print(report)` shows a table."""

  rules: tuple[Rule, ...]
  layers: tuple[Layer, ...]

  def recipe_of(self, path: str) -> recipes_lib.Recipe | None:
    """The recipe a layer runs (None: its own, unquantized computation)."""
    for layer in self.layers:
      if layer.path == path:
        return _recipe(self.rules, layer)
    raise KeyError(f"no linear layer at {path!r}; layers: {[layer.path for layer in self.layers]}")

  @property
  def quantized(self) -> dict[str, str]:
    """{layer path: recipe name} of the layers that run quantized GEMMs (fp4jax's own layers by their recipe)."""
    return {l.path: _recipe(self.rules, l).name for l in self.layers if _recipe(self.rules, l) is not None}

  @property
  def unmatched_layers(self) -> tuple[str, ...]:
    """Paths of the flax layers no rule matched (they run their own computation)."""
    return tuple(l.path for l in self.layers if l.rule is None and l.own is None)

  @property
  def unused_rules(self) -> tuple[str, ...]:
    """Patterns of the rules no layer matched first (a typo, or shadowed by an earlier rule)."""
    used = {l.rule for l in self.layers}
    return tuple(r.pattern for i, r in enumerate(self.rules) if i not in used)

  def __str__(self):
    width = max([len(shown(l.path)) for l in self.layers] + [5])
    lines = [f"quantize_model: {len(self.quantized)} of {len(self.layers)} linear layers quantized"]
    for l in self.layers:
      rule = self.rules[l.rule] if l.rule is not None else None
      what = ("no rule: left alone" if rule is None else
              f"rule {l.rule} '{rule.pattern}': " + (rule.recipe.name if rule.quantizes else "left alone"))
      if l.own is not None:  # a rule cannot change it (a quantizing one is refused)
        what = f"its own recipe: {l.own.name}" + ("" if rule is None else f" (rule {l.rule} '{rule.pattern}' "
                                                                          "does not change it)")
      lines.append(f"  {shown(l.path):<{width}}  {l.kind:<14} {what}")
    unused = self.unused_rules
    quoted = ", ".join(f"'{p}'" for p in unused)
    lines.append(f"rules that matched no layer: {quoted}" if unused else
                 "every rule matched a layer")
    return "\n".join(lines)


def _recipe(rules, layer: Layer) -> recipes_lib.Recipe | None:
  """The quantized recipe `layer` runs, or None (its own, unquantized computation)."""
  if layer.own is not None:
    return layer.own if layer.own.is_quantized else None
  return rules[layer.rule].recipe if layer.rule is not None and rules[layer.rule].quantizes else None


def _linen_quantized_model() -> type:
  from fp4jax import linen as fp4jax_linen  # pylint: disable=g-import-not-at-top
  return fp4jax_linen.QuantizedModel


def quantize_model(model: Any, rules, **kwargs):
  """Quantizes the linear layers of a Flax model by ordered (regex, recipe) rules on their paths.

  NNX (`flax.nnx.Module`): edits `model` in place and returns a Report; pass `rngs=nnx.Rngs(quant=seed)` when a
  recipe uses stochastic rounding (each quantized layer forks its own stream and draws a fresh key per call).
  Linen (`flax.linen.Module`): returns a `fp4jax.linen.QuantizedModel` whose `init` / `apply` replace the model's;
  keys come from `apply(..., rngs={"quant": key})`; its `.report` lists the layers traced so far.
  See fp4jax.nn.quantize_model and fp4jax.linen.quantize_model.
  """
  linen = sys.modules.get("flax.linen")
  if linen is not None and isinstance(model, linen.Module):
    from fp4jax import linen as fp4jax_linen  # pylint: disable=g-import-not-at-top
    return fp4jax_linen.quantize_model(model, rules, **kwargs)
  nnx = sys.modules.get("flax.nnx")
  if nnx is not None and isinstance(model, nnx.Module):
    from fp4jax import nn as fp4jax_nn  # pylint: disable=g-import-not-at-top
    return fp4jax_nn.quantize_model(model, rules, **kwargs)
  if linen is not None and isinstance(model, _linen_quantized_model()):  # the result of an earlier call
    raise ValueError("quantize_model expects a flax.linen.Module; got a QuantizedModel, the result of an earlier "
                     "call: pass its model, quantize_model(qmodel.module, rules) (the new rules replace the old).")
  raise ValueError(f"quantize_model expects a flax.nnx.Module or flax.linen.Module; got {type(model).__name__}.")
