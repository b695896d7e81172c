"""Config fields that know their command-line option: help text, flag name, and whether they change a run's result.

A config group (OptimizerConfig, PrecisionPolicy, ...) declares its fields with `option(...)`; TrainConfig and the
CLI read the metadata, so each fact (the flag `--bf16-last` sets PrecisionPolicy.last; `--progress` does not change
what a run computes) is written once, on the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_MISSING = dataclasses.MISSING


def option(default=_MISSING, help: str = "", *,  # pylint: disable=redefined-builtin
           flag: str | None = None, result_free: bool = False, factory=_MISSING, help_default: bool = True) -> Any:
  """A dataclass field with a help text, its flat option name (`flag`, default: the field name) and
  `result_free`: True for fields that may change without changing what the run computes (out, cadences, ...).
  `help_default=False`: the option's help does not show the default (an option the CLI requires)."""
  metadata = {"help": help, "flag": flag, "result_free": result_free, "help_default": help_default}
  if factory is not _MISSING:
    return dataclasses.field(default_factory=factory, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def flat_key(f: dataclasses.Field) -> str:
  """The option's flat name, as argparse dest and sweep override key: "bf16_last", "checkpoint_every", "lr"."""
  return f.metadata.get("flag") or f.name


def is_result_free(f: dataclasses.Field) -> bool:
  """Whether the option leaves training's results unchanged (paths, logging, progress), so a resume may change it."""
  return bool(f.metadata.get("result_free"))


def default_of(f: dataclasses.Field):
  """The field's default (a fresh one from its factory), or dataclasses.MISSING."""
  if f.default is not _MISSING:
    return f.default
  if f.default_factory is not _MISSING:
    return f.default_factory()
  return _MISSING
