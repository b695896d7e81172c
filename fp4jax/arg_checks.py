"""Checks of plain Python arguments shared by the quantizer, the RHT and the recipes.

A ValueError names the argument and the value given. No JAX: recipes import it too.
"""

from __future__ import annotations

import numpy as np


def flag(name: str, value) -> bool:
  """`value` as a plain bool (NumPy's too: a recipe's name and its stored JSON take plain ones); ValueError else."""
  # A string such as "false" is truthy: taken as a flag it would switch the option on.
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False; got {value!r}.")
  return bool(value)


def axis_index(axis, ndim: int) -> int:
  """`axis` of an array of rank `ndim` as a non-negative int; ValueError for a non-int (bools too) or out of range."""
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise ValueError(f"axis must be an int; got {axis!r}.")
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}.")
  return int(axis) % ndim
