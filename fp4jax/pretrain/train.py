"""Training loop: AdamW with a warmup-stable-decay schedule, quantized GEMMs per a precision policy, checkpoints.

The step is a pure function of (state, batch, key) with state = TrainState(params, opt_state, step): float32 master
weights and optimizer state, bf16 compute inside the model. The model's structure and its layers' recipes are the
static `graphdef`, so a precision-policy phase switch re-applies the policy, re-splits the model and compiles the
step once more. Batches are a pure function of (seed, step) and the step key is fold_in(run key, step), so a run
resumed from a checkpoint reproduces an uninterrupted one bit for bit, stochastic rounding included.

    python -m fp4jax.pretrain.train --model tiny --recipe nvfp4 --steps 200 --out runs/x     (same as `fp4jax train ...`)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

import fp4jax
import fp4jax.pretrain.checkpoint as ckpt
import fp4jax.pretrain.data
import fp4jax.pretrain.metrics
import fp4jax.pretrain.model
import fp4jax.pretrain.sharding
from fp4jax.pretrain.config import TrainConfig

Hook = Callable[[int, dict[str, Any]], None]
CONFIG_FILE = "config.json"
# Fields that may differ between a run and its resumption without changing what it computes.
_RESUME_FREE_FIELDS = ("out", "mesh", "resume", "resume_step", "overwrite", "progress", "log_every", "checkpoint_every",
                       "keep_checkpoints", "eval_every", "eval_batches", "stats_every", "stats_format")
# Independent streams derived from the run key.
_INIT_STREAM, _STEP_STREAM, _EVAL_STREAM, _STATS_STREAM = 0, 1, 2, 3


class TrainingDiverged(RuntimeError):
  """The loss, gradient norm or parameters became non-finite; the state of that step was discarded."""

  def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None):
    self.step, self.loss, self.grad_norm, self.last_checkpoint = step, loss, grad_norm, last_checkpoint
    kept = (f"the last good checkpoint is step {last_checkpoint}" if last_checkpoint is not None
            else "no checkpoint was saved")
    super().__init__(f"Training diverged at step {step}: loss={loss}, grad_norm={grad_norm} (non-finite). "
                     f"The diverged state was not saved; {kept}. Try a lower --lr, more BF16 layers "
                     "(--bf16-last), or another --recipe.")


class TrainState(NamedTuple):
  """Everything a step updates: float32 params (nnx.State), optax state, and the number of steps taken."""

  params: Any
  opt_state: Any
  step: jax.Array


# --- optimizer ----------------------------------------------------------------------------------------------------

def lr_schedule(config: TrainConfig) -> optax.Schedule:
  """Warmup-stable-decay: linear warmup to `lr`, constant, then linear or 1-sqrt decay to `min_lr_ratio * lr`."""
  peak, total = config.lr, config.steps
  warmup = round(config.warmup_fraction * total)
  decay = round(config.decay_fraction * total)
  decay_start = total - decay
  floor = config.min_lr_ratio

  def schedule(count):
    s = jnp.asarray(count, jnp.float32)
    # (s + 1) / warmup: the first step already moves the weights.
    warm = jnp.minimum(1.0, (s + 1.0) / warmup) if warmup else jnp.float32(1.0)
    if decay:
      # Reaches the floor at step `total` (one past the last update), so the last update still moves the weights.
      frac = jnp.clip((s - decay_start) / decay, 0.0, 1.0)
      shape = frac if config.decay_shape == "linear" else jnp.sqrt(frac)
      tail = floor + (1.0 - floor) * (1.0 - shape)
    else:
      tail = jnp.float32(1.0)
    return peak * warm * tail

  return schedule


def _decay_mask(params):
  """Weight decay on matrices (linear kernels, embeddings), not on norm scales or biases."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (b1, b2, decoupled weight decay on matrices) on the WSD schedule."""
  adamw = optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=_decay_mask)
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw


# --- step functions -----------------------------------------------------------------------------------------------

def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV.astype(jnp.float32), targets_BxT).mean()


