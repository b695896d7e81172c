"""The pure step functions: TrainState, the loss, train/eval step builders, and a cache of their compiled forms.

A step is a pure function of (state, batch, key) with state = TrainState(params, opt_state, step, osci, outcontrol):
float32 master weights and optimizer state, bf16 compute inside the model, and OsciReset's / OutControl's
statistics when they are on. The model's structure and its layers' recipes are the static `graphdef`, so each
precision phase (and each OutControl phase) has its own graphdef and its own compiled step. With grad_accum > 1 a
step runs its batch as micro-batches, one at a time (`accumulated`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fp4jax.pretrain import metrics as metrics_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import osci as osci_lib
from fp4jax.pretrain import outcontrol as outcontrol_lib
from fp4jax.pretrain.config import TrainConfig
from fp4jax.pretrain.optimizer import ScheduleArgs
from fp4jax.pretrain.sharding import Placement, path_str


class TrainState(NamedTuple):
  """Everything a step updates: float32 params (nnx.State), optax state, the number of steps taken, OsciReset's
  statistics (an osci.OsciState) and OutControl's norms and channels (an outcontrol.OutControlState); each None
  when its option is off."""

  params: Any
  opt_state: Any
  step: jax.Array
  osci: Any = None  # None is not stored in checkpoints (fp4jax.pretrain.checkpoint), so they stay as before
  outcontrol: Any = None


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV.astype(jnp.float32), targets_BxT).mean()


def make_loss_fn(graphdef) -> Callable:
  """loss(params, batch, key) for the model described by `graphdef` (its layers' recipes included)."""

  def loss_fn(params, batch, key):
    model = nnx.merge(graphdef, params)
    return cross_entropy(model(batch["inputs"], key=key), batch["targets"])

  return loss_fn


def _capture_intermediates(model, tokens, key):
  """(logits, {path: value} of the values the model's layers sow as nnx.Intermediate)."""
  if hasattr(nnx, "capture"):  # Flax >= 0.12.x: sowing outside nnx.capture is deprecated
    logits, state = nnx.capture(lambda m, t, k: m(t, key=k), nnx.Intermediate)(model, tokens, key)
  else:
    logits = model(tokens, key=key)
    state = nnx.pop(model, nnx.Intermediate)
  return logits, {path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def with_outliers(model, oc_state):
  """`model` with OutControl's selected outlier channels (oc_state: an outcontrol.OutControlState) run in MXFP8 in
  the layers it tracks; returned for chaining."""
  layers = model.linear_layers()
  for name, idx in outcontrol_lib.flat(oc_state.idx).items():
    layers[name].outliers = nnx.data(idx)
  return model


def _outcontrol_loss_fn(graphdef, oc_phase: str) -> Callable:
  """loss(params, batch, key, oc_state) -> (loss, {layer: summed x^2 per input channel}) with OutControl's
  `oc_phase`: "record" sows the tracked layers' input statistics, "on" runs their outlier channels in MXFP8."""

  def loss_fn(params, batch, key, oc_state):
    model = nnx.merge(graphdef, params)
    if oc_phase != "record":
      return cross_entropy(with_outliers(model, oc_state)(batch["inputs"], key=key), batch["targets"]), {}
    layers = model.linear_layers()
    tracked = outcontrol_lib.flat(oc_state.idx)
    for name in tracked:
      layers[name].record_inputs = True
    logits, sown = _capture_intermediates(model, batch["inputs"], key)
    loss = cross_entropy(logits, batch["targets"])
    sq_norms = {}
    for name in tracked:
      calls = [v for p, v in sown.items() if p.startswith(f"{name}.x_sq_norms")]
      if not calls:
        raise ValueError(f"OutControl: layer {name!r} recorded no inputs (found {sorted(sown)[:3]}).")
      sq_norms[name] = sum(calls)  # a layer called more than once in a step adds up its calls
    return loss, sq_norms

  return loss_fn


def global_norm(tree) -> jax.Array:
  """sqrt of the sum of squares of all leaves, in float32 (what clip_by_global_norm clips)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_train_step(graphdef, optimizer: optax.GradientTransformation | Callable[[ScheduleArgs], Any],
                    osci: osci_lib.OsciResetConfig | None = None,
                    outcontrol: outcontrol_lib.OutControlConfig | None = None, oc_phase: str = "off",
                    gather_params: Callable | None = None, grad_accum: int = 1) -> Callable:
  """step(state, batch, key) -> (new_state, metrics): one AdamW update; apply jax.jit (and shardings) yourself.

  optimizer: an optax GradientTransformation; or a function of the LR schedule's numbers returning one (e.g.
  functools.partial(optimizer_lib.make_optimizer, config)): the step is then step(state, batch, key, schedule),
  `schedule` an optimizer.ScheduleArgs, so one compiled step serves runs of any length or peak LR.

  metrics: loss (of the params before the update), grad_norm (before clipping), and `finite`: whether loss, grads
  and new params are all finite. The caller must discard new_state when `finite` is false.
  osci: an enabled OsciResetConfig runs osci.update on the updated params (state.osci must hold its statistics)
  and adds metrics["osci_reset"], the number of elements reset by this step.
  outcontrol, oc_phase: an enabled OutControlConfig and the OutControl phase of the steps this function runs
  ("off", "record" or "on", see outcontrol.phase); state.outcontrol must hold its state.
  gather_params: on a mesh, the Placement's `gather_params` (the forward reads the params through it).
  grad_accum: micro-batches per step (see `accumulated`); 1 is the plain step.
  """
  if oc_phase not in outcontrol_lib.PHASES:
    raise ValueError(f"oc_phase must be one of {outcontrol_lib.PHASES}; got {oc_phase!r}.")
  oc_phase = oc_phase if outcontrol is not None and outcontrol.enabled else "off"
  osci = osci if osci is not None and osci.enabled else None
  if oc_phase == "off":
    plain = make_loss_fn(graphdef)
    loss_fn = lambda params, batch, key, oc_state: (plain(params, batch, key), {})
  else:
    loss_fn = _outcontrol_loss_fn(graphdef, oc_phase)
  loss_fn = _reading_through(loss_fn, gather_params)
  grad_fn = accumulated(jax.value_and_grad(loss_fn, has_aux=True), grad_accum)

  def step(state: TrainState, batch, key, schedule: ScheduleArgs | None = None):
    tx = _optimizer_for(optimizer, schedule)
    if oc_phase != "off" and state.outcontrol is None:
      raise ValueError("OutControl is on but TrainState.outcontrol is None: build it with outcontrol.initial_state.")
    (loss, sq_norms), grads = grad_fn(state.params, batch, key, state.outcontrol)
    grad_norm = global_norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": grad_norm}
    oc_state = state.outcontrol
    if oc_phase == "record":
      oc_state = outcontrol_lib.update(oc_state, sq_norms, state.step, outcontrol)
    osci_state = state.osci
    if osci is not None:
      if osci_state is None:
        raise ValueError("OsciReset is on but TrainState.osci is None: build it with osci.init_state.")
      recipes = {name: layer.recipe for name, layer in nnx.merge(graphdef, params).linear_layers().items()}
      # Q as the next forward quantizes the weights: the rows it runs in MXFP8 apart.
      idx, selected = outcontrol_lib.next_outliers(oc_state, state.step, oc_phase, outcontrol)
      params, osci_state, metrics["osci_reset"] = osci_lib.update(params, osci_state, state.step, recipes, osci,
                                                                  idx, selected)
    metrics["finite"] = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(params)
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1, osci=osci_state,
                           outcontrol=oc_state)
    return new_state, metrics

  return step


def micro_batches(batch, n: int):
  """The batch's arrays as [n, B / n, ...]: micro-batch i holds rows i, i + n, i + 2n, ... of the batch.

  Strided, not contiguous, so that every batch shard of a mesh (a contiguous block of rows, B / n divisible by the
  shard count) holds its own rows of every micro-batch: the split moves no data between devices, and a mesh run
  cuts the batch into the same micro-batches as a single device.
  """
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f"grad_accum={n} does not divide the batch of {x.shape[0]} rows.")
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def accumulated(grad_fn: Callable, n: int) -> Callable:
  """grad_fn(params, batch, key, oc_state) -> ((loss, sq_norms), grads) over `n` micro-batches, one at a time.

  Micro-batch i (`micro_batches`) runs with key fold_in(key, i), so its stochastic rounding and RHT signs are its
  own. loss and grads are the means over the micro-batches (the full batch's mean loss and its gradient, as all
  have the same number of tokens); OutControl's sq_norms are sums, as over the full batch. A `lax.scan` keeps one
  micro-batch's activations alive at a time and compiles the forward and backward once. Quantized recipes take
  each tensor's amax per micro-batch (as TransformerEngine does), so with n > 1 the quantization differs from the
  full batch's; n = 1 is `grad_fn` itself, the same graph and bits as without accumulation.
  """
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"grad_accum must be an int >= 1; got {n!r}.")
  if n == 1:
    return grad_fn

  def fn(params, batch, key, oc_state):
    def one(i, micro):
      return grad_fn(params, micro, None if key is None else jax.random.fold_in(key, i), oc_state)

    micro_BxT = micro_batches(batch, n)
    shapes = jax.eval_shape(one, 0, jax.tree.map(lambda x: x[0], micro_BxT))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _sum_dtype(s.dtype)), shapes)

    def body(total, xs):
      return jax.tree.map(lambda t, v: t + v.astype(t.dtype), total, one(*xs)), None

    ((loss, sq_norms), grads), _ = jax.lax.scan(body, zeros, (jnp.arange(n), micro_BxT))
    mean = lambda t, s: (t / jnp.asarray(n, t.dtype)).astype(s.dtype)
    (loss_s, sq_s), grads_s = shapes
    return (mean(loss, loss_s), jax.tree.map(lambda t, s: t.astype(s.dtype), sq_norms, sq_s)), jax.tree.map(
        mean, grads, grads_s)

  return fn


def _sum_dtype(dtype):
  """Sums of bfloat16 gradients run in float32; float32 and wider keep their type."""
  return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def with_step_key(step: Callable) -> Callable:
  """step(state, batch, key, ...) as f(state, batch, run_key, ...) with key = fold_in(run_key, state.step): the
  trainer's per-step key, derived inside the compiled step."""

  def keyed_step(state: TrainState, batch, run_key, *args):
    return step(state, batch, jax.random.fold_in(run_key, state.step), *args)

  # The step's name names its compiled module (`jit_step`): compile logs, profiles and JAX's cache key.
  keyed_step.__name__, keyed_step.__qualname__ = step.__name__, step.__qualname__
  return keyed_step


def _optimizer_for(optimizer, schedule: ScheduleArgs | None) -> optax.GradientTransformation:
  """The step's optimizer: `optimizer` itself, or what it makes of the schedule's numbers."""
  fixed = isinstance(optimizer, optax.GradientTransformation)
  if fixed and schedule is not None:
    raise ValueError("This train step's optimizer has its schedule built in: call it as step(state, batch, key), or "
                     "build it from a function of ScheduleArgs.")
  if not fixed and schedule is None:
    raise ValueError("This train step takes the LR schedule's numbers: call it as step(state, batch, key, schedule) "
                     "with schedule = optimizer.schedule_args(config, steps).")
  return optimizer if fixed else optimizer(schedule)


def make_eval_step(graphdef, outcontrol: bool = False, gather_params: Callable | None = None) -> Callable:
  """eval(params, batch, key) -> mean cross-entropy of the batch; with `outcontrol`, eval(params, batch, key,
  oc_state) with the OutControl outlier channels of oc_state (an outcontrol.OutControlState) in MXFP8.
  gather_params: as in make_train_step."""
  if not outcontrol:
    return _reading_through(make_loss_fn(graphdef), gather_params)
  loss_fn = _reading_through(_outcontrol_loss_fn(graphdef, "on"), gather_params)
  return lambda params, batch, key, oc_state: loss_fn(params, batch, key, oc_state)[0]


def _reading_through(fn: Callable, gather_params: Callable | None) -> Callable:
  """fn(params, ...) reading its params through `gather_params` (a sharding constraint: values unchanged)."""
  if gather_params is None:
    return fn
  return lambda params, *args: fn(gather_params(params), *args)


class CompileCache:
  """Jitted step functions keyed by (kind, graphdef, settings): pass one to several `train` calls (seed sweeps,
  resumption in one process) so identical graphs compile once. Owned by the caller; holds compiled executables."""

  def __init__(self):
    self._fns = {}

  def get(self, key, build: Callable[[], Callable]) -> Callable:
    """The function cached under `key`, built by `build()` on the first request."""
    if key not in self._fns:
      self._fns[key] = build()
    return self._fns[key]

  def __len__(self):
    return len(self._fns)


class Phases:
  """Graphdef and jitted step functions per precision phase of `config`'s policy, built on first use.

  The train step is step(state, batch, run_key, schedule). It draws its own key, fold_in(run_key, state.step),
  inside the compiled step: folded in eagerly by the loop, that key was one more dispatch per step (~0.13 ms on the
  2-core CPU) for the same bits. It takes the LR schedule's numbers as its 4th argument (`schedule`, this run's
  ScheduleArgs): they are not compiled in, so runs that differ only in --steps (a lengthened resume, a sweep's runs)
  or in the schedule's settings share one compiled step through the CompileCache and JAX's persistent cache.

  The policy sets `model`'s layer recipes when a phase is first needed, so each phase compiles once. The train step
  donates its TrainState: the new state is written into the old one's buffers (`paper_1b` with 2 layers, XLA:CPU's
  memory analysis: 3.94 instead of 4.17 GiB for bf16, 3.82 instead of 4.21 for nvfp4), so after a step the state
  passed in is deleted. NumPy arrays taken from it before the step (np.asarray, np.array) and checkpoint saves keep
  their values: JAX does not donate a buffer that NumPy still views.
  """

  def __init__(self, config: TrainConfig, model: nnx.Module, cache: CompileCache | None = None,
               placement: Placement | None = None):
    self.config, self.policy = config, config.policy
    self.optimizer = functools.partial(optimizer_lib.make_optimizer, config.optimizer)
    self.schedule = optimizer_lib.schedule_args(config.optimizer, config.steps)
    self.placement = placement or Placement.single_device()
    self.cache = cache if cache is not None else CompileCache()
    self._model = model
    self._model_phase = 0  # the model comes built with the step-0 recipes
    self._graphdefs = {}
    self._train_steps = {}
    self._optimizer_key = (optimizer_lib.step_settings(config.optimizer), config.osci_reset)

  def phase(self, step: int) -> int:
    """0 before the policy's late switch, 1 from it on."""
    return self.policy.phase(step, self.config.steps)

  def graphdef(self, step: int):
    """The model's graphdef for `step`'s phase (layer recipes set as the policy has them then)."""
    phase = self.phase(step)
    if phase not in self._graphdefs:
      if phase != self._model_phase:  # recipes change only at the switch
        first = 0 if phase == 0 else self.policy.switch_step(self.config.steps)
        self.policy.apply(self._model, first, self.config.steps)
        self._model_phase = phase
      self._graphdefs[phase] = nnx.graphdef(self._model)
    return self._graphdefs[phase]

  def layer_recipes(self, step: int) -> dict[str, str]:
    """Recipe name of each linear layer in the phase of `step`."""
    model = nnx.merge(self.graphdef(step), nnx.state(self._model))
    return {name: layer.recipe.name for name, layer in model.linear_layers().items()}

  def train_step(self, step: int):
    """The jitted train step for `step`'s precision phase and OutControl phase."""
    oc_phase = outcontrol_lib.phase(step, self.config.outcontrol)
    key = (self.phase(step), oc_phase)
    # Asked for every step: the CompileCache key hashes the graphdef (every layer's recipe), ~1.6 ms for `small`,
    # more than a tenth of a `tiny` step on a CPU, so each phase's function is kept here after its first lookup.
    if key not in self._train_steps:
      self._train_steps[key] = self._cached_train_step(step, oc_phase)
    return self._train_steps[key]

  def _cached_train_step(self, step: int, oc_phase: str):
    graphdef = self.graphdef(step)
    pl = self.placement
    oc_key = (oc_phase, self.config.outcontrol) if oc_phase != "off" else None  # "off" is the plain step
    return self.cache.get(("train", graphdef, self._optimizer_key, oc_key, pl.key, self.config.grad_accum),
                          lambda: jax.jit(pl.traced_on_mesh(with_step_key(make_train_step(
                              graphdef, self.optimizer, self.config.osci_reset, self.config.outcontrol, oc_phase,
                              pl.gather_params, self.config.grad_accum))),
                                          in_shardings=(pl.state, pl.batch, pl.replicated, pl.replicated),
                                          out_shardings=(pl.state, pl.replicated), donate_argnums=0))

  def eval_step(self, step: int, outcontrol: bool = False):
    """The jitted validation step of `step`'s phase (with OutControl's state as an argument if `outcontrol`)."""
    graphdef = self.graphdef(step)
    pl = self.placement
    if outcontrol:  # the OutControl state is replicated: its leaves are small vectors
      return self.cache.get(("eval_oc", graphdef, pl.key), lambda: jax.jit(
          pl.traced_on_mesh(make_eval_step(graphdef, True, pl.gather_params)),
          in_shardings=(pl.params, pl.batch, pl.replicated, pl.replicated), out_shardings=pl.replicated))
    return self.cache.get(("eval", graphdef, pl.key), lambda: jax.jit(
        pl.traced_on_mesh(make_eval_step(graphdef, gather_params=pl.gather_params)),
        in_shardings=(pl.params, pl.batch, pl.replicated),
        out_shardings=pl.replicated))

  def stats_fn(self, step: int):
    """The jitted per-layer quantization statistics of `step`'s phase (metrics.quant_stats)."""
    graphdef, fmt, pl = self.graphdef(step), self.config.evaluation.stats_format, self.placement
    # The tokens as a global batch (Placement.put_batch): unsharded, each process's own rows would pass for the
    # whole batch, and process 0's statistics would cover its rows only.
    return self.cache.get(("stats", graphdef, fmt, pl.key), lambda: jax.jit(pl.traced_on_mesh(
        lambda params, tokens, key: metrics_lib.quant_stats(graphdef, pl.gather_params(params), tokens, key, fmt)),
        in_shardings=(pl.params, pl.batch, pl.replicated), out_shardings=pl.replicated))

  def val_loss(self, params, val: list[dict[str, np.ndarray]], key: jax.Array, step: int,
               outcontrol=None) -> float:
    """Mean validation loss over the fixed batches, with the layer recipes in force at `step` (and OutControl's
    outlier channels from `outcontrol`, the train state's OutControlState, once they are selected)."""
    if outcontrol is not None and outcontrol_lib.phase(step, self.config.outcontrol) == "on":
      step_oc = self.eval_step(step, outcontrol=True)
      eval_step = lambda params, batch, key: step_oc(params, batch, key, outcontrol)  # noqa: E731
    else:
      eval_step = self.eval_step(step)
    # Every batch sent before the losses are read: the host does not wait for each batch in turn.
    losses = jax.device_get([eval_step(params, self.placement.put_batch(batch), key) for batch in val])
    return float(np.mean([float(loss) for loss in losses]))
