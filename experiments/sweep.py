"""Sweeps: named runs x seeds, each a `fp4jax.pretrain.trainer.train` run in OUT/<run>/seed<k>, resumable, then a report.

A `Run` is a name plus TrainConfig overrides (what the experiment varies); a `Sweep` holds the runs, the overrides
shared by all of them (the preset's base, plus any given on the command line), the number of seeds and the
reference run the loss gaps are measured against. A finished run leaves `summary.json` in its folder; running a
sweep again skips those, resumes runs that left checkpoints and restarts the rest, so an interrupted sweep is
continued by repeating its command. A run is resumed only under its own settings and on its own data (the corpus's
content and tokenizer its checkpoint recorded): otherwise the sweep stops before anything runs, saying what to do.
A finished run is kept only if the full recipe and resolved GEMM mode its summary records (`provenance`) are what
this code and machine give its settings (summaries from before they were recorded: kept, with a note).

Override keys are TrainConfig fields (`steps`, `lr`, `recipe`, `bf16_last`, `switch_at`, ...), `model` (a preset
name) and `model.FIELD` / `data.FIELD` sub-fields; `out`, `seed`, `resume`, `resume_step` and `overwrite` are set
by the sweep itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import fp4jax.gemm
from fp4jax import cli_values
import fp4jax.pretrain.checkpoint
import fp4jax.pretrain.data
import fp4jax.pretrain.distributed
import fp4jax.pretrain.metrics
import fp4jax.pretrain.model
import fp4jax.recipes
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import resume as resume_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig

from experiments.common import CHECKED_PROVENANCE, SUMMARY_FILE, SWEEP_FILE, fmt, has_provenance, jsonable

PRESETS = ("smoke", "cpu", "gpu")
LOG_FILE = "train.log"
# Set per run by the sweep, never by an override.
MANAGED_FIELDS = ("out", "seed", "resume", "resume_step", "overwrite")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")

# Settings shared by every experiment, per preset. Runs add what they vary; `--set` changes these.
BASE_OVERRIDES: dict[str, dict[str, Any]] = {
    # Seconds per run on a CPU: 2-block tiny model, 12 steps of 8 x 32 tokens, one validation at the end.
    "smoke": {"model": "tiny", "model.n_layers": 2, "seq_len": 32, "batch_size": 8, "steps": 12, "lr": 1e-2,
              "warmup_fraction": 0.1, "decay_fraction": 0.25, "eval_every": 0, "eval_batches": 1,
              "checkpoint_every": 6, "keep_checkpoints": 1, "progress": False},
    # Minutes per run on a 2-core CPU: a 4-block d_model=64 model, 300 steps of 16 x 64 tokens (~0.3M tokens), a
    # high learning rate so quantization noise shows within the run. Byte-level Shakespeare.
    "cpu": {"model": "tiny", "model.n_layers": 4, "seq_len": 64, "batch_size": 16, "steps": 300, "lr": 1e-2,
            "warmup_fraction": 0.05, "decay_fraction": 0.2, "eval_every": 50, "eval_batches": 4,
            "checkpoint_every": 100, "keep_checkpoints": 1, "progress": False},
    # The paper's 1.2B ablation scale (model paper_1b, 20 blocks): needs a GPU and a real corpus
    # (--set data.corpus=PATH --set data.tokenizer=bpe --set model.vocab_size=V). The paper trains ~1T tokens; this
    # preset runs 20k steps of 64 x 4096 tokens (~5.2B), enough to rank recipes, not to reproduce the paper's curves.
    # remat + scan_layers: one compiled block body (the loop's nvfp4 step compiled ~11 s per block for sm_90), and
    # on the CPU the pair stepped faster and in less memory than either alone (benchmarks/RESULTS.md).
    "gpu": {"model": "paper_1b", "model.remat": True, "model.scan_layers": True, "seq_len": 4096, "batch_size": 64,
            "steps": 20000, "lr": 3e-4, "min_lr_ratio": 0.1, "warmup_fraction": 0.02, "decay_fraction": 0.2,
            "decay_shape": "1-sqrt", "eval_every": 500, "eval_batches": 16, "checkpoint_every": 1000,
            "keep_checkpoints": 2, "progress": False},
}
# BF16 blocks kept by the full recipe per preset: the paper keeps ~15% of linear layers in BF16, mostly at the end.
HIGH_PRECISION_LAST = {"smoke": 1, "cpu": 1, "gpu": 2}


def check_preset(preset: str) -> str:
  """Returns `preset` if valid, else raises ValueError naming the valid ones."""
  if preset not in PRESETS:
    raise ValueError(f"Unknown preset {preset!r}{cli_values.did_you_mean(preset, PRESETS)}; valid presets: "
                     f"{', '.join(PRESETS)}.")
  return preset


def base_overrides(preset: str) -> dict[str, Any]:
  """A copy of the overrides every run of a `preset` sweep starts from."""
  return dict(BASE_OVERRIDES[check_preset(preset)])


# --- override keys and values --------------------------------------------------------------------------------------

def override_keys() -> tuple[str, ...]:
  """Every key an override may set: the `fp4jax train` options (less the managed ones), model, model.X, data.X."""
  return tuple(k for k in config_lib.option_keys() if k not in MANAGED_FIELDS)


def check_override_keys(overrides: Mapping[str, Any], where: str = "override") -> None:
  """Raises ValueError for keys that are managed by the sweep or not config fields, listing the valid ones."""
  valid = override_keys()
  for key in overrides:
    if key in MANAGED_FIELDS:
      raise ValueError(f"{where} key {key!r} is set by the sweep itself (managed: {', '.join(MANAGED_FIELDS)}); "
                       "use --out and --seeds instead.")
    if key not in valid:
      raise ValueError(f"Unknown {where} key {key!r}{cli_values.did_you_mean(key, valid)}; valid keys: "
                       f"{', '.join(valid)}.")


def _value_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
  config_lib.add_config_arguments(parser)
  return parser


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  """["steps=100", "model.d_model=128", "recipe=nvfp4:rht_size=4"] -> {key: typed value}, validated.

  Values are parsed as the `fp4jax train` command line parses the same option (ints, floats, booleans, block
  lists "3,5-7", "none"). Only the first '=' splits, so recipe strings keep theirs.
  """
  parser = _value_parser()
  out = {}
  for item in items:
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or not key:
      raise ValueError(f"Override {item!r} is not of the form KEY=VALUE (e.g. steps=100, model.d_model=128).")
    check_override_keys({key: None})
    try:
      namespace, rest = parser.parse_known_args([f"--{key}={value}"])
    except (argparse.ArgumentError, argparse.ArgumentTypeError) as e:
      raise ValueError(f"Bad value for override {key!r}: {e}") from e
    if rest or key not in vars(namespace):
      raise ValueError(f"Could not parse override {item!r}.")
    out[key] = vars(namespace)[key]
  return out


def merge_overrides(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
  """`base` updated by `changes`; a new `model` preset drops the base's `model.X` keys (they were for the old one)."""
  merged = dict(base)
  if "model" in changes:
    merged = {k: v for k, v in merged.items() if not k.startswith("model.")}
  merged.update(changes)
  return merged


