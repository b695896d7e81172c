"""Everything the probes take from the training harness: the BF16 base run, restoring a checkpoint, continuations.

This is the one file of experiments.probes that uses fp4jax.pretrain's TrainConfig, trainer and checkpoints.
A continuation continues a restored train state under per-layer recipes for a few steps with a constant learning
rate (the base run's stable phase), the way the paper's ablations resume a run mid-training.

A restored checkpoint's data is the corpus it recorded, at its absolute path, and is refused when its content or
tokenizer changed since (as `fp4jax eval` refuses it): the probes measure the run on its own data.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from fp4jax import recipes as recipes_lib
from fp4jax.analysis import model_probes
from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import data
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import resume as resume_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig

from experiments.probes.presets import ProbePreset

BASE_DIR = "base"


# --- the BF16 base run --------------------------------------------------------------------------------------------

def base_config(preset: ProbePreset, out: pathlib.Path) -> TrainConfig:
  """The TrainConfig of the preset's BF16 base run in OUT/base."""
  model = model_lib.get_model_config(preset.model, **dict(preset.model_overrides))
  return TrainConfig.from_options(
      out=str(out / BASE_DIR), model=model, recipe="bf16", steps=preset.base_steps, batch_size=preset.batch_size,
      seq_len=preset.seq_len, lr=preset.lr, warmup_fraction=0.05, decay_fraction=0.0,
      eval_every=max(preset.base_steps // 4, 1), eval_batches=preset.eval_batches,
      checkpoint_every=preset.base_steps, keep_checkpoints=1, progress=False, seed=0)


def ensure_base(preset: ProbePreset, out: pathlib.Path, *, retrain: bool = False, log=print) -> pathlib.Path:
  """Trains the BF16 base run into OUT/base unless a finished run with the same config is there; returns its folder."""
  config = base_config(preset, out)
  run_dir = pathlib.Path(config.out)
  if ckpt.checkpoint_dir(run_dir).is_dir() and not retrain:
    manager = ckpt.open_manager(run_dir, create=False)
    try:  # each checkpoint stores the config it was saved under
      steps = ckpt.available_steps(manager)
      stored = ckpt.restore_meta(manager)[1]["config"] if steps else None
    finally:
      manager.close()
    if stored is not None:
      changed = config_lib.result_differences(stored, config.to_dict())
      if changed:
        raise ValueError(f"{run_dir} holds a base run with other settings ({changed}); pass --retrain-base to "
                         "replace it, or choose another --out.")
      if config.steps in steps:
        log(f"Reusing the BF16 base checkpoint in {run_dir} (step {config.steps}).")
        return run_dir
  log(f"Training the BF16 base run into {run_dir} ({config.steps} steps)...")
  t0 = time.perf_counter()
  trainer.train(config.replace(overwrite=run_dir.exists()), log=None)
  log(f"  done in {time.perf_counter() - t0:.0f}s.")
  return run_dir


def restore_run(run_dir: str | pathlib.Path, step: int | None = None, *, log=print):
  """(TrainConfig, model with the restored params, TrainState, step, dataset) of a fp4jax training run's checkpoint.

  The dataset is the corpus the checkpoint recorded, at its absolute path (a relative --data.corpus means what it
  meant when the run trained, wherever this runs), refused like `fp4jax eval` refuses it when its content or
  tokenizer changed since; the returned config names that corpus.
  """
  manager = ckpt.open_manager(run_dir, create=False)
  try:
    step, meta = ckpt.restore_meta(manager, step)
    config, dataset = recorded_data(meta, step, log=log)  # before the restore: a refused corpus costs nothing
    model = trainer.build_model(config, trainer.run_keys(config.seed)["init"])
    params = nnx.state(model, nnx.Param)
    target = trainer.initial_state(config, params, optimizer_lib.make_optimizer(config.optimizer, config.steps).init)
    step, restored, _ = ckpt.restore(manager, target._asdict(), step)
  finally:
    manager.close()
  state = steps_lib.TrainState(**restored)
  nnx.update(model, state.params)
  return config, model, state, step, dataset


def recorded_data(meta: dict[str, Any], step: int, *, log=print) -> tuple[TrainConfig, data.TokenDataset]:
  """(the stored config with the recorded corpus, its dataset) of checkpoint `step` with metadata `meta`."""
  config = TrainConfig.from_dict(meta["config"])
  stored_corpus = config.data.corpus
  corpus = resume_lib.recorded_corpus(meta, step, None)  # the probes take no --corpus
  if corpus is not None:
    config = config.replace(**{"data.corpus": corpus})
  dataset = data.load_dataset(config.data)
  note = resume_lib.eval_data_note(meta.get("data"), dataset.identity, step, False, stored_corpus, corpus_flag=None)
  if note:
    log(note)
  return config, dataset


_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "mlp")


