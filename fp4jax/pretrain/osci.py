"""OsciReset as a training option: its config group, the statistics it carries, and its per-step update.

TetraJet-v2 (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training, olmo2-training/olmo/quantization_real/
calibrate.py and oscillation_reset.py) runs, after each optimizer step i >= start, a cycle of `every` steps:
  i % every == 0                 snapshot: remember the master weights, zero the distances;
  1 <= i % every <= window       track: add |Q(w_i) - Q(w_{i-1})| and |w_i - w_{i-1}| per element;
  i % every == window + 1        reset: elements with ratio >= threshold take their quantized value Q(w_i);
  otherwise                      nothing.
A cycle runs only if its snapshot step is >= start. Q is the Fprop weight operand of the layer's recipe in the
current precision phase (fp4jax.osci_reset.quantized_weight); layers kept in BF16 have Q(w) = w, so their ratio
is 1 and they are never reset. The optimizer state is not touched. With OutControl, once its channels are selected,
Q is the recipe's operand of the other rows (the outlier rows zeroed, as the forward quantizes them) and the outlier
rows, which run in MXFP8, are never reset: as the authors' code, which tracks and resets the FP4 channels only.

The statistics (last weights, both distances: three float32 copies of every tracked kernel) are part of the train
state (`TrainState.osci`), so they are sharded like the kernels, saved in checkpoints and restored on resume; the
schedule is a function of the step counter inside the compiled step (lax.switch), so it adds no host sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp4jax import osci_reset
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain.options import option
from fp4jax.pretrain.sharding import path_str

NONE, SNAPSHOT, TRACK, RESET = 0, 1, 2, 3
KINDS = ("none", "snapshot", "track", "reset")


@dataclasses.dataclass(frozen=True)
class OsciResetConfig:
  """TetraJet-v2's OsciReset (defaults: the paper's runs, period 200, window 50, threshold 8); off unless `start`."""

  start: int | None = option(None, "OsciReset (TetraJet-v2): first step a cycle may start at; None = off",
                             flag="osci_reset_start")
  every: int = option(200, "OsciReset cycle length in steps: snapshot, window, reset", flag="osci_reset_every")
  window: int = option(50, "steps whose weight movements form the oscillation ratio", flag="osci_reset_window")
  threshold: float = option(8.0, "reset elements with sum|dQ(w)| / sum|dw| >= this", flag="osci_reset_threshold")

  def __post_init__(self):
    for name in ("every", "window"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"OsciResetConfig: {name} must be an int >= 1; got {value!r}.")
    if self.start is not None and (not isinstance(self.start, int) or isinstance(self.start, bool)
                                   or self.start < 0):
      raise ValueError(f"OsciResetConfig: start must be None (off) or an int >= 0; got {self.start!r}.")
    if self.window + 2 > self.every:
      raise ValueError(f"OsciResetConfig: window + 2 must be <= every (snapshot, {self.window} tracked steps and "
                       f"the reset fit in one cycle); got window={self.window}, every={self.every}.")
    if not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool) or not self.threshold > 0:
      raise ValueError(f"OsciResetConfig: threshold must be a number > 0; got {self.threshold!r}.")

  @property
  def enabled(self) -> bool:
    """Whether OsciReset runs (a start step is set)."""
    return self.start is not None

  @property
  def first_reset_step(self) -> int | None:
    """The first step whose update resets weights: the first cycle starts at the first multiple of `every` that is
    >= start, and resets `window` + 1 steps later (None when off)."""
    if not self.enabled:
      return None
    return -(-self.start // self.every) * self.every + self.window + 1


class OsciState(NamedTuple):
  """Per tracked kernel (nested dicts shaped like the params, e.g. ["blocks"]["0"]["attn"]["q"]["kernel"]): the
  master weight after the previous step, and the summed |dQ(w)| and |dw| of the current window."""

  prev: Any
  dist_q: Any
  dist_w: Any


def kind(step: int, config: OsciResetConfig) -> str:
  """What the update does after step `step` ("none", "snapshot", "track", "reset"): the host-side schedule."""
  if not config.enabled:
    return "none"
  phase = step % config.every
  if step - phase < config.start:
    return "none"
  if phase == 0:
    return "snapshot"
  if phase <= config.window:
    return "track"
  return "reset" if phase == config.window + 1 else "none"


def _branch(step: jax.Array, config: OsciResetConfig) -> jax.Array:
  """`kind` for a traced step counter, as a lax.switch index."""
  phase = step % config.every
  b = jnp.where(phase == 0, SNAPSHOT, jnp.where(phase <= config.window, TRACK,
                                                jnp.where(phase == config.window + 1, RESET, NONE)))
  return jnp.where(step - phase >= config.start, b, NONE).astype(jnp.int32)


def tracked_layers(layer_names: Sequence[str], bf16_layers: Sequence[str]) -> tuple[str, ...]:
  """The layers OsciReset keeps statistics for: all linear layers except those the policy always keeps in BF16."""
  skip = set(bf16_layers)
  return tuple(name for name in layer_names if name not in skip)


def _kernels(params, layers: Sequence[str]) -> dict[str, jax.Array]:
  """{layer: kernel array} from an nnx.State of params."""
  wanted = {f"{name}.kernel": name for name in layers}
  found = {wanted[path_str(p)]: leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
           if path_str(p) in wanted}
  missing = [name for name in layers if name not in found]
  if missing:
    raise ValueError(f"OsciReset: no kernel in the params for layer(s) {missing[:3]}.")
  return found


def _nest(flat: Mapping[str, jax.Array]) -> dict:
  out: dict = {}
  for name, value in flat.items():
    node = out
    *parents, last = f"{name}.kernel".split(".")
    for part in parents:
      node = node.setdefault(part, {})
    node[last] = value
  return out


def _flat(nested, layers: Sequence[str]) -> dict[str, jax.Array]:
  flat = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(nested)[0]}
  return {name: flat[f"{name}.kernel"] for name in layers}


def init_state(params, layers: Sequence[str]) -> OsciState:
  """Zero statistics for `layers` (the first snapshot overwrites them before any use).

  Each field gets arrays of its own: the train step donates its state, and a buffer may be donated only once."""
  kernels = _kernels(params, layers)
  zeros = lambda: _nest({name: jnp.zeros(k.shape, jnp.float32) for name, k in kernels.items()})
  return OsciState(zeros(), zeros(), zeros())


def initial_state(config, params) -> OsciState | None:
  """Zero statistics for the tracked layers of `config` (a TrainConfig), or None when its OsciReset is off."""
  if not config.osci_reset.enabled:
    return None
  names = model_lib.layer_names(config.model)
  return init_state(params, tracked_layers(names, config.policy.bf16_layers(names, config.model.n_layers)))


def layers_of(state: OsciState) -> tuple[str, ...]:
  """The tracked layer names of `state`."""
  return tuple(path_str(p)[:-len(".kernel")] for p, _ in jax.tree_util.tree_flatten_with_path(state.prev)[0])


def update(params, state: OsciState, step: jax.Array, recipes: Mapping[str, Any], config: OsciResetConfig,
           outlier_idx: Mapping[str, jax.Array] | None = None, outliers_selected: jax.Array | bool = True
           ) -> tuple[Any, OsciState, jax.Array]:
  """(params, state, number of elements reset) after optimizer step `step` (params: the updated weights).

  `recipes` maps each tracked layer to its recipe in the current phase. `outlier_idx` maps layers to OutControl's
  outlier channels (int [k], rows of the [K, N] kernel) that the next forward runs in MXFP8, where
  `outliers_selected` (before that they are placeholders): Q is then the recipe's operand of the other rows, as the
  forward quantizes it, and those rows are never reset. Pure; runs under jit and sharding.
  """
  layers = layers_of(state)
  w = _kernels(params, layers)
  prev, dist_q, dist_w = (_flat(t, layers) for t in state)
  for name in layers:
    osci_reset.check_recipe(recipes[name])
  outliers = {n: jnp.zeros((w[n].shape[0],), bool).at[i].set(True) & outliers_selected
              for n, i in (outlier_idx or {}).items() if n in w}
  quant = lambda name, x: osci_reset.quantized_weight(x, recipes[name], outliers.get(name))
  zero = jnp.zeros((), jnp.int32)

  def nothing():
    return w, prev, dist_q, dist_w, zero

  def snapshot():
    zeros = {n: jnp.zeros_like(dist_q[n]) for n in layers}
    return w, {n: w[n].astype(jnp.float32) for n in layers}, zeros, zeros, zero

  def track():
    dq, dw = {}, {}
    for n in layers:
      dq[n], dw[n] = osci_reset.track(dist_q[n], dist_w[n], w[n], prev[n], quant(n, w[n]), quant(n, prev[n]))
    return w, {n: w[n].astype(jnp.float32) for n in layers}, dq, dw, zero

  def reset():
    new_w, count = {}, zero
    for n in layers:
      new_w[n], mask = osci_reset.reset(w[n], quant(n, w[n]), dist_q[n], dist_w[n], config.threshold,
                                        outliers.get(n))
      count = count + jnp.sum(mask, dtype=jnp.int32)
    return new_w, prev, dist_q, dist_w, count

  new_w, prev, dist_q, dist_w, count = jax.lax.switch(_branch(step, config), (nothing, snapshot, track, reset))
  by_path = {f"{n}.kernel": new_w[n] for n in layers}
  params = jax.tree_util.tree_map_with_path(lambda p, x: by_path.get(path_str(p), x), params)
  return params, OsciState(_nest(prev), _nest(dist_q), _nest(dist_w)), count
