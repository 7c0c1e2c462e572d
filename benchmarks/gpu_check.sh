#!/usr/bin/env bash
# One prepared GPU run for issue 5 (run from the repository root on the lent GPU machine):
#   1. compiled Triton kernels vs their torch references (benchmarks/gpu_check.py)
#   2. the full latency sweep with floors and the Triton config sweep (benchmarks/selection_latency.py --full)
# Results go to $OUT (the device tool's output folder) or benchmarks/results/. Both steps have their own
# time limit so the whole script fits one 10-minute call; the benchmark writes its JSON after every
# point, so a step cut short still leaves its numbers. Afterwards, on the CPU machine:
#   cp <fetched>/selection_latency_gpu.json benchmarks/results/ &&
#   python benchmarks/selection_latency.py --plot-only benchmarks/results/selection_latency_gpu.json
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/gpu_info.txt" 2>&1
cat "$OUT/gpu_info.txt"
start=$(date +%s)
check_rc=0
bench_rc=0
# Compiles dominate the first minutes (the reference-size scorer takes ptxas tens of seconds per
# config; Triton's disk cache keeps them for later calls on the same warm machine). If one call is too
# short for both steps, split them: SKIP_BENCH=1 for the first call, SKIP_CHECK=1 for the second.
if [ -z "${SKIP_CHECK:-}" ]; then
  timeout "${CHECK_TIMEOUT:-240}" python benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
  check_rc=${PIPESTATUS[0]}
  echo "gpu_check rc=$check_rc after $(( $(date +%s) - start )) s"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-320}" python benchmarks/selection_latency.py --full \
    --out "$OUT/selection_latency_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/selection_latency_gpu.log"
  bench_rc=${PIPESTATUS[0]}
  echo "benchmark rc=$bench_rc after $(( $(date +%s) - start )) s"
fi
exit $(( check_rc != 0 || bench_rc != 0 ))
