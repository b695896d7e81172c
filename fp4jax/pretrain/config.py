"""TrainConfig: a training run's settings in groups, their JSON form, and the command-line options made from them.

Groups: `model` (ModelConfig, a preset name plus `--model.FIELD VALUE`), `data` (DataConfig, `--data.FIELD VALUE`,
`--corpus`), `policy` (PrecisionPolicy: `--recipe`, `--bf16-first`, `--bf16-last`, `--bf16-blocks`,
`--bf16-pattern`, `--switch-at`, `--switch`), `optimizer` (OptimizerConfig: `--lr`, `--b1`, ...), `evaluation`,
`osci_reset` (OsciResetConfig: TetraJet-v2's OsciReset, `--osci-reset-start`, ...), `outcontrol` (OutControlConfig:
TetraJet-v2's OutControl, `--outcontrol-fraction`, `--outcontrol-start`, `--outcontrol-window`), `logging` and
`checkpointing`; the run's own fields (`--out`, `--steps`, `--batch-size`, `--grad-accum`, `--seq-len`, `--seed`,
`--mesh`) sit at the top. Every group field has one flat option name (its flag), used on the command line, in sweep
overrides and by `TrainConfig.replace(lr=1e-3, bf16_last=2)`; fields that do not change a run's result carry
`result_free` in their metadata (see fp4jax.pretrain.options).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

import fp4jax.recipes
from fp4jax import cli_values
from fp4jax import osci_reset as osci_reset_lib
from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import policy as policy_lib
from fp4jax.pretrain import profiling
from fp4jax.pretrain import sharding as sharding_lib
from fp4jax.pretrain.optimizer import OptimizerConfig
from fp4jax.pretrain.osci import OsciResetConfig
from fp4jax.pretrain.outcontrol import OutControlConfig
from fp4jax.pretrain.outcontrol import tracked_layers as outcontrol_tracked_layers
from fp4jax.pretrain.options import default_of, flat_key, is_result_free, option
from fp4jax.pretrain.policy import PrecisionPolicy

QUANT_STATS_FORMATS = ("nvfp4", "mxfp4", "mxfp4_ceil")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _need_ints(obj, minimum: int, *names: str) -> None:
  """Refuses a field of `names` that is not an int >= minimum, naming its CLI option ("every" is --log-every)."""
  fields = {f.name: f for f in dataclasses.fields(obj)}
  for name in names:
    value = getattr(obj, name)
    if not _is_int(value) or value < minimum:
      flag = "--" + flat_key(fields[name]).replace("_", "-")
      raise ValueError(f"{type(obj).__name__}: {name} ({flag}) must be an int >= {minimum}; got {value!r}.")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Validation on fixed held-out batches and per-layer quantization statistics."""

  every: int = option(50, "validate every N steps (0 = only at the end)", flag="eval_every")
  batches: int = option(4, "fixed validation batches (0 = no validation)", flag="eval_batches")
  stats_every: int = option(0, "per-layer quantization statistics every N steps (0 = off)")
  stats_format: str = option("nvfp4", "format the statistics quantize to")

  def __post_init__(self):
    _need_ints(self, 0, "every", "batches", "stats_every")
    if self.stats_every and not self.batches:  # else the run fails at step 0 with an IndexError
      raise ValueError(f"EvalConfig: stats_every={self.stats_every} needs eval_batches >= 1 (the statistics are "
                       "taken on the first validation batch); got eval_batches=0.")
    if self.stats_format not in QUANT_STATS_FORMATS:
      raise ValueError(f"EvalConfig: stats_format must be one of {QUANT_STATS_FORMATS} (statistics count FP4 "
                       f"codes); got {self.stats_format!r}.")


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """How often metrics.jsonl gets a record, the progress bar, and a profiler trace of a few steps."""

  every: int = option(1, "write metrics every N steps", flag="log_every", result_free=True)
  progress: bool = option(True, "tqdm progress bar (off: a log line per validation instead)", result_free=True)
  profile: str | None = option(None, "trace steps START:STOP (STOP not included) with jax.profiler into "
                               "<out>/profile, for TensorBoard or Perfetto; e.g. 5:8 (step 0 compiles)",
                               result_free=True)

  def __post_init__(self):
    _need_ints(self, 1, "every")
    if self.profile is not None:
      profiling.parse_window(self.profile)

  @property
  def profile_window(self) -> tuple[int, int] | None:
    """(start, stop) of the profiled steps, or None."""
    return None if self.profile is None else profiling.parse_window(self.profile)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoint cadence and retention, and how a run starts in its folder."""

  every: int = option(100, "save every N steps (and at the end)", flag="checkpoint_every", result_free=True)
  keep: int = option(3, "checkpoints kept on disk", flag="keep_checkpoints", result_free=True)
  resume: bool = option(False, "continue from the newest readable checkpoint in --out (unreadable ones are moved "
                        "aside, not deleted)", result_free=True)
  resume_step: int | None = option(None, "resume from this step, not the latest (later checkpoints are moved aside, "
                                   "not deleted)", result_free=True)
  overwrite: bool = option(False, "start afresh in an --out that holds a run (deletes the checkpoints and metrics "
                           "fp4jax wrote there; other files are kept)", result_free=True)
  data_changed: bool = option(False, "with --resume: continue on data (corpus content, tokenizer) other than the "
                              "checkpoint was trained on, which is refused otherwise", result_free=True)

  def __post_init__(self):
    _need_ints(self, 1, "every", "keep")
    if self.resume_step is not None:
      _need_ints(self, 0, "resume_step")
      if not self.resume:  # else ignored: a fresh run (with overwrite, one that deletes the checkpoint asked for)
        raise ValueError(f"CheckpointConfig: resume_step={self.resume_step} only applies with resume=True (resume "
                         "from that checkpoint); without it the run would start afresh.")
    if self.data_changed and not self.resume:
      raise ValueError("CheckpointConfig: data_changed only applies with resume=True (it allows resuming on other "
                       "data than the checkpoint's).")
    if self.overwrite and self.resume:
      raise ValueError("CheckpointConfig: overwrite and resume (--overwrite, --resume) exclude each other: "
                       "--resume continues the run in --out, --overwrite replaces it.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A training run. `model` may be given as a preset name and `data` as a corpus spec; both are normalised."""

  out: str = option("runs/default", "run folder: metrics.jsonl, checkpoints/ (required: a new folder for a fresh "
                    "run, an existing run's folder with --resume)", result_free=True, help_default=False)
  model: model_lib.ModelConfig = option(help="model preset name (see --model.FIELD overrides)",
                                        factory=lambda: model_lib.get_model_config("tiny"))
  data: data_lib.DataConfig = option(help="corpus and tokenizer", factory=data_lib.DataConfig)
  policy: PrecisionPolicy = option(help="recipe and per-layer precision", factory=PrecisionPolicy)
  optimizer: OptimizerConfig = option(help="AdamW and its schedule", factory=OptimizerConfig)
  steps: int = option(200, "optimizer steps (with --resume, another value is a new LR schedule: see --keep-schedule)")
  batch_size: int = option(8, "sequences per step")
  grad_accum: int = option(1, "micro-batches per step: the step's gradient is the mean over grad_accum parts of "
                           "batch_size / grad_accum sequences, run one at a time (less activation memory; each part "
                           "has its own quantization amaxes and SR key)")
  seq_len: int | None = option(None, "tokens per sequence; None = the model's max_seq_len")
  seed: int = option(0, "seeds init, data order and stochastic rounding")
  evaluation: EvalConfig = option(help="validation and statistics", factory=EvalConfig)
  osci_reset: OsciResetConfig = option(help="TetraJet-v2's OsciReset", factory=OsciResetConfig)
  outcontrol: OutControlConfig = option(help="TetraJet-v2's OutControl", factory=OutControlConfig)
  logging: LogConfig = option(help="metrics log", factory=LogConfig)
  checkpointing: CheckpointConfig = option(help="checkpoints and resumption", factory=CheckpointConfig)
  # Different meshes sum in different orders: losses agree to ~1e-5, not bit for bit, so a mesh is a result.
  mesh: str | None = option(None, "device mesh 'data=2,fsdp=2,tensor=2' (product = device count); None: one device")

  def __post_init__(self):
    if isinstance(self.model, str):
      object.__setattr__(self, "model", model_lib.get_model_config(self.model))
    if isinstance(self.data, str):
      object.__setattr__(self, "data", data_lib.DataConfig(corpus=self.data))
    for name, cls in _NESTED_TYPES.items():
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"TrainConfig.{name} must be a {cls.__name__}; got {getattr(self, name)!r}.")
    _need_ints(self, 1, "steps", "batch_size", "grad_accum")
    if self.batch_size % self.grad_accum:
      raise ValueError(f"TrainConfig: grad_accum={self.grad_accum} must divide batch_size={self.batch_size} (each "
                       "micro-batch holds batch_size / grad_accum sequences).")
    _need_ints(self, 0, "seed")
    if isinstance(self.mesh, sharding_lib.MeshConfig):
      object.__setattr__(self, "mesh", str(self.mesh))
    if self.mesh:  # the spec's syntax and sizes now; whether they match the devices when the run starts
      sharding_lib.MeshConfig.parse(self.mesh)
    elif self.mesh not in (None, ""):
      raise ValueError(f"TrainConfig: mesh must be a string like 'data=2,fsdp=2,tensor=2', a MeshConfig or None; "
                       f"got {self.mesh!r}.")
    if self.seed >= 2**32:  # jax.random.key keeps the low 32 bits (without x64): 2**32 + k would rerun seed k's init
      raise ValueError(f"TrainConfig: seed must be < 2**32; got {self.seed}.")
    if self.seq_len is not None:
      _need_ints(self, 1, "seq_len")
      if self.seq_len > self.model.max_seq_len:
        raise ValueError(f"TrainConfig: seq_len={self.seq_len} exceeds the model's max_seq_len="
                         f"{self.model.max_seq_len}.")
    # The policy against this model and run length: BF16 blocks in range, a switch the run reaches, layer shapes the
    # recipes' blocks and RHT tiles divide (checked here, before any data is loaded or step compiled).
    self.policy.bf16_blocks(self.model.n_layers)
    model_lib.check_layer_recipes(self.model, self.policy.layer_recipes(model_lib.layer_names(self.model),
                                                                        self.model.n_layers, 0, self.steps))
    self.policy.switch_step(self.steps)
    window = self.logging.profile_window
    if window is not None and window[1] > self.steps:
      raise ValueError(f"TrainConfig: profile={self.logging.profile!r} ends after this {self.steps}-step run's last "
                       f"step ({self.steps - 1}).")
    if self.osci_reset.enabled:
      if not self.policy.recipe.is_quantized:
        raise ValueError(f"OsciReset (osci_reset_start={self.osci_reset.start}) needs a quantized --recipe; got "
                         f"{self.policy.recipe.name!r}.")
      osci_reset_lib.check_recipe(self.policy.recipe)
    if self.outcontrol.enabled:
      if not self.policy.recipe.is_quantized:
        raise ValueError(f"OutControl (outcontrol_fraction={self.outcontrol.fraction}) needs a quantized --recipe; "
                         f"got {self.policy.recipe.name!r}.")
      outcontrol_tracked_layers(self)  # a fraction that selects all of some layer's input channels
      # Here, before anything is built (it failed at the run's start). Not for OsciReset: such runs trained before,
      # resetting nothing, and their stored configs must still load.
      self._check_a_layer_is_quantized(f"OutControl (outcontrol_fraction={self.outcontrol.fraction})", "split")
      if self.outcontrol.select_step >= self.steps:
        raise ValueError(f"OutControl: calibration ends after step {self.outcontrol.select_step} (start "
                         f"{self.outcontrol.start} + window {self.outcontrol.window} - 1), beyond this "
                         f"{self.steps}-step run; use a smaller --outcontrol-start / --outcontrol-window.")

  def check_new_run(self) -> None:
    """Checks of a run about to start from step 0 that a stored config (resumed, evaluated) need not pass: runs of
    these settings trained before the checks, doing less than their names say, and their configs must still load.

    Refused: OsciReset with every linear layer in BF16 (it resets nothing); a quantized recipe with every linear
    layer in BF16 (a BF16 run under the recipe's name); OutControl whose channels are chosen no earlier than a late
    switch of every GEMM to BF16 (it splits nothing)."""
    if self.osci_reset.enabled:
      self._check_a_layer_is_quantized(f"OsciReset (osci_reset_start={self.osci_reset.start})", "reset")
    if self.policy.recipe.is_quantized and not self._quantized_layers():
      raise ValueError(f"The precision policy keeps every linear layer in BF16 (--bf16-first, --bf16-last, "
                       f"--bf16-blocks, --bf16-pattern): this run would train BF16 under the recipe "
                       f"{self.policy.recipe.name!r}. Pass --recipe bf16, or keep a layer quantized.")
    switch = self.policy.switch_step(self.steps) if self.policy.switch == "all" else None
    # OutControl runs its channels in MXFP8 from the step after select_step; the switch's steps are all BF16.
    if self.outcontrol.enabled and switch is not None and switch <= self.outcontrol.select_step + 1:
      raise ValueError(f"OutControl chooses its channels at step {self.outcontrol.select_step} (start "
                       f"{self.outcontrol.start} + window {self.outcontrol.window} - 1), but every GEMM switches to "
                       f"BF16 at step {switch} (switch_at={self.policy.switch_at!r}): no quantized step would split "
                       "its channels. Use an earlier --outcontrol-start / shorter --outcontrol-window, a later "
                       "--switch-at, or --switch forward.")

  def _quantized_layers(self) -> tuple[str, ...]:
    return self.policy.quantized_layers(model_lib.layer_names(self.model), self.model.n_layers)

  def _check_a_layer_is_quantized(self, what: str, verb: str) -> None:
    if not self._quantized_layers():
      raise ValueError(f"{what} is on, but the precision policy keeps every linear layer in BF16 (--bf16-first, "
                       f"--bf16-last, --bf16-blocks, --bf16-pattern): nothing to {verb}. Keep a layer quantized, or "
                       "turn it off.")

  @property
  def train_seq_len(self) -> int:
    """Tokens per training sequence (seq_len, or the model's maximum)."""
    return self.model.max_seq_len if self.seq_len is None else self.seq_len

  @property
  def recipe(self) -> fp4jax.recipes.Recipe:
    """The policy's quantized recipe."""
    return self.policy.recipe

  @classmethod
  def from_options(cls, **options) -> TrainConfig:
    """The defaults with `options` applied (see `replace`): TrainConfig.from_options(recipe="mxfp4", lr=1e-3)."""
    return cls().replace(**options)

  def replace(self, **changes) -> TrainConfig:
    """A copy with `changes`: field names ("policy", "out"), flat option names ("lr", "bf16_last",
    "checkpoint_every", "recipe") or dotted model/data fields ("model.d_model")."""
    top = {k: v for k, v in changes.items() if k in _TOP_FIELDS}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
      if key in _TOP_FIELDS:
        continue
      if key in _flat_index():
        group, name = _flat_index()[key]
      elif key.partition(".")[0] in ("model", "data") and key.partition(".")[2]:
        group, _, name = key.partition(".")
      else:
        raise ValueError(f"Unknown TrainConfig option {key!r}; valid: {', '.join(option_keys())}.")
      nested.setdefault(group, {})[name] = value
    for group, values in nested.items():
      current = top.get(group, getattr(self, group))
      if group == "model" and isinstance(current, str):
        top[group] = model_lib.get_model_config(current, **values)
      elif group == "data" and isinstance(current, str):
        top[group] = data_lib.DataConfig(corpus=current, **values)
      else:
        top[group] = dataclasses.replace(current, **values)
    return dataclasses.replace(self, **top)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form, groups as nested dicts (stored with every checkpoint); `from_dict` inverts it."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name == "policy":
        value = value.to_dict()
      elif dataclasses.is_dataclass(value):
        value = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(value).items()}
      out[f.name] = value
    return out

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
    """Inverse of `to_dict` (parses the stored recipe string once); also reads the flat form of fp4jax <= 0.1."""
    unknown = sorted(set(data) - set(_TOP_FIELDS))
    if unknown and not set(unknown) <= set(_flat_index()):
      raise ValueError(f"Unknown TrainConfig field(s) {unknown}; valid fields: {sorted(_TOP_FIELDS)}.")
    fields = {}
    flat = {}
    for key, value in data.items():
      if key == "policy":
        fields[key] = PrecisionPolicy.from_dict(value)
      elif key in _NESTED_TYPES and isinstance(value, Mapping):
        cls_ = _NESTED_TYPES[key]
        hints = typing.get_type_hints(cls_)
        fields[key] = cls_(**{k: tuple(v) if typing.get_origin(hints.get(k)) is tuple else v
                              for k, v in value.items()})
      elif key in _TOP_FIELDS:
        fields[key] = value
      else:  # the flat form: "lr", "bf16_blocks", "recipe" at the top
        flat[key] = policy_lib.recipe_from_json(value) if key == "recipe" else value
    config = cls(**fields)
    return config.replace(**flat) if flat else config


