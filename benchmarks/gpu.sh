#!/usr/bin/env bash
# One prepared GPU check + benchmark of pallas_kernels (correctness vs XLA, quantize GB/s vs copy, FP4 GEMM TFLOP/s
# vs bf16, quantized linear fwd+bwd). Runs in ~5-7 min on an H200; everything goes under $OUT (default
# benchmarks/out). Usage, from the repository root on the GPU machine:  bash benchmarks/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,compute_cap,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv; python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"; \
  python3 -c "import triton; print('triton', triton.__version__)"; } > "$OUT/env_gpu.txt" 2>&1 || true
# Leave ~40 s of the 8-minute slot for start-up and the transfer of $OUT: the script stops starting rows at 420 s.
PYTHONPATH=. timeout 540 python3 benchmarks/gpu_bench.py --out "$OUT" --budget_s 420 "$@" 2>&1 | tee "$OUT/gpu_bench.log"
exit "${PIPESTATUS[0]}"