def make_loss_fn(graphdef) -> Callable:
  """loss(params, batch, key) for the model described by `graphdef` (its layers' recipes included)."""

  def loss_fn(params, batch, key):
    model = nnx.merge(graphdef, params)
    return cross_entropy(model(batch["inputs"], key=key), batch["targets"])

  return loss_fn


def global_norm(tree) -> jax.Array:
  """sqrt of the sum of squares of all leaves, in float32 (what clip_by_global_norm clips)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_train_step(graphdef, optimizer: optax.GradientTransformation) -> Callable:
  """step(state, batch, key) -> (new_state, metrics): one AdamW update; apply jax.jit (and shardings) yourself.

  metrics: loss (of the params before the update), grad_norm (before clipping), and `finite`: whether loss, grads
  and new params are all finite. The caller must discard new_state when `finite` is false.
  """
  loss_fn = make_loss_fn(graphdef)

  def step(state: TrainState, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, key)
    grad_norm = global_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(params)
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1)
    return new_state, {"loss": loss, "grad_norm": grad_norm, "finite": finite}

  return step


def make_eval_step(graphdef) -> Callable:
  """eval(params, batch, key) -> mean cross-entropy of the batch."""
  return make_loss_fn(graphdef)


# --- setup --------------------------------------------------------------------------------------------------------

def run_keys(seed: int) -> dict[str, jax.Array]:
  """The run's PRNG streams: init, step (fold in the step index), eval, stats."""
  base = jax.random.key(seed)
  return {name: jax.random.fold_in(base, stream) for name, stream in
          (("init", _INIT_STREAM), ("step", _STEP_STREAM), ("eval", _EVAL_STREAM), ("stats", _STATS_STREAM))}


def build_model(config: TrainConfig, key: jax.Array) -> fp4jax.pretrain.model.Transformer:
  """The model with freshly initialised float32 params; layer recipes set by the policy for step 0."""
  recipe = config.policy().resolved_recipe()
  graphdef = nnx.graphdef(nnx.eval_shape(lambda k: _make_model(config.model, recipe, k), key))
  model = nnx.merge(graphdef, _init_state(config.model, recipe, key))
  config.policy().apply(model, 0, config.steps)
  return model


def _make_model(model_config, recipe, key):
  return fp4jax.pretrain.model.Transformer(model_config, recipe=recipe, rngs=nnx.Rngs(params=key))


# Initialised under jit: one compile per (model config, recipe) instead of one per eager initializer op.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(model_config, recipe, key):
  return nnx.state(_make_model(model_config, recipe, key))


def load_data(config: TrainConfig) -> tuple[fp4jax.pretrain.data.TokenDataset, list[dict[str, np.ndarray]]]:
  """The dataset and the fixed validation batches; checks the vocabulary fits the model."""
  dataset = fp4jax.pretrain.data.load_dataset(config.data)
  if dataset.vocab_size > config.model.vocab_size:
    raise ValueError(f"The tokenizer has {dataset.vocab_size} tokens but the model's vocab_size is "
                     f"{config.model.vocab_size}: pass --model.vocab_size {dataset.vocab_size}.")
  if not config.eval_batches:
    return dataset, []
  val = fp4jax.pretrain.data.val_batches(dataset, batch_size=config.batch_size, seq_len=config.train_seq_len,
                                num_batches=config.eval_batches)
  return dataset, val


class CompileCache:
  """Jitted step functions keyed by (kind, graphdef, settings): pass one to several `train` calls (seed sweeps,
  resumption in one process) so identical graphs compile once. Owned by the caller; holds compiled executables."""

  def __init__(self):
    self._fns = {}

  def get(self, key, build: Callable[[], Callable]) -> Callable:
    if key not in self._fns:
      self._fns[key] = build()
    return self._fns[key]

  def __len__(self):
    return len(self._fns)


_OPTIMIZER_FIELDS = ("steps", "lr", "min_lr_ratio", "warmup_fraction", "decay_fraction", "decay_shape", "b1", "b2",
                     "eps", "weight_decay", "grad_clip")