# --- runs and sweeps -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
  """One setting of a sweep: a folder name, the TrainConfig overrides it varies, and a legend label."""

  name: str
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  label: str = ""

  def __post_init__(self):
    if not isinstance(self.name, str) or not _RUN_NAME.fullmatch(self.name):
      raise ValueError(f"Run name {self.name!r} must be a folder name of letters, digits and _.+=- .")
    check_override_keys(self.overrides, f"run {self.name!r} override")
    object.__setattr__(self, "overrides", dict(self.overrides))
    if not self.label:
      object.__setattr__(self, "label", self.name)


@dataclasses.dataclass(frozen=True)
class Sweep:
  """Runs x seeds sharing `base` overrides; gaps are measured against the run named `reference`."""

  experiment: str
  preset: str
  runs: tuple[Run, ...]
  base: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  seeds: int = 1
  reference: str | None = "bf16"
  command: str = ""
  description: str = ""

  def __post_init__(self):
    check_preset(self.preset)
    object.__setattr__(self, "runs", tuple(self.runs))
    object.__setattr__(self, "base", dict(self.base))
    names = [r.name for r in self.runs]
    if not names:
      raise ValueError(f"Sweep {self.experiment!r} has no runs.")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"Sweep {self.experiment!r}: duplicate run names {duplicates}.")
    if self.reference is not None and self.reference not in names:
      raise ValueError(f"Sweep {self.experiment!r}: reference run {self.reference!r} is not among {names}.")
    if not isinstance(self.seeds, int) or isinstance(self.seeds, bool) or self.seeds < 1:
      raise ValueError(f"seeds must be an int >= 1; got {self.seeds!r}.")
    check_override_keys(self.base, "base override")

  def replace(self, **changes) -> Sweep:
    """A copy with fields replaced (dataclasses.replace)."""
    return dataclasses.replace(self, **changes)

  def with_overrides(self, overrides: Mapping[str, Any]) -> Sweep:
    """The sweep with `overrides` applied to the shared base (a run's own overrides still win for its keys)."""
    check_override_keys(overrides)
    return self.replace(base=merge_overrides(self.base, overrides))

  def select(self, names: Sequence[str]) -> Sweep:
    """Only the named runs (the reference is kept so gaps can still be computed)."""
    known = [r.name for r in self.runs]
    unknown = [n for n in names if n not in known]
    if unknown:
      raise ValueError(f"Unknown run(s) {unknown} in sweep {self.experiment!r}; runs: {', '.join(known)}.")
    keep = set(names) | ({self.reference} if self.reference else set())
    return self.replace(runs=tuple(r for r in self.runs if r.name in keep))

  def run_overrides(self, run: Run) -> dict[str, Any]:
    """The overrides of `run`: the base, then the run's own."""
    return merge_overrides(self.base, run.overrides)

  def config(self, run: Run, seed: int, out: str | pathlib.Path) -> TrainConfig:
    """The TrainConfig of `run` with `seed`, writing to `out` (not yet resuming or overwriting)."""
    overrides = dict(self.run_overrides(run), out=str(out), seed=seed)
    try:
      config = config_lib.config_from_overrides(overrides)
    except (TypeError, ValueError) as e:
      raise ValueError(f"Sweep {self.experiment!r}, run {run.name!r}: invalid settings: {e}") from e
    names = fp4jax.pretrain.model.layer_names(config.model)
    if config.policy.recipe.is_quantized and not config.policy.quantized_layers(names, config.model.n_layers):
      raise ValueError(f"Sweep {self.experiment!r}, run {run.name!r}: its precision policy keeps every linear layer "
                       f"of the {config.model.n_layers}-block model in BF16, so it would train the BF16 run under "
                       f"the label {run.label!r}. Use a deeper model (model.n_layers), or leave it out with --runs.")
    return config

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready description (written to OUT/sweep.json for the report)."""
    return {"experiment": self.experiment, "preset": self.preset, "seeds": self.seeds,
            "reference": self.reference, "command": self.command, "description": self.description,
            "base": jsonable(self.base),
            "runs": [{"name": r.name, "label": r.label, "overrides": jsonable(r.overrides)} for r in self.runs]}


def run_dir(out: str | pathlib.Path, run: str, seed: int) -> pathlib.Path:
  """Folder of one run x seed: OUT/<run>/seed<k>."""
  return pathlib.Path(out) / run / f"seed{seed}"


def read_summary(folder: str | pathlib.Path) -> dict[str, Any] | None:
  """The summary.json of a finished run folder, or None if it has not finished."""
  path = pathlib.Path(folder) / SUMMARY_FILE
  if not path.is_file():
    return None
  return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: pathlib.Path, data: Any) -> None:
  if not fp4jax.pretrain.distributed.is_main_process():  # multi-process sweeps: one writer
    return
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
  tmp.replace(path)  # atomic: a killed process never leaves a half-written summary


# --- provenance: what decides a run's numbers beyond its config --------------------------------------------------

def recipe_spec(recipe: fp4jax.recipes.Recipe) -> str:
  """Every field of `recipe` (formats included, defaults spelled out) but its name, a label."""
  return repr(recipe).replace(f"name={recipe.name!r}, ", "", 1)


def _unquantized_gemm_mode(recipe: fp4jax.recipes.Recipe) -> str:
  """"bf16" or "f32": the output dtype an unquantized layer's GEMM asks for (fp4jax.gemm.unquantized_output_dtype)."""
  return "bf16" if fp4jax.gemm.unquantized_output_dtype(recipe, jnp.bfloat16) == jnp.bfloat16 else "f32"