_NESTED_TYPES = {"model": model_lib.ModelConfig, "data": data_lib.DataConfig, "policy": PrecisionPolicy,
                 "optimizer": OptimizerConfig, "evaluation": EvalConfig, "osci_reset": OsciResetConfig,
                 "outcontrol": OutControlConfig, "logging": LogConfig,
                 "checkpointing": CheckpointConfig}
# Groups whose fields are options under their flat names (model and data fields are dotted: --model.d_model).
GROUPS = ("policy", "optimizer", "evaluation", "osci_reset", "outcontrol", "logging", "checkpointing")
_TOP_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


@functools.cache
def _flat_index() -> dict[str, tuple[str, str]]:
  """{flat option name: (group, field name)} for the grouped fields."""
  index = {}
  for group in GROUPS:
    for f in dataclasses.fields(_NESTED_TYPES[group]):
      index[flat_key(f)] = (group, f.name)
  return index


def option_keys() -> tuple[str, ...]:
  """Every flat option name: top-level fields, grouped fields, and dotted model./data. fields."""
  keys = []
  for name in _TOP_FIELDS:  # in field order, groups expanded in place; data only as --data.FIELD / --corpus
    if name in GROUPS:
      keys += [flat_key(f) for f in dataclasses.fields(_NESTED_TYPES[name])]
    elif name != "data":
      keys.append(name)
  keys += [f"{p}.{f.name}" for p in ("model", "data") for f in dataclasses.fields(_NESTED_TYPES[p])]
  return tuple(keys)