class _Phases:
  """Graphdef and jitted functions per precision phase, built on first use (one compile per phase)."""

  def __init__(self, config: TrainConfig, model: fp4jax.pretrain.model.Transformer, optimizer,
               cache: CompileCache | None = None, placement: "Placement | None" = None):
    self.config, self.policy, self.optimizer = config, config.policy(), optimizer
    self.placement = placement or Placement.single_device()
    self.cache = cache if cache is not None else CompileCache()
    self._model = model
    self._graphdefs = {}
    self._optimizer_key = tuple(getattr(config, f) for f in _OPTIMIZER_FIELDS)

  def phase(self, step: int) -> int:
    return self.policy.phase(step, self.config.steps)

  def graphdef(self, step: int):
    phase = self.phase(step)
    if phase not in self._graphdefs:
      first = 0 if phase == 0 else self.policy.switch_step(self.config.steps)
      self.policy.apply(self._model, first, self.config.steps)
      self._graphdefs[phase] = nnx.graphdef(self._model)
    return self._graphdefs[phase]

  def layer_recipes(self, step: int) -> dict[str, str]:
    """Recipe name of each linear layer in the phase of `step`."""
    model = nnx.merge(self.graphdef(step), nnx.state(self._model))
    return {name: layer.recipe.name for name, layer in model.linear_layers().items()}

  def train_step(self, step: int):
    graphdef = self.graphdef(step)
    pl = self.placement
    return self.cache.get(("train", graphdef, self._optimizer_key, pl.key),
                          lambda: jax.jit(make_train_step(graphdef, self.optimizer),
                                          in_shardings=(pl.state, pl.batch, pl.replicated),
                                          out_shardings=(pl.state, pl.replicated)))

  def eval_step(self, step: int):
    graphdef = self.graphdef(step)
    pl = self.placement
    return self.cache.get(("eval", graphdef, pl.key), lambda: jax.jit(
        make_eval_step(graphdef), in_shardings=(pl.params, pl.batch, pl.replicated), out_shardings=pl.replicated))

  def stats_fn(self, step: int):
    graphdef, fmt = self.graphdef(step), self.config.stats_format
    return self.cache.get(("stats", graphdef, fmt), lambda: jax.jit(
        lambda params, tokens, key: fp4jax.pretrain.metrics.quant_stats(graphdef, params, tokens, key, fmt)))


def evaluate_params(phases: _Phases, params, val: list[dict[str, np.ndarray]], key: jax.Array, step: int) -> float:
  """Mean validation loss over the fixed batches, with the layer recipes in force at `step`."""
  eval_step = phases.eval_step(step)
  return float(np.mean([float(eval_step(params, phases.placement.put_batch(batch), key)) for batch in val]))


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the train state and batches live: one device, or a (data, fsdp, tensor) mesh (fp4jax.pretrain.sharding).

  Quantization runs on global arrays inside jit, so its numerics do not depend on the placement; the mesh only
  decides which device computes which slice (see fp4jax/sharding.py).
  """

  state: Any  # a sharding, or a TrainState-shaped pytree of shardings
  params: Any
  batch: Any
  replicated: Any
  mesh: Any = None
  key: str = "single"

  @classmethod
  def single_device(cls) -> "Placement":
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return cls(state=device, params=device, batch=device, replicated=device)

  @classmethod
  def for_config(cls, config: TrainConfig, state: "TrainState") -> "Placement":
    if not config.mesh:
      return cls.single_device()
    mesh = fp4jax.pretrain.sharding.make_mesh(config.mesh)
    recipe = config.policy().resolved_recipe()
    fmt = recipe.fprop.rhs.fmt
    fp4jax.pretrain.sharding.check_divisibility(
        state.params, mesh, block_size=fmt.block_size if fmt is not None else 1,
        weight_2d=recipe.fprop.rhs.block_2d, batch_size=config.batch_size, seq_len=config.train_seq_len,
        rht_size=recipe.rht_size if recipe.wgrad.rht else 1)
    state_sh = fp4jax.pretrain.sharding.tree_shardings(state, mesh)
    return cls(state=state_sh, params=state_sh.params, batch=fp4jax.pretrain.sharding.batch_sharding(mesh),
               replicated=fp4jax.pretrain.sharding.replicated(mesh), mesh=mesh, key=str(config.mesh))

  def put_batch(self, batch: dict[str, np.ndarray]):
    """This process's rows of the global batch, placed per the batch sharding."""
    if self.mesh is None:
      return jax.device_put(batch, self.batch)
    return fp4jax.pretrain.sharding.global_batch(batch, self.mesh)


