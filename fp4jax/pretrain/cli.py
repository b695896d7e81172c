"""The `fp4jax` command: `fp4jax train ...`, `fp4jax eval --out RUN` and `fp4jax sample --out RUN`.

  fp4jax train --model tiny --recipe nvfp4 --steps 200 --out runs/x
  fp4jax train --model small --model.d_model 256 --recipe "nvfp4:rht_size=4,stochastic_rounding=false" --out runs/y
  fp4jax train --recipe nvfp4 --bf16-last 1 --switch-at 0.8 --out runs/z
  fp4jax train --out runs/x --resume                       (continue runs/x from its newest readable checkpoint)
  fp4jax train --out runs/x --resume --steps 400 --keep-schedule   (lengthen it: see "Resuming" below)
  fp4jax eval --out runs/x                                 (validation loss of the latest checkpoint)
  fp4jax eval --out runs/x --recipe bf16                   (the same weights, forward unquantized)
  fp4jax sample --out runs/x --prompt "ROMEO:" --tokens 200  (text from the latest checkpoint)

Resuming: --resume continues from the newest readable checkpoint in --out with the config stored in it (options
given change it); unreadable newer checkpoints are moved to <out>/checkpoints_moved/, never deleted. --resume-step N
resumes from step N and moves the later checkpoints there too. Resuming with the stored settings reproduces the
uninterrupted run bit for bit. A different --steps is a new schedule: the LR warmup/decay (and a fractional
--switch-at) are recomputed for the new length, so the result is neither the old run continued nor a fresh run of
the new length; --keep-schedule keeps the stored run's warmup and decay lengths in steps and moves the decay to the
new end (exact continuation only from a checkpoint taken before the old decay began). The corpus is the one the
checkpoint recorded, as an absolute path (a relative --data.corpus is read as it was when the run trained), and data
whose content or tokenizer differs from the checkpoint's is refused: pass --data-changed to continue on it anyway.
`fp4jax eval` reads the recorded corpus too and refuses a changed one; --corpus PATH evaluates on the named data.

Multi-process (one process per host, all with the same arguments; see fp4jax.pretrain.distributed):
  FP4JAX_COORDINATOR=host0:12377 FP4JAX_NUM_PROCESSES=2 FP4JAX_PROCESS_ID=0 fp4jax train --mesh data=2,fsdp=2 ...
Processes started with different settings (any but --data.cache_dir, --data.corpus, --progress and --log-every) all
exit with code 2 before reading data, naming the options that differ; corpora whose contents differ, once read, too.
A process whose command line, config, FP4JAX_* variables or data are invalid (a bad flag on one host) makes every
process exit with code 2 at once, each naming that process's error.
`fp4jax eval` runs the same way (every process evaluates, process 0 prints): its processes must share --out, --step,
--eval-batches and --corpus, and one that cannot parse its flags or read its checkpoint's config and data (a missing
or changed corpus on its host) makes every process exit with code 2 at once.

Compiled steps are kept in a cache folder, one per CPU type (~/.cache/fp4jax/xla-<cpu id>; FP4JAX_COMPILE_CACHE=DIR
picks another, FP4JAX_COMPILE_CACHE=off none; see fp4jax.pretrain.compile_cache): a rerun skips the compile.

Exit codes: 0 done, 1 training diverged, 2 bad arguments/config/data, unusable checkpoint, a checkpoint that could not
be written (a full disk) or processes started with different settings, 3 another process of a multi-process run
failed, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fp4jax import cli_values

EXIT_DIVERGED, EXIT_USAGE, EXIT_PEER_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 3, 130, 143  # 128 + signal


class UsageExit(SystemExit):
  """argparse's exit on a bad command line (code 2), keeping the message it printed."""

  def __init__(self, message: str):
    super().__init__(EXIT_USAGE)
    self.message = message


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors keep their message: a multi-process run tells the other processes."""

  def error(self, message):
    message = cli_values.with_option_hint(message, self)
    self.print_usage(sys.stderr)
    text = f"{self.prog}: error: {message}"
    print(text, file=sys.stderr)
    raise UsageExit(text)


def _train_parser(prog: str = "fp4jax train") -> argparse.ArgumentParser:
  from fp4jax.pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  parser = _Parser(
      prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__[__doc__.index("Resuming:"):__doc__.index("Exit codes:")].strip(),
      description="Train a transformer with quantized GEMMs (NVFP4 recipe and comparisons).\nEvery "
      "TrainConfig field is an option; with --resume the stored config is the base and the given options change it.")
  config_lib.add_config_arguments(parser)
  parser.add_argument("--keep-schedule", "--keep_schedule", dest="keep_schedule", action="store_true",
                      help="with --resume and a new --steps: keep the stored run's warmup and decay lengths in "
                      "steps (the stable phase absorbs the change) and the BF16 switch's distance from the end")
  return parser


def _eval_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="fp4jax eval", description="Validation loss of a run's checkpoint.")
  parser.add_argument("--out", required=True, help="run folder (as given to fp4jax train --out)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--eval-batches", "--eval_batches", dest="eval_batches", type=int, default=None,
                      help="validation batches (default: the run's; 4 when the run did not validate)")
  parser.add_argument("--corpus", "--data.corpus", dest="corpus", default=None,
                      help="evaluate on this corpus (default: the one the checkpoint was trained on, at the absolute "
                      "path it recorded; refused if its content changed since)")
  parser.add_argument("--recipe", default=None, help=RECIPE_HELP)
  parser.add_argument("--json", action="store_true", help="print the result as JSON")
  return parser


RECIPE_HELP = ("run this recipe (CLI form) in every layer the run's precision policy quantizes, instead of the one it "
               "trained with: e.g. bf16 for the trained weights without forward quantization, nvfp4 for a BF16 run "
               "quantized after training (BF16 layers of the policy stay BF16, a late BF16 switch is dropped; "
               "OutControl's MXFP8 channels are not used)")


def _sample_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="fp4jax sample", description="Text from a run's checkpoint, the model as it trained at "
                   "that step (its layers' recipes included); see fp4jax.pretrain.sample.")
  parser.add_argument("--out", required=True, help="run folder (as given to fp4jax train --out)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--prompt", default=None,
                      help="text to continue (default: the first 32 tokens of the held-out text)")
  parser.add_argument("--tokens", type=int, default=200, help="new tokens to draw (default 200)")
  parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (default 0.8)")
  parser.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=None,
                      help="draw among the k most likely tokens (default: all)")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
  parser.add_argument("--corpus", "--data.corpus", dest="corpus", default=None,
                      help="the checkpoint's corpus where it moved (its tokenizer decodes the text)")
  parser.add_argument("--recipe", default=None, help=RECIPE_HELP)
  parser.add_argument("--json", action="store_true", help="print the result as JSON")
  return parser


def config_from_args(argv: Sequence[str]):
  """The TrainConfig that `fp4jax train ARGV` runs (reads the stored config when --resume is given)."""
  return _build_config(*_parse_train_args(argv))


def _parse_train_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict]:
  """(args, config overrides) of `fp4jax train ARGV`, checked without reading any file."""
  from fp4jax.pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  args = _train_parser().parse_args(list(argv))
  overrides = config_lib.config_overrides(args)
  # Never a silent default folder: the run folder is the run's identity ("" would be the working directory).
  if not str(overrides.get("out", "")).strip():
    raise ValueError("fp4jax train needs --out DIR, the run folder (metrics.jsonl, checkpoints/); give a new folder "
                     "for a fresh run, or an existing run's folder with --resume.")
  # Without --resume, --resume-step was ignored: a fresh run (with --overwrite: the checkpoints deleted) instead.
  if overrides.get("resume_step") is not None and not overrides.get("resume"):
    raise ValueError(f"--resume-step {overrides['resume_step']} only applies with --resume (resume from that "
                     "checkpoint); without --resume the run would start afresh.")
  if args.keep_schedule and not overrides.get("resume"):
    raise ValueError("--keep-schedule only applies with --resume (it keeps the stored run's schedule shape).")
  if overrides.get("data_changed") and not overrides.get("resume"):
    raise ValueError("--data-changed only applies with --resume (it allows continuing a run on other data).")
  return args, overrides


def _build_config(args: argparse.Namespace, overrides: dict):
  """The TrainConfig of parsed arguments; with --resume, the stored config they change."""
  from fp4jax.pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import resume as resume_lib  # pylint: disable=g-import-not-at-top
  if not overrides.get("resume"):
    return config_lib.config_from_overrides(overrides)
  start, meta = resume_lib.resume_meta(overrides["out"], overrides.get("resume_step"))
  # The stored config holds how the run was last started: a stored --overwrite clashed with this --resume, and a
  # stored --resume-step N made every later --resume go back to step N (moving the newer checkpoints aside).
  base = config_lib.TrainConfig.from_dict(meta["config"]).replace(resume=False, resume_step=None, overwrite=False,
                                                                  data_changed=False)
  # The corpus as it was resolved when the run trained: a relative path read from here could be other text.
  if "data.corpus" not in overrides:
    corpus = resume_lib.recorded_corpus(meta, start, f"fp4jax train --out {overrides['out']} --resume")
    if corpus is not None:
      base = base.replace(**{"data.corpus": corpus})
  config = config_lib.config_from_overrides(overrides, base=base)
  if args.keep_schedule:
    both = sorted(set(overrides) & set(resume_lib.SCHEDULE_FIELDS))
    if both:
      raise ValueError(f"--keep-schedule sets {list(resume_lib.SCHEDULE_FIELDS)} from the stored run; do not "
                       f"also pass {['--' + f.replace('_', '-') for f in both]}.")
    config = resume_lib.keep_schedule(base, config, start)
  return config


def _failure(e: BaseException) -> str:
  if isinstance(e, UsageExit):
    return e.message
  if isinstance(e, SystemExit):  # --help, or a bare exit
    return f"it exited with code {e.code}"
  from fp4jax.pretrain import distributed  # pylint: disable=g-import-not-at-top
  return distributed.failure_text(e)


def _all_started(what: str, build: Callable[[], Any]) -> Any:
  """build(), after every process of a multi-process run has said whether its own build succeeded."""
  from fp4jax.pretrain import distributed  # pylint: disable=g-import-not-at-top
  return distributed.all_started(what, build, _failure)


def _run_train(argv: Sequence[str]) -> int:
  from fp4jax.pretrain import distributed  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  # Once before any file is read, once after --resume read the stored config (each process on its own: see
  # resume.resume_meta), so a process that fails either way stops all of them before their first collective.
  parsed = _all_started("parse its command line", lambda: _parse_train_args(argv))
  config = _all_started("build its run config", lambda: _build_config(*parsed))
  summary = trainer.train(config)
  if distributed.is_main_process():
    hidden = ("params", "losses", "val_losses", "layer_recipes")
    print(json.dumps({k: v for k, v in summary.items() if k not in hidden}))
  return 0


# The options of `fp4jax eval` every process of a multi-process run must share (--json only changes process 0's print).
EVAL_FLAGS = {"out": "--out", "step": "--step", "eval_batches": "--eval-batches", "corpus": "--corpus",
              "recipe": "--recipe"}


def _run_eval(argv: Sequence[str]) -> int:
  from fp4jax.pretrain import distributed  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  # As in _run_train: each process parses and reads its checkpoint's config and data on its own, and all agree on
  # that before the checkpoint restore, whose collective a process that failed alone would never join.
  args = _all_started("parse its command line", lambda: _eval_parser().parse_args(list(argv)))
  distributed.check_same_run({k: getattr(args, k) for k in EVAL_FLAGS}, EVAL_FLAGS)
  main_process = distributed.is_main_process()
  log = (lambda line: print(line, file=sys.stderr)) if main_process else None
  setup = _all_started("read its checkpoint and data", lambda: trainer.eval_setup(
      args.out, args.step, eval_batches=args.eval_batches, corpus=args.corpus, recipe=args.recipe, log=log))
  identity = setup.dataset.identity
  distributed.check_same_data(identity.to_dict() if identity is not None else None)
  result = trainer.evaluate_setup(args.out, setup)
  if not main_process:
    return 0
  if args.json:
    print(json.dumps(result))
  else:
    recipe = "" if args.recipe is None else f", recipe {result['recipe']}"
    print(f"step {result['step']}: val_loss {result['val_loss']:.6f} ({result['eval_batches']} batches{recipe})")
  return 0


def _run_sample(argv: Sequence[str]) -> int:
  from fp4jax.pretrain import sample as sample_lib  # pylint: disable=g-import-not-at-top
  args = _sample_parser().parse_args(list(argv))
  settings = sample_lib.SampleConfig(new_tokens=args.tokens, temperature=args.temperature, top_k=args.top_k,
                                     seed=args.seed)
  log = lambda line: print(line, file=sys.stderr)  # noqa: E731
  result = sample_lib.sample_run(args.out, settings, prompt=args.prompt, step=args.step, corpus=args.corpus,
                                 recipe=args.recipe, progress=sys.stderr.isatty(), log=log)
  if args.json:
    print(json.dumps(result))
    return 0
  layers = ", ".join(f"{n} {name}" for name, n in result["layers"].items())
  top_k = "all" if args.top_k is None else args.top_k
  log(f"step {result['step']} (linear layers: {layers}); temperature {args.temperature}, top-k {top_k}, "
      f"seed {args.seed}, window {result['window']}")
  print(result["prompt"] + result["text"])
  return 0


COMMANDS = {"train": _run_train, "eval": _run_eval, "sample": _run_sample}


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the `fp4jax` console script; returns the exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
    print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    if argv and argv[0] not in ("-h", "--help"):
      print(f"\nfp4jax: unknown command {argv[0]!r}{cli_values.did_you_mean(argv[0], COMMANDS)}; expected one of "
            f"{sorted(COMMANDS)}.", file=sys.stderr)
      return EXIT_USAGE
    return 0 if argv else EXIT_USAGE
  from fp4jax.pretrain import distributed  # pylint: disable=g-import-not-at-top
  try:
    # Before anything starts a JAX backend; a no-op unless the FP4JAX_* multi-process variables are set. Invalid
    # timeouts are reported in the first start check below, after joining with the defaults.
    config, timeout_error = distributed.joinable_from_env()
    multi = config is not None and distributed.init_distributed(config)
  except ValueError as e:
    print(f"fp4jax: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except RuntimeError as e:  # the coordinator or a peer did not answer within the initialization timeout
    print(f"fp4jax: error: could not join the multi-process run: {str(e)[:500]}", file=sys.stderr)
    return EXIT_PEER_FAILED
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import compile_cache  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top

  def read_environment():
    if timeout_error is not None:
      raise ValueError(timeout_error)
    if not {"-h", "--help"} & set(argv):
      compile_cache.enable(log=lambda line: print(line, file=sys.stderr))  # before the first compile

  try:
    # The first start check: a process that failed here alone left the others waiting for it in their next one.
    _all_started("read its FP4JAX_* environment variables", read_environment)
    return COMMANDS[argv[0]](argv[1:])
  except jax.errors.JaxRuntimeError as e:
    if not multi:
      raise
    # A collective failed: another process died or was unreachable. Skip jax.distributed's exit-time shutdown
    # barrier, which would wait for the dead process until the heartbeat timeout and then abort.
    print(f"fp4jax: error: process {jax.process_index()} of {jax.process_count()}: a collective failed, another "
          f"process probably died (see its log): {str(e)[:300]}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_FAILED)  # pylint: disable=protected-access
  except trainer.TrainingDiverged as e:
    print(f"fp4jax: {e}", file=sys.stderr)
    return EXIT_DIVERGED
  except trainer.Terminated:
    print("fp4jax: terminated (SIGTERM).", file=sys.stderr)
    return EXIT_TERMINATED
  except KeyboardInterrupt:
    print("fp4jax: interrupted.", file=sys.stderr)
    return EXIT_INTERRUPTED
  except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
    print(f"fp4jax: error: {e}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