@functools.cache
def field_flags() -> dict[str, str]:
  """{dotted path of each TrainConfig field ("optimizer.lr", "model.d_model", "seed"): the option that sets it
  ("--lr", "--model.d_model", "--seed")}, for messages that name a field of the `to_dict` form."""
  flags = {}
  for f in dataclasses.fields(TrainConfig):
    if f.name in GROUPS:
      flags.update({f"{f.name}.{g.name}": "--" + flat_key(g).replace("_", "-")
                    for g in dataclasses.fields(_NESTED_TYPES[f.name])})
    elif f.name in _NESTED_TYPES:  # model and data: dotted options
      flags.update({f"{f.name}.{g.name}": f"--{f.name}.{g.name}" for g in dataclasses.fields(_NESTED_TYPES[f.name])})
    else:
      flags[f.name] = "--" + f.name.replace("_", "-")
  return flags


def group_keys(group: str) -> frozenset[str]:
  """Flat option names of one group's fields ("evaluation" -> eval_every, eval_batches, stats_every, ...)."""
  return frozenset(flat_key(f) for f in dataclasses.fields(_NESTED_TYPES[group]))


@functools.cache
def result_free_keys() -> frozenset[str]:
  """Flat option names of the fields marked `result_free` (out, progress, log_every, checkpoint cadence, ...)."""
  keys = {f.name for f in dataclasses.fields(TrainConfig) if is_result_free(f)}
  for group in GROUPS:
    keys |= {flat_key(f) for f in dataclasses.fields(_NESTED_TYPES[group]) if is_result_free(f)}
  return frozenset(keys)