def run_gemm_mode(config: TrainConfig) -> str:
  """The GEMM mode(s) `config`'s run multiplies in on this machine, "auto" resolved: "bf16" or "f32" when every layer
  uses one, else "bf16 (BF16 layers: f32)" (quantized layers, then the BF16 ones: its BF16 blocks, BF16 pattern or
  full switch, which run fp4jax.recipes.bf16() and resolve "auto" on their own, e.g. f32 on every CPU)."""
  policy = config.policy
  high = _unquantized_gemm_mode(policy.recipe if not policy.recipe.is_quantized else fp4jax.recipes.bf16())
  if not policy.recipe.is_quantized:
    return high
  low = fp4jax.gemm.resolve_gemm_mode(policy.recipe)
  has_bf16_layers = (bool(policy.bf16_blocks(config.model.n_layers)) or policy.pattern is not None
                     or (policy.switch_at is not None and policy.switch == "all"))
  return low if low == high or not has_bf16_layers else f"{low} (BF16 layers: {high})"


def provenance(config: TrainConfig) -> dict[str, str]:
  """What a run of `config` trains under on this machine beyond its config: the recipe in full (every field, defaults
  included, e.g. sr_bits), the GEMM mode "auto" resolves to (run_gemm_mode), the jax version and the platform."""
  device = jax.devices()[0]
  return {"recipe_spec": recipe_spec(config.policy.recipe), "gemm_mode": run_gemm_mode(config),
          "jax_version": jax.__version__, "platform": f"{device.platform} ({device.device_kind})"}


