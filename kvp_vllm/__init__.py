"""kvp-vllm: learned KV-cache eviction (KVP) for vLLM."""

__version__ = "0.1.0"
