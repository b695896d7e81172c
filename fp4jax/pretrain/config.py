"""TrainConfig: every knob of a training run, its JSON form, and command-line options generated from its fields.

Each TrainConfig field becomes `--field-name` (or `--field_name`); the nested model and data configs become
`--model NAME` (a preset from fp4jax.pretrain.model.MODEL_PRESETS) plus `--model.FIELD VALUE`, and `--data.FIELD VALUE`
(with `--corpus` as a short form of `--data.corpus`). The precision-policy fields give `--bf16-first`,
`--bf16-last`, `--bf16-blocks`, `--bf16-pattern`, `--switch-at` and `--switch`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

import fp4jax.pretrain.data
import fp4jax.pretrain.model
import fp4jax.pretrain.policy
import fp4jax.recipes

DECAY_SHAPES = ("linear", "1-sqrt")
QUANT_STATS_FORMATS = ("nvfp4", "mxfp4", "mxfp4_ceil")


def _help(text: str) -> dict[str, str]:
  return {"help": text}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A training run. `model` may be given as a preset name and `data` as a corpus spec; both are normalised."""

  out: str = dataclasses.field(default="runs/default", metadata=_help("run folder: metrics.jsonl, checkpoints/"))
  model: Any = dataclasses.field(default="tiny", metadata=_help("model preset name (see --model.FIELD overrides)"))
  data: Any = dataclasses.field(default_factory=fp4jax.pretrain.data.DataConfig, metadata=_help("corpus and tokenizer"))
  recipe: Any = dataclasses.field(default="nvfp4", metadata=_help(
      "recipe preset with options, e.g. nvfp4, bf16, mxfp4, fp8, 'nvfp4:rht_size=4,stochastic_rounding=false'"))
  # Precision policy (fp4jax.pretrain.policy.PrecisionPolicy).
  bf16_first: int = dataclasses.field(default=0, metadata=_help("first N transformer blocks in BF16"))
  bf16_last: int = dataclasses.field(default=0, metadata=_help("last N transformer blocks in BF16"))
  bf16_blocks: tuple[int, ...] = dataclasses.field(default=(), metadata=_help("more BF16 blocks, e.g. 3,5-7"))
  bf16_pattern: str | None = dataclasses.field(default=None, metadata=_help(
      "regex fully matching linear-layer names kept in BF16, e.g. '.*mlp\\.down'"))
  switch_at: float | int | None = dataclasses.field(default=None, metadata=_help(
      "switch to BF16 at this fraction of the run (0.82) or step (820)"))
  switch: str = dataclasses.field(default="all", metadata=_help("what switches: all | forward"))
  # Run length and batches.
  steps: int = dataclasses.field(default=200, metadata=_help(
      "optimizer steps (with --resume, another value is a new LR schedule: see --keep-schedule)"))
  batch_size: int = dataclasses.field(default=8, metadata=_help("sequences per step"))
  seq_len: int | None = dataclasses.field(default=None, metadata=_help("tokens per sequence; None = the model's max_seq_len"))
  seed: int = dataclasses.field(default=0, metadata=_help("seeds init, data order and stochastic rounding"))
  # Optimizer: AdamW with a warmup-stable-decay schedule and global-norm clipping.
  lr: float = dataclasses.field(default=3e-3, metadata=_help("peak learning rate"))
  min_lr_ratio: float = dataclasses.field(default=0.0, metadata=_help("final LR as a fraction of the peak"))
  warmup_fraction: float = dataclasses.field(default=0.05, metadata=_help("linear warmup, fraction of steps"))
  decay_fraction: float = dataclasses.field(default=0.2, metadata=_help("decay over the last fraction of steps"))
  decay_shape: str = dataclasses.field(default="linear", metadata=_help("decay shape: linear | 1-sqrt"))
  b1: float = dataclasses.field(default=0.9, metadata=_help("AdamW beta1"))
  b2: float = dataclasses.field(default=0.95, metadata=_help("AdamW beta2"))
  eps: float = dataclasses.field(default=1e-8, metadata=_help("AdamW epsilon"))
  weight_decay: float = dataclasses.field(default=0.1, metadata=_help("decoupled weight decay (matrices only)"))
  grad_clip: float = dataclasses.field(default=1.0, metadata=_help("global gradient-norm clip (0 = off)"))
  # Evaluation, statistics, logging.
  eval_every: int = dataclasses.field(default=50, metadata=_help("validate every N steps (0 = only at the end)"))
  eval_batches: int = dataclasses.field(default=4, metadata=_help("fixed validation batches (0 = no validation)"))
  stats_every: int = dataclasses.field(default=0, metadata=_help(
      "per-layer quantization statistics every N steps (0 = off)"))
  stats_format: str = dataclasses.field(default="nvfp4", metadata=_help("format the statistics quantize to"))
  log_every: int = dataclasses.field(default=1, metadata=_help("write metrics every N steps"))
  progress: bool = dataclasses.field(default=True, metadata=_help("tqdm progress bar"))
  # Checkpoints.
  checkpoint_every: int = dataclasses.field(default=100, metadata=_help("save every N steps (and at the end)"))
  keep_checkpoints: int = dataclasses.field(default=3, metadata=_help("checkpoints kept on disk"))
  mesh: str | None = dataclasses.field(default=None, metadata=_help(
      "device mesh 'data=2,fsdp=2,tensor=2' (product = device count); None: one device"))
  resume: bool = dataclasses.field(default=False, metadata=_help(
      "continue from the newest readable checkpoint in --out (unreadable ones are moved aside, not deleted)"))
  resume_step: int | None = dataclasses.field(default=None, metadata=_help(
      "resume from this step, not the latest (later checkpoints are moved aside, not deleted)"))
  overwrite: bool = dataclasses.field(default=False, metadata=_help(
      "start afresh in an --out that holds a run (deletes its checkpoints and metrics)"))

  def __post_init__(self):
    if isinstance(self.model, str):
      object.__setattr__(self, "model", fp4jax.pretrain.model.get_model_config(self.model))
    if not isinstance(self.model, fp4jax.pretrain.model.ModelConfig):
      raise ValueError(f"TrainConfig.model must be a preset name or a ModelConfig; got {self.model!r}.")
    if isinstance(self.data, str):
      object.__setattr__(self, "data", fp4jax.pretrain.data.DataConfig(corpus=self.data))
    if not isinstance(self.data, fp4jax.pretrain.data.DataConfig):
      raise ValueError(f"TrainConfig.data must be a corpus spec or a DataConfig; got {self.data!r}.")
    object.__setattr__(self, "bf16_blocks", tuple(self.bf16_blocks))
    self._check()

  def _check(self):
    def need(ok, message):
      if not ok:
        raise ValueError(f"TrainConfig: {message}")

    for name in ("steps", "batch_size", "log_every", "checkpoint_every", "keep_checkpoints"):
      value = getattr(self, name)
      need(_is_int(value) and value >= 1, f"{name} must be an int >= 1; got {value!r}.")
    for name in ("seed", "eval_every", "eval_batches", "stats_every"):
      value = getattr(self, name)
      need(_is_int(value) and value >= 0, f"{name} must be an int >= 0; got {value!r}.")
    if self.seq_len is not None:
      need(_is_int(self.seq_len) and self.seq_len >= 1, f"seq_len must be an int >= 1; got {self.seq_len!r}.")
      need(self.seq_len <= self.model.max_seq_len,
           f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}.")
    need(self.lr > 0, f"lr must be > 0; got {self.lr!r}.")
    need(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio must lie in [0, 1]; got {self.min_lr_ratio!r}.")
    for name in ("warmup_fraction", "decay_fraction"):
      value = getattr(self, name)
      need(0.0 <= value <= 1.0, f"{name} must lie in [0, 1]; got {value!r}.")
    need(self.warmup_fraction + self.decay_fraction <= 1.0,
         f"warmup_fraction + decay_fraction must be <= 1; got {self.warmup_fraction} + {self.decay_fraction}.")
    need(self.decay_shape in DECAY_SHAPES, f"decay_shape must be one of {DECAY_SHAPES}; got {self.decay_shape!r}.")
    need(0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0, f"b1, b2 must lie in [0, 1); got {self.b1}, {self.b2}.")
    need(self.eps > 0, f"eps must be > 0; got {self.eps!r}.")
    need(self.weight_decay >= 0, f"weight_decay must be >= 0; got {self.weight_decay!r}.")
    need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 = off); got {self.grad_clip!r}.")
    need(self.stats_format in QUANT_STATS_FORMATS,
         f"stats_format must be one of {QUANT_STATS_FORMATS} (statistics count FP4 codes); got {self.stats_format!r}.")
    if self.resume_step is not None:
      need(_is_int(self.resume_step) and self.resume_step >= 0,
           f"resume_step must be an int >= 0; got {self.resume_step!r}.")
    need(not (self.overwrite and self.resume), "overwrite and resume exclude each other.")
    # Building the policy validates the recipe, the BF16 layers and the switch against this model and run length.
    policy = self.policy()
    policy.bf16_blocks(self.model.n_layers)
    policy.switch_step(self.steps)

  @property
  def train_seq_len(self) -> int:
    """Tokens per training sequence (seq_len, or the model's maximum)."""
    return self.model.max_seq_len if self.seq_len is None else self.seq_len

  def policy(self) -> fp4jax.pretrain.policy.PrecisionPolicy:
    """The precision policy these fields describe."""
    return fp4jax.pretrain.policy.PrecisionPolicy(
        recipe=self.recipe, first=self.bf16_first, last=self.bf16_last, blocks=self.bf16_blocks,
        pattern=self.bf16_pattern, switch_at=self.switch_at, switch=self.switch)

  def replace(self, **changes) -> TrainConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (stored with every checkpoint); `from_dict` inverts it."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name in ("model", "data"):
        value = dataclasses.asdict(value)
      elif f.name == "recipe":
        value = fp4jax.pretrain.policy.PrecisionPolicy(recipe=value).to_dict()["recipe"]
      elif isinstance(value, tuple):
        value = list(value)
      out[f.name] = value
    return out

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
    """Inverse of `to_dict`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
      raise ValueError(f"Unknown TrainConfig field(s) {unknown}; valid fields: {sorted(fields)}.")
    data = dict(data)
    if isinstance(data.get("model"), dict):
      data["model"] = fp4jax.pretrain.model.ModelConfig(**data["model"])
    if isinstance(data.get("data"), dict):
      data["data"] = fp4jax.pretrain.data.DataConfig(**data["data"])
    if "recipe" in data:
      data["recipe"] = fp4jax.pretrain.policy.PrecisionPolicy.from_dict({"recipe": data["recipe"]}).recipe
    if "bf16_blocks" in data:
      data["bf16_blocks"] = tuple(data["bf16_blocks"])
    return cls(**data)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


# --- command line -------------------------------------------------------------------------------------------------

_NESTED = {"model": fp4jax.pretrain.model.ModelConfig, "data": fp4jax.pretrain.data.DataConfig}
_MISSING = object()


def parse_bool(text: str) -> bool:
  low = str(text).strip().lower()
  if low in ("1", "true", "yes", "on"):
    return True
  if low in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_int_list(text: str) -> tuple[int, ...]:
  """ "3,5,7-9" -> (3, 5, 7, 8, 9); "" -> ()."""
  out = []
  for part in (p.strip() for p in str(text).split(",")):
    if not part:
      continue
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
    if match is None:
      raise argparse.ArgumentTypeError(f"bad list entry {part!r} in {text!r}; use e.g. '3,5,7-9'")
    lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
    if hi < lo:
      raise argparse.ArgumentTypeError(f"bad range {part!r}: end before start")
    out.extend(range(lo, hi + 1))
  return tuple(out)


def parse_number(text: str) -> int | float | None:
  """ "820" -> 820 (a step), "0.82" -> 0.82 (a fraction), "none" -> None."""
  low = str(text).strip().lower()
  if low in ("", "none", "null"):
    return None
  try:
    return int(low) if re.fullmatch(r"[+-]?\d+", low) else float(low)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e


def _optional(parse):
  def parse_optional(text):
    return None if str(text).strip().lower() in ("none", "null") else parse(text)
  parse_optional.__name__ = getattr(parse, "__name__", "value")
  return parse_optional


def _parser_for(hint) -> tuple[Any, bool]:
  """(parse function, is_bool) for a field's type hint."""
  args = typing.get_args(hint)
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    kinds = [a for a in args if a is not type(None)]
    if set(kinds) == {float, int}:
      return parse_number, False
    parse, is_bool = _parser_for(kinds[0])
    return (_optional(parse) if type(None) in args else parse), is_bool
  if hint is bool:
    return parse_bool, True
  if hint in (int, float):
    return hint, False
  if origin is tuple:
    return parse_int_list, False
  return str, False


