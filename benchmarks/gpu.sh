#!/usr/bin/env bash
# The first-run GPU check + benchmark of fp4jax's kernels, in sections, each its own process with its own time
# limit, appending rows to one result ($OUT/rows.jsonl -> gpu_bench.md / gpu_bench.json): a Triton `LLVM ERROR`
# abort, a sticky CUDA error or a timeout in one section loses only that section's remaining rows.
#   bash benchmarks/gpu.sh [--out DIR] [--budget SECONDS] [--sections env,check,...] [--dry]
# Order and limits (seconds, H200): env 20, check 60, gemm 60, quant 30, tiles 35, linear 60, train 150; the whole
# run stops starting sections when the budget (default 420 s: 7 minutes, inside the ~8 a lent GPU allows) is spent,
# and records the rest as skipped. --dry: CPU, Pallas interpret mode, tiny sizes (the plumbing test in tests/).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
BUDGET=420
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
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECTIONS="env:20 check:60 gemm:60 quant:30 tiles:35 linear:60 train:150"
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
  timeout -k 5 "$limit" "$PY" benchmarks/gpu_bench.py "$name" --out "$OUT" --budget "$limit" $DRY \
    > "$OUT/$name.log" 2>&1
  rc=$?
  grep -v "^WARNING\|DeprecationWarning\|^  return rule" "$OUT/$name.log" | tail -n 40
  if [ "$rc" -ne 0 ]; then
    "$PY" benchmarks/gpu_bench.py record "$name" --out "$OUT" --rc "$rc" --log "$OUT/$name.log"
    echo "section $name: exit code $rc (recorded)"
  fi
done
echo
echo "# fp4jax GPU check + benchmark: $(( $(date +%s) - start )) s; rows in $OUT/gpu_bench.md"
"$PY" benchmarks/gpu_bench.py summary --out "$OUT"