def provenance_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """[(field, recorded, current)] of the checked provenance fields that differ; fields `recorded` lacks (a run stored
  before they were recorded) are not compared: see has_provenance."""
  return [(k, recorded[k], current[k]) for k in CHECKED_PROVENANCE
          if recorded.get(k) is not None and recorded[k] != current[k]]


def describe_differences(differences: Sequence[tuple[str, Any, Any]]) -> str:
  """"gemm_mode: recorded 'f32', now 'bf16'; ..." (recipe specs are long: from the field where they first differ)."""
  parts = []
  for field, old, new in differences:
    if field == "recipe_spec":
      at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
      start = max(0, old.rfind("(", 0, at) + 1, old.rfind(", ", 0, at) + 2)
      cut = lambda spec: ("..." if start else "") + spec[start:at + 30] + ("..." if at + 30 < len(spec) else "")
      parts.append(f"{field}: recorded `{cut(old)}`, now `{cut(new)}`")
    else:
      parts.append(f"{field}: recorded {old!r}, now {new!r}")
  return "; ".join(parts)


def _check_same_provenance(folder: pathlib.Path, stored: Mapping[str, Any], config: TrainConfig) -> None:
  """A finished run whose recipe defaults or resolved GEMM mode were others than this code and machine give its
  settings (a default changed since, or "auto" resolving to another mode here) is refused before anything runs."""
  changed = provenance_differences(stored, provenance(config))
  if changed:
    raise ValueError(f"{folder} holds a finished run trained under other numerics than this code gives its settings "
                     f"on this machine ({describe_differences(changed)}); delete that folder to rerun it, or use "
                     "another --out.")


def _check_same_settings(folder: pathlib.Path, stored: Mapping[str, Any], config: TrainConfig) -> None:
  # Result-free fields (marked on the config fields) and fields added or dropped since the run are not changes.
  changed = config_lib.result_differences(stored, jsonable(config.to_dict()))
  if changed:
    raise ValueError(f"{folder} holds a finished run with different settings ({', '.join(changed)}); "
                     "use another --out, or delete that folder to rerun it.")


