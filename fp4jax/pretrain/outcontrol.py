"""OutControl as a training option: its config group, the calibration statistics it carries, and its schedule.

TetraJet-v2 (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training, olmo2-training/olmo/quantization_real/
calibrate.py and linear_mix.py) calibrates once: from step `start`, for `window` steps, every quantized linear layer
adds the L2 norm of each of its input channels (over the step's tokens) to a running sum; after the last of those
steps each layer fixes its k = ceil(fraction * K) channels with the largest sums, which run in MXFP8 in all three
GEMMs from then on (fp4jax.outcontrol). Before that every channel runs in the layer's recipe. The norms are taken
over the whole global batch (the authors sum per-GPU norms, which depends on the device count; here a mesh gives
the same selection as one device).

The schedule has three static phases, each its own compiled step: "off" (step < start), "record" (the window) and
"on" (after). The statistics and the indices (`TrainState.outcontrol`) are part of the train state: replicated
(they are [K] vectors), saved in checkpoints and restored on resume, so resuming mid-calibration is exact.
Layers the policy always keeps in BF16 are not tracked; a layer in BF16 after the late switch ignores its indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp4jax import outcontrol as outcontrol_lib
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain.options import option
from fp4jax.pretrain.sharding import path_str

PHASES = ("off", "record", "on")


@dataclasses.dataclass(frozen=True)
class OutControlConfig:
  """TetraJet-v2's OutControl; off unless `fraction` > 0."""

  fraction: float = option(0.0, "OutControl (TetraJet-v2): fraction of each quantized layer's input channels, those "
                           "with the largest activation norms, run in MXFP8; 0 = off", flag="outcontrol_fraction")
  start: int = option(0, "OutControl: first step whose activations enter the channel norms", flag="outcontrol_start")
  window: int = option(20, "OutControl: steps of norm recording; the top channels run in MXFP8 after them",
                       flag="outcontrol_window")

  def __post_init__(self):
    outcontrol_lib.check_fraction(self.fraction)  # a fraction that selects all of a layer's channels: tracked_layers
    if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
      raise ValueError(f"OutControlConfig: start must be an int >= 0; got {self.start!r}.")
    if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
      raise ValueError(f"OutControlConfig: window must be an int >= 1; got {self.window!r}.")

  @property
  def enabled(self) -> bool:
    """Whether OutControl runs (a fraction above 0)."""
    return self.fraction > 0

  @property
  def select_step(self) -> int:
    """The last recorded step: the channels are selected in its update, and run in MXFP8 from the next step."""
    return self.start + self.window - 1


class OutControlState(NamedTuple):
  """Per tracked layer (nested dicts, e.g. ["blocks"]["0"]["attn"]["q"]["norms"]): the summed channel norms [K]
  (float32) and the selected outlier channels [k] (int32, largest first; zeros until selected)."""

  norms: Any
  idx: Any


def phase(step: int, config: OutControlConfig) -> str:
  """"off", "record" or "on": what the compiled step for `step` does (a host-side, static choice)."""
  if not config.enabled or step < config.start:
    return "off"
  return "record" if step <= config.select_step else "on"


def tracked_layers(train_config) -> dict[str, tuple[int, int]]:
  """{layer: (K input features, k outlier channels)} for the layers OutControl splits: all linear layers except
  those the policy always keeps in BF16."""
  cfg = train_config.outcontrol
  names = model_lib.layer_names(train_config.model)
  skip = set(train_config.policy.bf16_layers(names, train_config.model.n_layers))
  shapes = train_config.model.linear_shapes
  out = {}
  for name in names:
    if name in skip:
      continue
    k_features = shapes[name.split(".", 2)[2]][0]
    out[name] = (k_features, outcontrol_lib.outlier_count(k_features, cfg.fraction))
  return out


def _nest(flat: Mapping[str, jax.Array], leaf: str) -> dict:
  out: dict = {}
  for name, value in flat.items():
    node = out
    for part in name.split("."):
      node = node.setdefault(part, {})
    node[leaf] = value
  return out


def flat(nested) -> dict[str, jax.Array]:
  """{layer name: array} from one of OutControlState's nested trees."""
  return {path_str(p).rsplit(".", 1)[0]: leaf for p, leaf in jax.tree_util.tree_flatten_with_path(nested)[0]}


def initial_state(train_config) -> OutControlState | None:
  """Zero norms and placeholder indices for the tracked layers of a TrainConfig, or None when OutControl is off."""
  if not train_config.outcontrol.enabled:
    return None
  layers = tracked_layers(train_config)
  if not layers:
    raise ValueError("OutControl is on but the policy keeps every linear layer in BF16: nothing to split.")
  norms = {n: jnp.zeros((kf,), jnp.float32) for n, (kf, _) in layers.items()}
  idx = {n: jnp.zeros((k,), jnp.int32) for n, (_, k) in layers.items()}
  return OutControlState(_nest(norms, "norms"), _nest(idx, "idx"))


def update(state: OutControlState, sq_norms: Mapping[str, jax.Array], step: jax.Array,
           config: OutControlConfig) -> OutControlState:
  """The state after a "record" step: each layer's channel norms (sqrt of `sq_norms`, the summed x^2 per channel of
  this step's inputs) added in, to zero on the first recorded step (as the authors' calibrate.py: a run resumed
  with another --outcontrol-start sums its new window only); on the last recorded step the top-k channels
  selected. Pure; runs under jit."""
  norms, idx = flat(state.norms), flat(state.idx)
  missing = sorted(set(norms) - set(sq_norms))
  if missing:
    raise ValueError(f"OutControl: no recorded inputs for layer(s) {missing[:3]}.")
  first = step == config.start
  new_norms = {n: jnp.where(first, 0.0, norms[n]) + jnp.sqrt(sq_norms[n].astype(jnp.float32)) for n in norms}
  last = step == config.select_step
  new_idx = {n: jnp.where(last, outcontrol_lib.select_channels(new_norms[n], idx[n].shape[0]), idx[n])
             for n in idx}
  return OutControlState(_nest(new_norms, "norms"), _nest(new_idx, "idx"))


def next_outliers(state: OutControlState | None, step: jax.Array, oc_phase: str, config: OutControlConfig
                  ) -> tuple[dict[str, jax.Array] | None, jax.Array | bool]:
  """({layer: int [k]} outlier channels, whether they are selected) for the forward after step `step`, whose
  update left `state`: selected in the "on" phase and after the last recorded step (a traced bool in the "record"
  phase), placeholders before; (None, False) in the "off" phase."""
  if oc_phase == "off" or state is None:
    return None, False
  return flat(state.idx), True if oc_phase == "on" else step == config.select_step
