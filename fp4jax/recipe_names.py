"""Recipe names, both ways: the name a preset gives itself from its switches ("nvfp4-rht-sr"), and a CLI spec
"name[:key=value,...]" parsed back into a preset name and its keyword arguments (fp4jax.recipes.get_recipe).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any


def ablation_name(name, *, rht_on, rht_size, default_rht_size, stochastic_rounding, weight_2d, signs,
                  random_bits, sr_bits="hash", gemm_mode="auto", extra_tags="") -> str:
  """'nvfp4' for the paper's recipe, with one tag per switched component, e.g. 'nvfp4-rht-sr'."""
  tags = []
  if not rht_on:
    tags.append("-rht")
  else:
    if tuple(rht_on) != ("wgrad",):
      tags.append("-rht@" + "+".join(rht_on))
    if rht_size != default_rht_size:
      tags.append(f"-rht{rht_size}")
    if signs != "fixed":
      tags.append(f"-signs:{signs}")
  if not stochastic_rounding:
    tags.append("-sr")
  else:
    if random_bits != 32:
      tags.append(f"-sr{random_bits}bit")
    if sr_bits != "hash":
      tags.append(f"-{sr_bits}")
  if not weight_2d:
    tags.append("-2d")
  return name + "".join(tags) + extra_tags + gemm_tag(gemm_mode)


def gemm_tag(gemm_mode: str) -> str:
  """The name tag of a non-default GEMM mode ("-gemm:f32"); every preset appends it."""
  return "" if gemm_mode == "auto" else f"-gemm:{gemm_mode}"


def _did_you_mean(word: str, choices) -> str:
  from fp4jax import cli_values  # pylint: disable=g-import-not-at-top
  return cli_values.did_you_mean(word, choices)


def _parse_value(text: str):
  from fp4jax import cli_values  # pylint: disable=g-import-not-at-top
  return cli_values.parse_scalar(text)


def check_random_bits(stochastic: bool, random_bits, flag: str) -> None:
  """random_bits only sets stochastic rounding's bits: with `flag` False it would change nothing, yet name another
  Recipe (one recipe, one name)."""
  if not stochastic and random_bits != 32:
    raise ValueError(f"random_bits={random_bits!r} sets stochastic rounding's bits; with {flag}=False nothing is "
                     "rounded stochastically.")


def parse_spec(spec, presets: Mapping[str, Callable[..., Any]]) -> tuple[str, dict[str, Any]]:
  """(preset name, keyword arguments) of a spec "name[:key=value,...]", checked against the preset's signature.

  Names are case-insensitive; values parse as CLI scalars (fp4jax.cli_values), tuples joined with '+'
  ("rht_on=wgrad+dgrad"); a single `rht_on` string becomes a 1-tuple, and `random_signs=none` is the sign mode.
  """
  name, _, args = str(spec).partition(":")
  name = name.strip().lower()
  if name not in presets:
    raise ValueError(f"Unknown recipe {name!r}{_did_you_mean(name, presets)}; expected one of {list(presets)}.")
  kwargs = {}
  for item in filter(None, (a.strip() for a in args.split(","))):
    key, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"Recipe override {item!r} is not of the form key=value.")
    key = key.strip().lower()  # option names are case-insensitive, as recipe names are
    if key in kwargs:
      raise ValueError(f"Recipe option {key!r} is given twice in {spec!r}.")
    kwargs[key] = _parse_value(value)
  params = inspect.signature(presets[name]).parameters
  valid = list(params)
  unknown = [k for k in kwargs if k not in valid]
  if unknown:
    raise ValueError(f"Unknown option(s) {unknown} for recipe {name!r}{_did_you_mean(unknown[0], valid)}; "
                     f"valid: {valid}.")
  for k, v in kwargs.items():  # "0" / "1" parse as integers; a switch takes them as false / true
    if isinstance(params[k].default, bool) and type(v) is int and v in (0, 1):
      kwargs[k] = bool(v)
  if isinstance(kwargs.get("rht_on"), str):
    kwargs["rht_on"] = (kwargs["rht_on"],)
  if "random_signs" in kwargs and kwargs["random_signs"] is None:  # the sign mode "none" (as names print it)
    kwargs["random_signs"] = "none"
  return name, kwargs