def _check_same_finished_data(folder: pathlib.Path, stored: Mapping[str, Any], current) -> None:
  """A finished run skipped by a sweep on an edited corpus would sit in one report beside runs trained on the new
  data; refused before anything runs. `current`: () -> the sweep's DataIdentity (loaded once, when needed)."""
  if not stored.get("data"):  # finished before summaries recorded their data, or diverged: nothing to compare
    return
  recorded = fp4jax.pretrain.data.DataIdentity.from_dict(stored["data"])
  changes = fp4jax.pretrain.data.identity_changes(recorded, current())
  if changes:
    raise ValueError(
        f"{folder} holds a finished run trained on other data than this sweep's: {'; '.join(changes)}. Its results "
        f"would not compare with runs on this data: restore the corpus at {recorded.corpus!r} and repeat the "
        "command, or use another --out for a sweep on the new data.")


def _check_same_unfinished(folder: pathlib.Path, config: TrainConfig) -> None:
  """An interrupted run resumes only under its own settings: a changed one would mix two settings in one run (or,
  for a changed model, lose its checkpoints to a fresh start), so it is refused before anything runs."""
  try:
    step, meta = resume_lib.resume_meta(folder)
  except fp4jax.pretrain.checkpoint.CheckpointError:  # nothing readable to resume: that run starts afresh
    return
  changed = config_lib.result_differences(meta["config"], jsonable(config.to_dict()))
  if changed:
    raise ValueError(f"{folder} holds an unfinished run (checkpoint {step}) with different settings "
                     f"({', '.join(changed)}); rerun with its settings to finish it, use another --out, or delete "
                     "that folder to start it afresh.")
  _check_same_data(folder, step, meta, config)


def _check_same_data(folder: pathlib.Path, step: int, meta: Mapping[str, Any], config: TrainConfig) -> None:
  """The resume's data check (resume.check_data_kept), before anything runs and with advice a sweep's command can
  follow: a sweep takes no --data-changed, since runs trained on other data would no longer compare."""
  if not meta.get("data"):  # an older checkpoint: the resume itself notes it is unchecked
    return
  current = fp4jax.pretrain.data.load_dataset(config.data).identity
  try:
    resume_lib.check_data_kept(meta["data"], current, step)
  except resume_lib.DataChangedError as e:
    raise ValueError(
        f"{folder} holds an unfinished run (checkpoint {step}) trained on other data than this sweep's: "
        f"{'; '.join(e.changes)}. Restore the corpus at {e.recorded_corpus!r} and repeat the command to finish it; "
        f"or delete {folder} to rerun it from the start on this data (this sweep's finished runs may have trained "
        "on the old data: use another --out for a sweep on the new data).") from None


def steady_tokens_per_s(records: Sequence[Mapping[str, Any]]) -> float | None:
  """Median tokens/s over the step records (robust to the few steps that include compilation)."""
  rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r.get("step_time")]
  return float(np.median(rates)) if rates else None


def _summarize(sweep: Sweep, run: Run, seed: int, config: TrainConfig, folder: pathlib.Path, status: str,
               wall_time: float, summary: Mapping[str, Any] | None = None,
               diverged: trainer.TrainingDiverged | None = None) -> dict[str, Any]:
  """The summary.json of one run x seed: results, throughput, BF16 blocks, the recipe table and the full config.

  wall_time covers this process's share only when the run was resumed.
  """
  records = fp4jax.pretrain.metrics.read_metrics(folder) if (folder / fp4jax.pretrain.metrics.METRICS_FILE).is_file() else []
  val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
  tokens_per_step = config.batch_size * config.train_seq_len
  policy = config.policy
  out = {"experiment": sweep.experiment, "preset": sweep.preset, "run": run.name, "label": run.label,
         "seed": seed, "overrides": jsonable(run.overrides), "status": status, "steps": config.steps,
         "tokens_per_step": tokens_per_step, "tokens": config.steps * tokens_per_step, "wall_time": wall_time,
         "tokens_per_s": steady_tokens_per_s(records),
         "final_val_loss": summary["final_val_loss"] if summary else None,
         "final_loss": summary["final_loss"] if summary else None,
         "val_losses": {str(k): v for k, v in sorted(val.items())},
         "bf16_blocks": list(policy.bf16_blocks(config.model.n_layers)),
         "switch_step": policy.switch_step(config.steps), "recipe": str(policy.recipe), "config": config.to_dict(),
         "data": summary.get("data") if summary else None, **provenance(config)}
  if diverged is not None:
    out.update(diverged_step=diverged.step, error=str(diverged))
  return out