def flatten(config_dict: Mapping[str, Any]) -> dict[str, Any]:
  """A `to_dict` form keyed by flat option names: groups flattened ("lr"), model and data fields dotted as their
  options ("model.d_model", "data.val_fraction")."""
  out = {}
  for key, value in config_dict.items():
    if key in GROUPS and isinstance(value, Mapping):
      names = {f.name: flat_key(f) for f in dataclasses.fields(_NESTED_TYPES[key])}
      out.update({names.get(k, k): v for k, v in value.items()})
    elif key in ("model", "data") and isinstance(value, Mapping):
      out.update({f"{key}.{k}": v for k, v in value.items()})
    else:
      out[key] = value
  return out


def result_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
  """Flat option names whose values differ between two `to_dict` forms, ignoring result-free fields and fields
  only one of them has (added or dropped since one was stored)."""
  fa, fb = flatten(a), flatten(b)
  return sorted(k for k in set(fa) & set(fb) if k not in result_free_keys() and fa[k] != fb[k])


# --- command line -------------------------------------------------------------------------------------------------

def _parser_for(hint) -> tuple[Any, bool]:
  """(parse function, is_bool) for a field's type hint."""
  args = typing.get_args(hint)
  origin = typing.get_origin(hint)
  if origin is typing.Union or type(None) in args:
    kinds = [a for a in args if a is not type(None)]
    if set(kinds) == {float, int}:
      return cli_values.parse_number, False
    parse, is_bool = _parser_for(kinds[0])
    return (cli_values.optional(parse) if type(None) in args else parse), is_bool
  if hint is bool:
    return cli_values.parse_bool, True
  if hint is int:
    return cli_values.parse_int, False
  if hint is float:
    return float, False
  if origin is tuple:
    return cli_values.parse_int_list, False
  return str, False  # strings, and the recipe: parsed once, when the config is built


