"""The command line shared by every experiment module: `python -m experiments.NAME --preset P --out DIR [...]`.

Parses the preset, --seeds, --set overrides and --runs into a `sweep.Sweep`, runs it (`sweep.run_sweep`) and writes
the report (`experiments.report`); `--list` prints the runs and runs nothing; `--merge-into STORED` then merges the
runs into a stored results folder (`experiments.merge`).
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys
from collections.abc import Callable, Sequence

import fp4jax.pretrain.distributed
import fp4jax.pretrain.model
from fp4jax import cli_values
from fp4jax.pretrain import compile_cache

from experiments import merge
from experiments import report
from experiments.sweep import PRESETS, Sweep, check_preset, parse_overrides, run_sweep


def make_parser(prog: str, doc: str) -> argparse.ArgumentParser:
  """The command line shared by every experiment module."""
  parser = cli_values.ArgumentParser(
      prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Overrides: --set KEY=VALUE (repeatable) changes a setting shared by all runs, e.g. --set steps=100 "
             "--set model.d_model=128 --set recipe=nvfp4:rht_size=4. KEY is a TrainConfig field (see "
             "`python -m fp4jax train --help`), `model` (a preset: " + ", ".join(sorted(fp4jax.pretrain.model.MODEL_PRESETS))
             + "), model.FIELD or data.FIELD. A run's own settings (what the experiment varies) win over --set.")
  parser.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
  parser.add_argument("--out", required=True, help="sweep folder: OUT/<run>/seed<k>/, results.md, *.png")
  parser.add_argument("--seeds", type=int, default=None, help="seeds per run (default: the preset's)")
  parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a shared setting (repeatable)")
  parser.add_argument("--runs", default=None, help="comma-separated subset of runs (the reference is kept)")
  parser.add_argument("--list", action="store_true", help="print the runs and their settings, run nothing")
  parser.add_argument("--no-report", action="store_true", help="skip writing results.md and plots at the end")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  parser.add_argument("--merge-into", default=None, metavar="STORED",
                      help="after the runs, rewrite the results folder STORED (e.g. experiments/results/recipes_cpu) "
                           "with these runs' rows replacing or adding theirs, the others kept (experiments.merge)")
  return parser


def build_sweep(get_config: Callable[[str], Sweep], args: argparse.Namespace) -> Sweep:
  """The sweep a parsed command line asks for (preset, --seeds, --set, --runs applied)."""
  sweep = get_config(check_preset(args.preset))
  if args.seeds is not None:
    sweep = sweep.replace(seeds=args.seeds)
  overrides = parse_overrides(args.overrides)
  if overrides:
    sweep = sweep.with_overrides(overrides)
    for run in sweep.runs:
      kept = sorted(set(overrides) & set(run.overrides))
      if kept:
        print(f"Note: run {run.name!r} keeps its own {', '.join(kept)} (what the experiment varies).")
  return _select(sweep, args.runs)


def _select(sweep: Sweep, runs: str | None) -> Sweep:
  """The runs named in a --runs value ("a,b"), or the whole sweep without one."""
  return sweep.select([n.strip() for n in runs.split(",") if n.strip()]) if runs else sweep


def full_sweep_meta(get_config: Callable[[str], Sweep], args: argparse.Namespace) -> dict:
  """sweep.json of the whole sweep the command line's runs belong to (no --runs), as its full command runs it."""
  full = build_sweep(get_config, argparse.Namespace(**dict(vars(args), runs=None)))
  extra = ([f"--seeds {args.seeds}"] if args.seeds is not None else []) + [
      f"--set {shlex.quote(o)}" for o in args.overrides]
  return full.replace(command=" ".join([full.command] + extra)).to_dict()


def describe(sweep: Sweep) -> str:
  """The sweep's runs and shared settings, one line each."""
  lines = [f"{sweep.experiment} ({sweep.preset}): {len(sweep.runs)} runs x {sweep.seeds} seeds; "
           f"reference {sweep.reference}", f"  shared: {sweep.base}"]
  lines += [f"  {r.name:<24} {r.overrides}" for r in sweep.runs]
  return "\n".join(lines)


def main(get_config: Callable[[str], Sweep], argv: Sequence[str] | None, *, prog: str, doc: str) -> int:
  """Entry point of `python -m experiments.NAME`: parse, run the sweep, write the report; returns the exit code."""
  parser = make_parser(prog, doc)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if not args.out.strip():  # "" is the working directory: run folders and results.md would land there
    parser.error("--out needs a folder name; got an empty one.")
  if pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():  # else a FileExistsError traceback
    parser.error(f"--out {args.out} is a file, not a sweep folder.")
  fp4jax.pretrain.distributed.init_distributed()  # first JAX use; a no-op without the FP4JAX_* variables
  compile_cache.enable(log=lambda line: print(line, file=sys.stderr))  # before the first compile
  try:
    # The whole sweep too: --runs reruns some of its runs, and the others' folders must hold its settings.
    full = build_sweep(get_config, argparse.Namespace(**dict(vars(args), runs=None)))
    sweep = _select(full, args.runs)
  except ValueError as e:
    parser.error(str(e))
  sweep = sweep.replace(command=" ".join([prog] + [shlex.quote(a) for a in argv]))  # recorded in results.md
  full = full.replace(command=sweep.command)
  if args.list:
    print(describe(sweep))
    try:  # a listed sweep runs: settings its runs would refuse are refused here too
      for run in sweep.runs:
        sweep.config(run, 0, pathlib.Path(args.out) / run.name)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return 0
  print(describe(sweep))
  if args.merge_into and not (pathlib.Path(args.merge_into) / report.RESULTS_JSONL).is_file():
    print(f"error: --merge-into {args.merge_into}: no {report.RESULTS_JSONL} there to merge into.", file=sys.stderr)
    return 2
  if args.merge_into:
    try:  # refused now rather than after every run has trained
      merge.check_mergeable(args.merge_into, full_sweep_meta(get_config, args), rerun=[r.name for r in sweep.runs])
    except (ValueError, FileNotFoundError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  try:
    run_sweep(sweep, args.out, progress=not args.quiet, full=full if args.runs else None)
  except (ValueError, FileNotFoundError) as e:  # settings clash with a finished run, invalid settings, no corpus
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"Interrupted: finished runs are kept in {args.out}; repeat the command to resume.", file=sys.stderr)
    return 130
  if not args.no_report and fp4jax.pretrain.distributed.is_main_process():
    try:
      written = report.write_report(args.out)
    except ValueError as e:  # a run folder copied by hand into --out
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(f"Report: {', '.join(str(p) for p in written)}")
  if args.merge_into and fp4jax.pretrain.distributed.is_main_process():
    try:
      written = merge.merge_into(args.merge_into, args.out, full_sweep_meta(get_config, args), log=print)
    except (ValueError, FileNotFoundError) as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(f"Merged into {args.merge_into}: {', '.join(str(p) for p in written)}")
  return 0