# --- run folder ---------------------------------------------------------------------------------------------------

def _prepare_out(config: TrainConfig) -> pathlib.Path:
  """Creates --out; refuses (without touching anything) to start a fresh run over an existing one."""
  out = pathlib.Path(config.out).expanduser()
  ck_dir = ckpt.checkpoint_dir(out)
  metrics_path = out / fp4jax.pretrain.metrics.METRICS_FILE
  if config.resume:
    if not ck_dir.is_dir():
      raise ckpt.CheckpointError(f"--resume: no checkpoints in {out} ({ck_dir} does not exist).")
    return out
  existing = [p for p in (ck_dir, metrics_path) if p.exists()]
  if existing and not config.overwrite:
    raise ValueError(f"{out} already holds a run ({', '.join(p.name for p in existing)}). Pass --resume to "
                     "continue it, --overwrite to replace it, or choose another --out.")
  for p in existing:
    shutil.rmtree(p) if p.is_dir() else p.unlink()
  out.mkdir(parents=True, exist_ok=True)
  return out


def _checkpoint_meta(config: TrainConfig, step: int, phase: int) -> dict[str, Any]:
  keys = run_keys(config.seed)
  return {"config": config.to_dict(), "policy": config.policy().to_dict(),
          "recipe": str(config.policy().resolved_recipe()), "seed": config.seed,
          "run_key_data": np.asarray(jax.random.key_data(keys["step"])).tolist(),
          "data_position": step, "step": step, "phase": phase, "fp4jax_version": fp4jax.__version__}


def _config_differences(a: TrainConfig, b: TrainConfig) -> list[str]:
  da, db = a.to_dict(), b.to_dict()
  return [k for k in da if k not in _RESUME_FREE_FIELDS and da[k] != db.get(k)]


@contextlib.contextmanager
def _sigint_flag():
  """Turns the first Ctrl-C into a flag the loop checks after each step (a second one interrupts at once)."""
  flag = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield flag
    return

  def handler(signum, frame):
    del frame
    if flag.is_set():
      raise KeyboardInterrupt
    flag.set()
    tqdm.tqdm.write("Interrupted: saving a checkpoint after this step (Ctrl-C again to abort without saving).")

  previous = signal.signal(signal.SIGINT, handler)
  try:
    yield flag
  finally:
    signal.signal(signal.SIGINT, previous)


# --- the loop -----------------------------------------------------------------------------------------------------