def _help(f: dataclasses.Field) -> str:
  text, default = f.metadata.get("help", ""), default_of(f)
  if default is not dataclasses.MISSING and f.metadata.get("help_default", True):
    if isinstance(default, fp4jax.recipes.Recipe):
      default = policy_lib.recipe_spec(default)
    text += f" (default: {default})" if text else f"default: {default}"
  return text.replace("%", "%%")


def _add_options(group, cls, dest_of) -> None:
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    dest = dest_of(f)
    parse, is_bool = _parser_for(hints[f.name])
    names = [f"--{dest}"] if "." in dest else [f"--{dest.replace('_', '-')}"] + ([f"--{dest}"] if "_" in dest else [])
    kwargs = dict(dest=dest, type=parse, default=argparse.SUPPRESS, help=_help(f))
    if is_bool:  # `--resume` alone means true; `--progress false` also works
      kwargs.update(nargs="?", const=True, metavar="BOOL")
    group.add_argument(*names, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds one option per config field, listed by group; unset options keep their defaults (or the stored run's)."""
  run = parser.add_argument_group("run")
  for f in dataclasses.fields(TrainConfig):
    if f.name not in _NESTED_TYPES:
      _add_options_one(run, f)
  titles = {"policy": "precision policy (PrecisionPolicy)", "optimizer": "optimizer (OptimizerConfig)",
            "evaluation": "evaluation (EvalConfig)", "osci_reset": "TetraJet-v2 OsciReset (OsciResetConfig)",
            "outcontrol": "TetraJet-v2 OutControl (OutControlConfig)",
            "logging": "logging (LogConfig)",
            "checkpointing": "checkpointing (CheckpointConfig)"}
  for group in GROUPS:
    _add_options(parser.add_argument_group(titles[group]), _NESTED_TYPES[group], flat_key)
  model_group = parser.add_argument_group("model (--model PRESET, then --model.FIELD VALUE overrides)")
  model_group.add_argument("--model", dest="model", default=argparse.SUPPRESS,
                           choices=sorted(model_lib.MODEL_PRESETS), help="model preset (default: tiny)")
  _add_options(model_group, model_lib.ModelConfig, lambda f: f"model.{f.name}")
  data_group = parser.add_argument_group("data (--data.FIELD VALUE)")
  data_group.add_argument("--corpus", dest="data.corpus", default=argparse.SUPPRESS,
                          help="short for --data.corpus: 'shakespeare' or a path to .txt/.md files")
  _add_options(data_group, data_lib.DataConfig, lambda f: f"data.{f.name}")


def _add_options_one(group, f: dataclasses.Field) -> None:
  parse, is_bool = _parser_for(typing.get_type_hints(TrainConfig)[f.name])
  names = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
  kwargs = dict(dest=f.name, type=parse, default=argparse.SUPPRESS, help=_help(f))
  if is_bool:
    kwargs.update(nargs="?", const=True, metavar="BOOL")
  group.add_argument(*names, **kwargs)


def config_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
  """The options given on the command line, as {flat option name: value} ("lr", "bf16_last", "model.d_model")."""
  known = set(option_keys()) | {"model"}
  return {k: v for k, v in vars(namespace).items() if k in known}


def config_from_overrides(overrides: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
  """`base` (default: all defaults) with `overrides` (flat option names, see `TrainConfig.replace`) applied."""
  return (base if base is not None else TrainConfig()).replace(**overrides)