def check_folders(sweep: Sweep, out: str | pathlib.Path, *, existing_only: bool = False
                  ) -> dict[tuple[str, int], TrainConfig]:
  """{(run, seed): config} of every job of `sweep`; raises ValueError if a finished or interrupted run folder under
  `out` holds other settings (checked before anything runs). `existing_only`: only the jobs that left a folder
  (the runs a --runs selection leaves out need not be valid under its settings)."""
  configs = {}
  identities = {}

  def identity(data_config):  # loaded once per data config and call: every run of a sweep usually shares one
    if data_config not in identities:
      identities[data_config] = fp4jax.pretrain.data.load_dataset(data_config).identity
    return identities[data_config]

  for run in sweep.runs:
    for seed in range(sweep.seeds):
      folder = run_dir(out, run.name, seed)
      if existing_only and not folder.is_dir():
        continue
      configs[run.name, seed] = config = sweep.config(run, seed, folder)
      done = read_summary(folder)
      if done is not None:
        _check_same_settings(folder, done["config"], config)
        _check_same_provenance(folder, done, config)
        _check_same_finished_data(folder, done, lambda c=config: identity(c.data))
      elif fp4jax.pretrain.checkpoint.checkpoint_dir(folder).is_dir():
        _check_same_unfinished(folder, config)
      elif not existing_only:  # starts from step 0: what train() refuses of a new run, refused before any run
        try:
          config.check_new_run()
        except ValueError as e:
          raise ValueError(f"Sweep {sweep.experiment!r}, run {run.name!r}: {e}") from None
  return configs


def _training_settings(config: TrainConfig) -> dict[str, Any]:
  """config.to_dict() with a fractional switch_at as the step it resolves to (0.8 and 0.9 of 5 steps: both 4)."""
  settings = jsonable(config.to_dict())
  settings["policy"]["switch_at"] = config.policy.switch_step(config.steps)
  return settings


def same_settings_runs(configs: Mapping[tuple[str, int], TrainConfig]) -> list[tuple[str, str]]:
  """Pairs of runs of a sweep that would train the same thing (seed 0's configs compared, outside the result-free
  fields): the report would show one result under two labels. On purpose for a reproducibility check; by accident
  after a --set that overrides what they differ in, or fractions of the run that round to the same step."""
  settings = {run: _training_settings(c) for (run, seed), c in configs.items() if seed == 0}
  names = list(settings)
  return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
          if not config_lib.result_differences(settings[a], settings[b])]


def same_settings_note(pairs: Sequence[tuple[str, str]]) -> str:
  """What run_sweep says of `same_settings_runs`' pairs."""
  listed = "; ".join(f"{a!r} and {b!r}" for a, b in pairs)
  return (f"Note: these runs train the same model on the same settings: {listed}"
          + " (a --set that overrides what they differ in, or fractions of the run that round to the same step?): "
          "the report shows each result under two labels.")


