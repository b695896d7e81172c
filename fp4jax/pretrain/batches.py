"""Deterministic batches from a tokenized corpus: random training windows and fixed validation windows.

Batches are a pure function of (seed, split, step), and process p of n takes row block p of the global batch, so a
resumed or multi-process run sees exactly the batches a single uninterrupted run would. fp4jax.pretrain.data loads
the corpus (`load_dataset`) and re-exports these functions (data.get_batch, data.val_batches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from fp4jax.pretrain.data import TokenDataset

SPLITS = {"train": 0, "val": 1}


def _split_tokens(dataset: TokenDataset, split: str) -> np.ndarray:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}.")
  return dataset.train if split == "train" else dataset.val


def _need_ints(**values) -> None:
  # Checked up front: a float seq_len or seed otherwise fails deep in numpy (IndexError, TypeError).
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be an int; got {value!r}.")


def _check_batch_args(tokens, split, batch_size, seq_len, process_index, process_count) -> int:
  """Validates shapes and the process layout; returns rows per process."""
  _need_ints(batch_size=batch_size, seq_len=seq_len, process_index=process_index, process_count=process_count)
  if batch_size < 1 or seq_len < 1:
    raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}.")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"Need 0 <= process_index < process_count, got {process_index} and {process_count}.")
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} must be divisible by process_count={process_count}.")
  if seq_len + 1 > tokens.size:
    raise ValueError(f"seq_len+1={seq_len + 1} tokens per window exceeds the {split} split length {tokens.size}.")
  return batch_size // process_count


def _windows(tokens: np.ndarray, starts_B: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """Gathers seq_len+1 tokens per start; targets are the inputs shifted left by one."""
  idx_BxT1 = starts_B[:, None] + np.arange(seq_len + 1)[None, :]
  w_BxT1 = tokens[idx_BxT1].astype(np.int32)
  return {"inputs": w_BxT1[:, :-1], "targets": w_BxT1[:, 1:]}


def get_batch(
    dataset: TokenDataset,
    split: str,
    step: int,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> dict[str, np.ndarray]:
  """Random windows for one step: int32 inputs/targets [batch_size // process_count, seq_len].

  Window starts for the global batch depend only on (seed, split, step); process p takes rows
  [p * B_local, (p + 1) * B_local), so the processes' slices concatenate to the single-process batch.
  """
  tokens = _split_tokens(dataset, split)
  b_local = _check_batch_args(tokens, split, batch_size, seq_len, process_index, process_count)
  _need_ints(step=step, seed=seed)
  if seed < 0 or step < 0:
    raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}.")
  rng = np.random.default_rng([seed, SPLITS[split], step])
  starts_B = rng.integers(0, tokens.size - seq_len, size=batch_size)
  lo = process_index * b_local
  return _windows(tokens, starts_B[lo: lo + b_local], seq_len)


def val_batches(
    dataset: TokenDataset,
    *,
    batch_size: int,
    seq_len: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
  """Fixed, evenly spaced validation windows (no randomness), so val loss is comparable across runs that share
  batch_size, seq_len and num_batches: the windows are num_batches * batch_size spans of seq_len + 1 tokens, so
  runs that differ in those are scored on other tokens (a batch-size or context-length sweep's val losses are not
  comparable to each other; the training loss at equal tokens is).

  Windows overlap when the val split is shorter than num_batches * batch_size * (seq_len + 1). More windows than
  the split has start positions would score some windows twice (and a large --eval-batches would run for ages
  with nothing to show): a ValueError says how many batches fit.
  """
  _need_ints(num_batches=num_batches)
  if num_batches < 1:
    raise ValueError(f"num_batches must be >= 1, got {num_batches}.")
  tokens = dataset.val
  b_local = _check_batch_args(tokens, "val", batch_size, seq_len, process_index, process_count)
  distinct = tokens.size - seq_len  # start positions of a (seq_len + 1)-token window
  if num_batches * batch_size > distinct:
    fix = (f"use --eval-batches {distinct // batch_size} or fewer" if distinct >= batch_size else
           f"not even one batch fits: use a --batch-size of at most {distinct}, a shorter --seq-len, "
           "--eval-batches 0 (no validation)")
    raise ValueError(f"{num_batches} validation batches (--eval-batches) of {batch_size} windows ask for "
                     f"{num_batches * batch_size} windows, but the validation split ({tokens.size} tokens) has only "
                     f"{distinct} distinct windows of seq_len+1={seq_len + 1} tokens: {fix}, or a larger "
                     "validation split (a larger corpus, or --data.val_fraction when training).")
  starts = np.linspace(0, tokens.size - seq_len - 1, num_batches * batch_size).round().astype(np.int64)
  starts_NxB = starts.reshape(num_batches, batch_size)
  lo = process_index * b_local
  return [_windows(tokens, starts_NxB[i, lo: lo + b_local], seq_len) for i in range(num_batches)]
