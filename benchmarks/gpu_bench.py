"""Driver of the GPU check + benchmark: one section per process (benchmarks/gpu.sh runs them in order).

  python benchmarks/gpu_bench.py SECTION --out DIR [--budget S] [--dry]   # env check gemm quant tiles linear train loop
  python benchmarks/gpu_bench.py repeat --run K --out DIR [--dry]           # run K of the repeated train rows
  python benchmarks/gpu_bench.py repeats --out DIR                          # their min / median over the runs
  python benchmarks/gpu_bench.py record SECTION --out DIR --rc N --log FILE  # a section that died: one FAIL row
  python benchmarks/gpu_bench.py summary --out DIR                          # gpu_bench.md / .json from the rows

--dry: CPU, Pallas interpret mode, tiny sizes (checks the plumbing; timings meaningless). Rows are appended to
DIR/rows.jsonl as they are measured; tracebacks go to DIR/errors.txt. Columns: value and baseline (ratio = value /
baseline: TFLOP/s against bf16, GB/s against the copy, ms against bf16 where > 1 is slower), err (max |out - ref| /
max |ref| against the reference path, or a mismatch fraction), ok (PASS/FAIL against the row's tolerance).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SECTIONS = ("env", "check", "gemm", "quant", "tiles", "linear", "train", "repeat", "loop")
ABORT_ENV = "FP4JAX_GPU_BENCH_ABORT"  # tests: a section named here aborts like a Triton `LLVM ERROR` would


def _section_fn(name: str):
  from benchmarks.gpu import check, env, gemm, model, quant  # pylint: disable=g-import-not-at-top
  return {"env": env.run, "check": check.run, "gemm": gemm.run, "quant": quant.run, "tiles": gemm.run_tiles,
          "linear": model.run_linear, "train": model.run_train, "repeat": model.run_repeat,
          "loop": model.run_loop}[name]


def _record(out: str, section: str, rc: int, log: str | None) -> None:
  from benchmarks.gpu import report  # pylint: disable=g-import-not-at-top
  why = {124: "killed by its time limit", 137: "killed (time limit or memory)", 134: "aborted (e.g. LLVM ERROR)",
         139: "segmentation fault"}.get(rc, "exited with an error")
  tail = ""
  if log and os.path.exists(log):
    with open(log, encoding="utf-8", errors="replace") as f:
      lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    tail = " | ".join(lines[-3:])[-300:]
  note, ok = (f"rc {rc}: {why}; log: {tail}", False) if rc else ("skipped: the run's time budget was spent", None)
  report.append_row(out, dict(section=section, name=f"section {section}", value=None, unit="", baseline=None,
                              base_name="", ratio=None, err=None, ok=ok, note=note))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("section", choices=SECTIONS + ("record", "summary", "repeats"))
  parser.add_argument("name", nargs="?", help="record: the section that died")
  parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "out"))
  parser.add_argument("--budget", type=float, default=60.0, help="seconds this section may start new rows for")
  parser.add_argument("--dry", action="store_true", help="CPU, interpret mode, tiny sizes")
  parser.add_argument("--run", type=int, default=1, help="repeat: which of the separate processes this is")
  parser.add_argument("--rc", type=int, default=1)
  parser.add_argument("--log", default=None)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  if args.section == "summary":
    from benchmarks.gpu import report  # pylint: disable=g-import-not-at-top
    print(report.summary(args.out), flush=True)
    return 0
  if args.section == "repeats":
    from benchmarks.gpu import model  # pylint: disable=g-import-not-at-top
    model.summarize_runs(args.out)  # prints each row as it adds it
    return 0
  if args.section == "record":
    _record(args.out, args.name or "?", args.rc, args.log)
    return 0
  if args.dry:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if os.environ.get(ABORT_ENV) == args.section:
    print(f"LLVM ERROR: simulated abort of section {args.section} ({ABORT_ENV})", flush=True)
    os.abort()
  from benchmarks.gpu import report  # pylint: disable=g-import-not-at-top
  # Leave a few seconds of the limit for the last row's work to finish before gpu.sh's timeout.
  sec = report.Section(args.section, args.out, time.time() + args.budget - 5, args.dry, run=args.run)
  if not args.dry:
    import pallas_kernels  # pylint: disable=g-import-not-at-top
    ok, why = pallas_kernels.available(reason=True)
    if not ok and args.section != "env":
      sec.skip(f"section {args.section}", f"compiled kernels cannot run here ({why}); use --dry on CPU")
      return 0
  t0 = time.time()
  _section_fn(args.section)(sec)
  print(f"section {args.section}: {time.time() - t0:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