def run_sweep(sweep: Sweep, out: str | pathlib.Path, *, log: Callable[[str], None] | None = print,
              progress: bool = True, compile_cache: steps_lib.CompileCache | None = None,
              hooks_for: Callable[[str, int], Sequence[trainer.Hook]] | None = None,
              full: Sweep | None = None) -> list[dict[str, Any]]:
  """Runs every run x seed of `sweep` under `out` that has not finished yet; returns one record per job.

  Each record: run, seed, status ("skipped": finished before; "finished"; "diverged": stopped on a non-finite
  loss, recorded as a result), out, summary (the summary.json contents). Runs that left checkpoints resume from the
  latest one. A finished or interrupted run with different settings raises ValueError before anything runs.
  `hooks_for(run, seed)` gives extra train hooks (tests use it to interrupt a sweep). `full`: the whole sweep that
  `sweep` selects runs of (--runs); its other runs' folders are checked too (the report reads every run folder
  under `out`, so none may hold other settings) and sweep.json describes it (the report's run order and labels).
  """
  log = log or (lambda _: None)
  out = pathlib.Path(out)
  previous = out / SWEEP_FILE
  if previous.is_file():  # the report reads every run folder under `out`: two experiments' runs would mix there
    other = json.loads(previous.read_text(encoding="utf-8")).get("experiment")
    if other != sweep.experiment:
      raise ValueError(f"{out} holds the {other!r} sweep ({SWEEP_FILE}), not {sweep.experiment!r}; its report "
                       "would mix the two sweeps' runs: use another --out.")
  jobs = [(run, seed) for run in sweep.runs for seed in range(sweep.seeds)]
  configs = check_folders(sweep, out)  # every config built and checked before the first run starts
  same = same_settings_runs(configs)
  if same:
    log(same_settings_note(same))
  if full is not None:
    check_folders(full, out, existing_only=True)
  out.mkdir(parents=True, exist_ok=True)
  _write_json(out / SWEEP_FILE, (full if full is not None else sweep).to_dict())
  cache = compile_cache if compile_cache is not None else steps_lib.CompileCache()

  results = []
  bar = tqdm.tqdm(jobs, desc=sweep.experiment, unit="run", disable=not progress, dynamic_ncols=True)
  for run, seed in bar:
    folder, config = run_dir(out, run.name, seed), configs[run.name, seed]
    bar.set_postfix_str(f"{run.name} seed{seed}")
    done = read_summary(folder)
    if done is not None:
      results.append({"run": run.name, "seed": seed, "status": "skipped", "out": str(folder), "summary": done})
      if not has_provenance(done):
        (tqdm.tqdm.write if progress else log)(
            f"Note: kept {folder} was finished before summaries recorded the full recipe and GEMM mode; whether this "
            "code trains it the same way could not be checked.")
      continue
    summary = _train_one(sweep, run, seed, config, folder, cache, hooks_for)
    _write_json(folder / SUMMARY_FILE, summary)
    results.append({"run": run.name, "seed": seed, "status": summary["status"], "out": str(folder),
                    "summary": summary})
    if summary["status"] != "finished":
      what = f"DIVERGED at step {summary['diverged_step']}"
    elif summary["final_val_loss"] is None:  # eval_batches=0: the run has no validation loss, and is still done
      what = f"no val_loss (eval_batches=0), final train loss {fmt(summary['final_loss'])}"
    else:
      what = f"val_loss {summary['final_val_loss']:.4f}"
    message = f"{sweep.experiment}/{run.name} seed{seed}: {what} ({summary['wall_time']:.0f}s)"
    (tqdm.tqdm.write if progress else log)(message)
  return results


def _train_one(sweep: Sweep, run: Run, seed: int, config: TrainConfig, folder: pathlib.Path,
               cache: steps_lib.CompileCache, hooks_for) -> dict[str, Any]:
  """Trains one run x seed (resuming from its checkpoints if any) and returns its summary."""
  folder.mkdir(parents=True, exist_ok=True)
  hooks = tuple(hooks_for(run.name, seed)) if hooks_for else ()
  with open(folder / LOG_FILE, "a", encoding="utf-8") as log_file:
    def write(line: str) -> None:
      log_file.write(line + "\n")
      log_file.flush()

    t0 = time.perf_counter()
    try:
      summary = None
      if fp4jax.pretrain.checkpoint.checkpoint_dir(folder).is_dir():
        try:
          summary = trainer.train(config.replace(resume=True), hooks, log=write, compile_cache=cache)
        except fp4jax.pretrain.checkpoint.CheckpointError as e:
          write(f"Could not resume ({e}); starting afresh.")
      if summary is None:
        summary = trainer.train(config.replace(overwrite=True), hooks, log=write, compile_cache=cache)
    except trainer.TrainingDiverged as e:
      write(str(e))
      return _summarize(sweep, run, seed, config, folder, "diverged", time.perf_counter() - t0, diverged=e)
  return _summarize(sweep, run, seed, config, folder, "finished", time.perf_counter() - t0, summary)
