"""Serving: the `kvp-vllm serve` CLI and the vLLM plugin that evicts KV entries per request
(tail-pack compaction, freed blocks back to vLLM's pool, Prometheus metrics). See plugin.py for the
patch points, scheduler.py / worker.py for the two halves of a compaction."""
