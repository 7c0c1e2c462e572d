#!/usr/bin/env bash
# The device script: everything one GPU session measures, in stages ordered by value, each writing
# JSON / logs to $OUT (the device tool's output folder; benchmarks/results/gpu/ when unset). Run from
# the repository root on the GPU host (python3 with torch + Triton; no vLLM, no network needed):
#
#   bash benchmarks/gpu_check.sh kernels   # 1. torch + Triton only: compiled kernels vs references,
#                                          #    score+select / compaction latency vs the memory floor
#   bash benchmarks/gpu_check.sh suite     # 2. install the offline vLLM bundle, run tests/gpu
#   bash benchmarks/gpu_check.sh serving   # 3. the serving benchmark (8B-shaped, random weights)
#   bash benchmarks/gpu_check.sh kernels suite serving   # all of it, when one call may run long enough
#
# The bundle (scripts/gpu_bundle.sh build) is larger than one transfer to the GPU host can carry, so
# its parts travel in .bundle/ over back-to-back calls: every stage first copies whatever parts came
# with its call into $STASH (/tmp survives between calls while the machine stays warm); `suite`
# installs once all parts are there (checksums verified; a missing part is named). Each stage has its
# own time limit so a call returns with what it measured. Commit the results under
# benchmarks/results/gpu/ with this command line.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/gpu}
STASH=${KVP_BUNDLE_STASH:-/tmp/kvp-bundle}
SITE=${KVP_GPU_SITE:-/tmp/kvp-gpu-site}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
mkdir -p "$OUT" "$STASH"
# Python runs outside the checkout: its kvp_vllm/ folder lacks the kernels mapping that an install
# (setup.py: kernels/ -> kvp_vllm.kernels) provides, and `python -m` puts the cwd first on sys.path.
WORK=$(mktemp -d /tmp/kvp-gpu-work.XXXX)
start=$(date +%s)
rc=0
elapsed() { echo $(( $(date +%s) - start )); }
log() { echo "[gpu_check +$(elapsed)s] $*"; }

stash_parts() {
  if compgen -G "$ROOT/.bundle/*" > /dev/null; then
    cp -f "$ROOT"/.bundle/* "$STASH"/ && log "stashed: $(cd "$STASH" && ls | tr '\n' ' ')"
  fi
}

info() {
  { date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
    "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  } > "$OUT/gpu_info.txt" 2>&1
  cat "$OUT/gpu_info.txt"
}

stage_kernels() {
  info
  log "kernels: compiled Triton kernels vs torch references"
  (cd "$WORK" && PYTHONPATH="$ROOT" timeout "${CHECK_TIMEOUT:-150}" "$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT") \
    > "$OUT/gpu_check.log" 2>&1 || { rc=1; log "gpu_check failed (rc=$?)"; }
  tail -n 15 "$OUT/gpu_check.log"
  log "kernels: latency sweep"
  (cd "$WORK" && PYTHONPATH="$ROOT" timeout "${BENCH_TIMEOUT:-240}" "$PY" "$ROOT/benchmarks/selection_latency.py" --full \
      --out "$OUT/selection_latency_gpu.json" ${BENCH_ARGS:-}) > "$OUT/selection_latency_gpu.log" 2>&1 \
    || { rc=1; log "latency sweep failed or was cut short (its JSON keeps the finished points)"; }
  tail -n 25 "$OUT/selection_latency_gpu.log"
}

install_bundle() {
  if [ -f "$SITE/.kvp-installed" ]; then
    return 0
  fi
  log "installing the vLLM bundle from $STASH into $SITE"
  if ! PYTHON="$PY" bash "$ROOT/scripts/gpu_bundle.sh" install "$STASH" --target "$SITE" > "$OUT/install.log" 2>&1; then
    tail -n 30 "$OUT/install.log"
    log "bundle install failed"
    return 1
  fi
  tail -n 5 "$OUT/install.log"
  touch "$SITE/.kvp-installed"
}

stage_suite() {
  install_bundle || { rc=1; return; }
  log "tests/gpu"
  (cd "$WORK" && PYTHONPATH="$SITE" VLLM_USE_V2_MODEL_RUNNER=0 timeout "${SUITE_TIMEOUT:-420}" \
      "$PY" -m pytest -q -rA -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pytest.ini" "$ROOT/tests/gpu") > "$OUT/gpu_suite.log" 2>&1 || { rc=1; log "tests/gpu failed"; }
  tail -n 40 "$OUT/gpu_suite.log"
}

stage_serving() {
  install_bundle || { rc=1; return; }
  log "serving benchmark"
  (cd "$WORK" && PYTHONPATH="$SITE" timeout "${SERVING_TIMEOUT:-500}" "$PY" "$ROOT/benchmarks/serving.py" --gpu \
      --out "$OUT" ${SERVING_ARGS:-} ${SERVING_SERVER_ARGS:+--server-args "$SERVING_SERVER_ARGS"}) \
      > "$OUT/serving_gpu.log" 2>&1 || { rc=1; log "serving benchmark failed or was cut short"; }
  tail -n 40 "$OUT/serving_gpu.log"
}

[ $# -gt 0 ] || { echo "usage: $0 {kernels|suite|serving|stash}..." >&2; exit 2; }
stash_parts
for stage in "$@"; do
  case "$stage" in
    kernels) stage_kernels ;;
    suite) stage_suite ;;
    serving) stage_serving ;;
    stash) ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
log "done, rc=$rc"
exit $rc
