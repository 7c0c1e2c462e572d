"""Prometheus series of the eviction feature (`kvp_` prefix, base units, `_total` counters).

They are written in the engine-core process (scheduler and worker live there with vLLM's
single-process executor) and read by the API server's `/metrics`: the `kvp-vllm` CLI points
PROMETHEUS_MULTIPROC_DIR at a fresh folder before anything imports prometheus_client, so vLLM's
`/metrics` handler aggregates every process (vLLM does the same for `--api-server-count > 1`).
Created lazily, once per process, so the multiprocess setting is already in force.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

_METRICS: Optional[SimpleNamespace] = None
_GAUGES: Optional[SimpleNamespace] = None

LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0)
FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def metrics() -> SimpleNamespace:
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Gauge, Histogram

        _METRICS = SimpleNamespace(
            selection_latency=Histogram(
                "kvp_selection_latency_seconds",
                "Time to score and select the kept tokens of one request (all layers), by rule.",
                ["rule"], buckets=LATENCY_BUCKETS),
            compaction_latency=Histogram(
                "kvp_compaction_latency_seconds",
                "Time to read, score, select and rewrite one request's KV cache (all layers).",
                ["rule"], buckets=LATENCY_BUCKETS),
            tokens_evicted=Counter(
                "kvp_tokens_evicted",
                "Token slots evicted per KV head (each evicted slot frees that token in every "
                "layer and KV head).", ["rule"]),
            blocks_freed=Counter(
                "kvp_blocks_freed", "KV cache blocks returned to vLLM's block pool by eviction.",
                ["rule"]),
            compactions=Counter(
                "kvp_compactions", "Compactions run, after prefill or during decoding.",
                ["rule", "phase"]),
            scoring_errors=Counter(
                "kvp_scoring_errors", "Layers whose scoring rule failed (recency was used instead).",
                ["rule"]),
            retained_fraction=Histogram(
                "kvp_retained_fraction",
                "Fraction of a request's tokens kept by a compaction (kept / logical length).",
                ["rule"], buckets=FRACTION_BUCKETS),
        )
    return _METRICS


def gauges() -> SimpleNamespace:
    """Block-pool gauges, created only in the scheduler's process: in multiprocess mode another
    process's never-set copy must not compete with the real value."""
    global _GAUGES
    if _GAUGES is None:
        from prometheus_client import Gauge

        _GAUGES = SimpleNamespace(
            blocks_free=Gauge(
                "kvp_kv_cache_free_blocks",
                "Free blocks in vLLM's KV block pool (cached-but-unused blocks count as free).",
                multiprocess_mode="mostrecent"),
            blocks_used=Gauge(
                "kvp_kv_cache_used_blocks", "Blocks of vLLM's KV block pool held by requests.",
                multiprocess_mode="mostrecent"),
        )
    return _GAUGES