def train(config: TrainConfig, hooks: Sequence[Hook] = (), *, log: Callable[[str], None] | None = print,
          compile_cache: CompileCache | None = None) -> dict[str, Any]:
  """Trains per `config`, writing <out>/metrics.jsonl, <out>/config.json and <out>/checkpoints/.

  hooks: callables (step, record) -> None, called after every step with that step's metrics record (the same dict
    written to metrics.jsonl: loss, lr, grad_norm, ..., val_loss / quant when computed), and once more for the
    final evaluation record (step == config.steps).
  Returns a summary: final_loss, final_val_loss (None without validation), val_losses {step: loss}, losses (this call's train losses),
    steps, start_step, tokens, wall_time, checkpoint_step, out, params (the final nnx.State), layer_recipes
    ({phase: {layer: recipe name}} for the phases this call ran).
  compile_cache: reuse jitted steps across calls (see CompileCache).
  Raises TrainingDiverged on a non-finite loss (nothing non-finite is ever saved), CheckpointError when --resume
  finds no readable checkpoint, ValueError for bad configs or data, KeyboardInterrupt after saving on Ctrl-C.
  """
  log = log or (lambda _: None)
  out = _prepare_out(config)
  dataset, val = load_data(config)
  keys = run_keys(config.seed)
  model = build_model(config, keys["init"])
  optimizer = make_optimizer(config)
  params = nnx.state(model, nnx.Param)
  state = TrainState(params=params, opt_state=jax.jit(optimizer.init)(params), step=jnp.asarray(0, jnp.int32))
  placement = Placement.for_config(config, state)
  phases = _Phases(config, model, optimizer, compile_cache, placement)
  # Committed like a restored state (restore reads onto these shardings), so a fresh and a resumed run hit the
  # same compiled step, and a checkpoint saved on one mesh restores onto another.
  state = jax.device_put(state, placement.state)

  manager = ckpt.open_manager(out, max_to_keep=config.keep_checkpoints,
                              save_interval_steps=config.checkpoint_every)
  try:
    start = 0
    if config.resume:
      later = [n for n in ckpt.available_steps(manager) if config.resume_step is not None and n > config.resume_step]
      if later:
        raise ckpt.CheckpointError(f"Resuming from step {config.resume_step} would overwrite the later checkpoints "
                                   f"{later} in {ckpt.checkpoint_dir(out)}; move or delete them first.")
      start, restored, meta = ckpt.restore(manager, state._asdict(), config.resume_step)
      state = TrainState(**restored)
      if int(state.step) != start:
        raise ckpt.CheckpointError(f"Checkpoint {start} holds step counter {int(state.step)}: inconsistent.")
      if start > config.steps:
        raise ValueError(f"Checkpoint step {start} is beyond --steps {config.steps}.")
      stored = TrainConfig.from_dict(meta["config"])
      changed = _config_differences(stored, config)
      if changed:
        log(f"Note: resuming with changed settings {changed}; the run will differ from an uninterrupted one.")
      dropped = fp4jax.pretrain.metrics.truncate_metrics(out, start - 1)
      log(f"Resumed from step {start} in {out}" + (f" (dropped {dropped} later metric records)" if dropped else ""))

    policy = config.policy()
    layer_names = list(model.linear_layers())
    log(policy.describe(config.model.n_layers, layer_names))
    log(f"Data: {dataset.source}")
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=1))
    return _loop(config, hooks, log, out, dataset, val, keys, phases, state, manager, start)
  finally:
    manager.wait_until_finished()
    manager.close()


