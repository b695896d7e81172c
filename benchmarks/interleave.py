"""Interleaved timing: the runs being compared take turns block by block, and ratios pair each block's timings.

A drift of the machine's speed during a benchmark (clocks, heat, other load) then hits all runs alike. No JAX here:
`benchmarks/gpu/model.py` imports it before the GPU section has set up JAX.
"""

from __future__ import annotations

from typing import Hashable, Sequence


def block_orders(names: Sequence[Hashable], n_blocks: int, offset: int = 0) -> list[list]:
  """The order of the runs in each timed block: every run in every block, rotated by one from block to block (and
  by `offset`, e.g. the `repeat` process's number) so that no run always goes first."""
  n = len(names)
  return [[names[(b + offset + j) % n] for j in range(n)] for b in range(n_blocks)]


def paired_ratios(block_s: dict, base) -> dict:
  """Each run's block timings over the baseline's of the same block (timed one after the other, so that a drift
  of the machine's speed moves both)."""
  return {name: [t / b for t, b in zip(times, block_s[base])] for name, times in block_s.items()}