def _field_help(f: dataclasses.Field, default) -> str:
  text = f.metadata.get("help", "")
  if default is not _MISSING:
    text += f" (default: {default})" if text else f"default: {default}"
  return text.replace("%", "%%")


def _default_of(f: dataclasses.Field):
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return _MISSING


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds one option per TrainConfig field (and per model/data sub-field); unset options keep their defaults."""
  hints = typing.get_type_hints(TrainConfig)
  group = parser.add_argument_group("training config (TrainConfig fields)")
  for f in dataclasses.fields(TrainConfig):
    if f.name in _NESTED:
      continue
    parse, is_bool = _parser_for(hints[f.name])
    if f.name == "recipe":
      parse = str
    names = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
    kwargs = dict(dest=f.name, type=parse, default=argparse.SUPPRESS, help=_field_help(f, _default_of(f)))
    if is_bool:  # `--resume` alone means true; `--progress false` also works
      kwargs.update(nargs="?", const=True, metavar="BOOL")
    group.add_argument(*names, **kwargs)

  model_group = parser.add_argument_group("model (--model PRESET, then --model.FIELD VALUE overrides)")
  model_group.add_argument("--model", dest="model", default=argparse.SUPPRESS,
                           choices=sorted(fp4jax.pretrain.model.MODEL_PRESETS), help="model preset (default: tiny)")
  data_group = parser.add_argument_group("data (--data.FIELD VALUE)")
  data_group.add_argument("--corpus", dest="data.corpus", default=argparse.SUPPRESS,
                          help="short for --data.corpus: 'shakespeare' or a path to .txt/.md files")
  for prefix, cls in _NESTED.items():
    grp = model_group if prefix == "model" else data_group
    sub_hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      parse, is_bool = _parser_for(sub_hints[f.name])
      if prefix == "model":
        help_text = f"ModelConfig.{f.name} (tiny: {getattr(fp4jax.pretrain.model.MODEL_PRESETS['tiny'], f.name)})"
      else:
        help_text = _field_help(f, _default_of(f))
      kwargs = dict(dest=f"{prefix}.{f.name}", type=parse, default=argparse.SUPPRESS, help=help_text)
      if is_bool:
        kwargs.update(nargs="?", const=True, metavar="BOOL")
      grp.add_argument(f"--{prefix}.{f.name}", **kwargs)


def config_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
  """The options given on the command line, as {field: value} with "model.x" / "data.x" keys for sub-fields."""
  known = {f.name for f in dataclasses.fields(TrainConfig)}
  return {k: v for k, v in vars(namespace).items() if k in known or k.split(".")[0] in _NESTED}


def config_from_overrides(overrides: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
  """A TrainConfig from `base` (default: all defaults) with `overrides` applied; model/data keys may be dotted."""
  top = {k: v for k, v in overrides.items() if "." not in k}
  nested = {prefix: {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith(prefix + ".")}
            for prefix in _NESTED}
  if base is None:
    model = fp4jax.pretrain.model.get_model_config(top.pop("model", "tiny"), **nested["model"])
    data = dataclasses.replace(fp4jax.pretrain.data.DataConfig(), **nested["data"])
    return TrainConfig(model=model, data=data, **top)
  model = top.pop("model", base.model)
  if isinstance(model, str):
    model = fp4jax.pretrain.model.get_model_config(model)
  model = dataclasses.replace(model, **nested["model"]) if nested["model"] else model
  data = dataclasses.replace(base.data, **nested["data"]) if nested["data"] else base.data
  return dataclasses.replace(base, model=model, data=data, **top)