def _loop(config, hooks, log, out, dataset, val, keys, phases, state, manager, start) -> dict[str, Any]:
  schedule = lr_schedule(config)
  tokens_per_step = config.batch_size * config.train_seq_len
  last_saved = start if config.resume else None
  losses, val_losses, layer_recipes = [], {}, {}
  t_start = time.perf_counter()

  def val_loss_at(step, params):
    return evaluate_params(phases, params, val, keys["eval"], step)

  def stats(step, params):
    raw = phases.stats_fn(step)(params, jnp.asarray(val[0]["inputs"]), keys["stats"])
    return jax.tree.map(float, raw)

  def save(step, state, force):
    nonlocal last_saved
    if step == last_saved:
      return
    meta = _checkpoint_meta(config, step, phases.phase(min(step, config.steps - 1)))
    if ckpt.save(manager, step, state._asdict(), meta, force=force):
      last_saved = step

  bar = tqdm.tqdm(total=config.steps, initial=start, disable=not config.progress, unit="step", dynamic_ncols=True)
  with fp4jax.pretrain.metrics.MetricsLog(out) as metrics_log, _sigint_flag() as interrupted, bar:
    for step in range(start, config.steps):
      record = {"step": step, "phase": phases.phase(step)}
      if record["phase"] not in layer_recipes:
        layer_recipes[record["phase"]] = phases.layer_recipes(step)
      if val and config.eval_every and step % config.eval_every == 0:
        record["val_loss"] = val_losses[step] = val_loss_at(step, state.params)
      if config.stats_every and step % config.stats_every == 0:
        record["quant"] = stats(step, state.params)

      batch = phases.placement.put_batch(fp4jax.pretrain.data.get_batch(
          dataset, "train", step, batch_size=config.batch_size, seq_len=config.train_seq_len, seed=config.seed,
          process_index=jax.process_index(), process_count=jax.process_count()))
      key = jax.random.fold_in(keys["step"], step)
      train_step = phases.train_step(step)
      t0 = time.perf_counter()
      new_state, m = train_step(state, batch, key)
      loss, grad_norm, finite = float(m["loss"]), float(m["grad_norm"]), bool(m["finite"])
      step_time = time.perf_counter() - t0
      record.update(loss=loss, lr=float(schedule(step)), grad_norm=grad_norm, step_time=step_time,
                    tokens_per_s=tokens_per_step / step_time)
      if not finite:
        record["diverged"] = True
        metrics_log.write(record)
        raise TrainingDiverged(step, loss, grad_norm, last_saved)
      state = new_state
      losses.append(loss)

      if step % config.log_every == 0 or "val_loss" in record or "quant" in record or step == config.steps - 1:
        metrics_log.write(record)
      for hook in hooks:
        hook(step, record)
      bar.update(1)
      bar.set_postfix(loss=f"{loss:.4f}", **({"val": f"{record['val_loss']:.4f}"} if "val_loss" in record else {}))

      done = step + 1
      if interrupted.is_set():
        save(done, state, force=True)
        manager.wait_until_finished()
        log(f"Interrupted after step {done}: checkpoint saved in {ckpt.checkpoint_dir(out)}.")
        raise KeyboardInterrupt
      if done < config.steps and done % config.checkpoint_every == 0:
        save(done, state, force=False)

    final_step = config.steps
    final = {"step": final_step, "phase": phases.phase(final_step - 1)}
    if val and final_step not in val_losses:
      final["val_loss"] = val_losses[final_step] = val_loss_at(final_step - 1, state.params)
    if config.stats_every:
      final["quant"] = stats(final_step - 1, state.params)
    if "val_loss" in final or "quant" in final:
      metrics_log.write(final)
    for hook in hooks:
      hook(final_step, final)
    if last_saved != final_step:
      save(final_step, state, force=True)

  wall = time.perf_counter() - t_start
  val_text = f", val_loss {val_losses[config.steps]:.4f}" if val else ""
  log(f"Done: step {config.steps}{val_text}, {wall:.1f}s; outputs in {out}")
  return {"out": str(out), "steps": config.steps, "start_step": start, "losses": losses,
          "final_loss": losses[-1] if losses else None, "final_val_loss": val_losses.get(config.steps),
          "val_losses": val_losses, "tokens": (config.steps - start) * tokens_per_step, "wall_time": wall,
          "checkpoint_step": last_saved, "params": state.params,
          "layer_recipes": layer_recipes}


# --- evaluation of a saved run ------------------------------------------------------------------------------------

def evaluate(out: str | pathlib.Path, step: int | None = None, *, eval_batches: int | None = None) -> dict[str, Any]:
  """Validation loss of the checkpoint at `step` (default: latest) of the run in `out`.

  Returns {"step", "val_loss", "phase", "eval_batches"}. Raises CheckpointError if there is no readable checkpoint.
  """
  manager = ckpt.open_manager(out, create=False)
  try:
    step, meta = ckpt.restore_meta(manager, step)
    config = TrainConfig.from_dict(meta["config"])
    if eval_batches is None and not config.eval_batches:
      eval_batches = TrainConfig.__dataclass_fields__["eval_batches"].default  # the run itself did not validate
    if eval_batches is not None:
      if eval_batches < 1:
        raise ValueError(f"eval_batches must be >= 1 to evaluate; got {eval_batches}.")
      config = config.replace(eval_batches=eval_batches)
    _, val = load_data(config)
    keys = run_keys(config.seed)
    model = build_model(config, keys["init"])
    optimizer = make_optimizer(config)
    params = nnx.state(model, nnx.Param)
    target = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.asarray(0, jnp.int32))
    step, restored, _ = ckpt.restore(manager, target._asdict(), step)
    phases = _Phases(config, model, optimizer)
    at = min(step, config.steps - 1)
    val_loss = evaluate_params(phases, restored["params"], val, keys["eval"], at)
    return {"step": step, "val_loss": val_loss, "phase": phases.phase(at), "eval_batches": config.eval_batches}
  finally:
    manager.close()


if __name__ == "__main__":
  from fp4jax.pretrain import cli  # pylint: disable=g-import-not-at-top
  sys.exit(cli.main(["train", *sys.argv[1:]]))