def model_name(preset_model: str, preset_overrides, config: TrainConfig, checkpoint, *, log=print) -> str:
  """What the report names as the probed model: the preset's when it trained the base run, else the checkpoint's
  own shapes (a note is logged when that run was not trained in BF16, as the probes assume)."""
  if not checkpoint:
    return f"{preset_model} {dict(preset_overrides)}"
  recipe = config.policy.recipe
  if recipe.is_quantized:
    log(f"Note: {checkpoint} was trained with recipe {recipe.name!r}, not BF16; the probes quantize its BF16 "
        "weights and activations as if it had been.")
  shapes = {f: getattr(config.model, f) for f in _SHAPE_FIELDS}
  return f"{checkpoint} {shapes}"


def probe_batch(dataset, preset: ProbePreset, config: TrainConfig) -> dict[str, np.ndarray]:
  """The fixed validation batches of the probes, concatenated along the batch axis."""
  batches = data.val_batches(dataset, batch_size=preset.probe_batch_size or preset.batch_size,
                             seq_len=config.train_seq_len, num_batches=preset.probe_batches)
  return {k: np.concatenate([b[k] for b in batches]) for k in ("inputs", "targets")}


# --- continuations ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Continuation:
  """What every continuation from one checkpoint shares: data, validation batches, optimizer, compiled steps."""

  dataset: Any
  batch_size: int
  seq_len: int
  val_batches: list[dict[str, np.ndarray]]
  optimizer: Any
  cache: steps_lib.CompileCache


def continuation(config: TrainConfig, dataset, *, start_step: int, steps: int) -> Continuation:
  """Continuations of the run `config` from `start_step` for `steps` steps at the base run's constant peak LR."""
  cont_config = config.replace(steps=start_step + steps, warmup_fraction=0.0, decay_fraction=0.0)
  val = data.val_batches(dataset, batch_size=config.batch_size, seq_len=config.train_seq_len,
                         num_batches=config.evaluation.batches)
  return Continuation(dataset=dataset, batch_size=config.batch_size, seq_len=config.train_seq_len, val_batches=val,
                      optimizer=optimizer_lib.make_optimizer(cont_config.optimizer, cont_config.steps), cache=steps_lib.CompileCache())


def validation_loss(cont: Continuation, graphdef, params, key) -> float:
  """Mean loss of the model `graphdef` with `params` over the continuation's validation batches."""
  fn = cont.cache.get(("probe_eval", graphdef), lambda: jax.jit(steps_lib.make_eval_step(graphdef)))
  return float(np.mean([float(fn(params, b, key)) for b in cont.val_batches]))


def bf16_graphdef(model):
  """The graphdef of `model` with every linear layer in BF16."""
  return nnx.graphdef(model_probes.with_recipes(model, recipes_lib.bf16()))


def continue_training(model, state: steps_lib.TrainState, recipes, cont: Continuation, *, steps: int, seed: int
                      ) -> dict[str, Any]:
  """Continues `state` for `steps` AdamW steps with the linear layers running `recipes`; evaluates at the end.

  Batches are data.get_batch(dataset, "train", state.step + i, seed=seed) and the step key is
  fold_in(fold_in(key(seed), 1), step), so two recipes continued with the same seed see the same data (paired).
  Returns {"losses": train losses, "val_bf16": validation loss with a BF16 forward, "val_own": with the recipe's
  own forward, "state": the final TrainState}. Raises trainer.TrainingDiverged on a non-finite step.
  """
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be an int >= 1; got {steps!r}.")
  graphdef = nnx.graphdef(model_probes.with_recipes(model, recipes))
  step_fn = cont.cache.get(("probe_train", graphdef, id(cont.optimizer)),
                           lambda: jax.jit(steps_lib.make_train_step(graphdef, cont.optimizer)))
  step_key = jax.random.fold_in(jax.random.key(seed), 1)
  start = int(state.step)
  losses = []
  for i in range(start, start + steps):
    batch = data.get_batch(cont.dataset, "train", i, batch_size=cont.batch_size, seq_len=cont.seq_len, seed=seed)
    new_state, m = step_fn(state, batch, jax.random.fold_in(step_key, i))
    if not bool(m["finite"]):
      raise trainer.TrainingDiverged(i, float(m["loss"]), float(m["grad_norm"]), None)
    state = new_state
    losses.append(float(m["loss"]))
  eval_key = jax.random.fold_in(jax.random.key(seed), 2)
  return {"losses": losses, "val_bf16": validation_loss(cont, bf16_graphdef(model), state.params, eval_key),
          "val_own": validation_loss(cont, graphdef, state.params, eval_key), "state": state}
