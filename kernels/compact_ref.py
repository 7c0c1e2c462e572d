"""Pure-torch reference for tail compaction (the Triton kernel lives in compact.py).

After selection a request of length L keeps b' tokens per KV head. "Tail-pack" (DESIGN.md) writes
head h's j-th kept token (ascending order) to logical slot ``L - b' + j``, so the kept entries fill
the block-aligned tail ``[L - b', L)`` and the blocks ``[0, (L - b') / block_size)`` can be freed.
Every head moves its own tokens; the K and V of each token move together.

Safety when sources and destinations overlap: the reference gathers every kept entry first (a copy)
and writes afterwards, so overlap cannot corrupt anything. The kernel gets the same guarantee by
staging only the tokens whose source lies inside the destination tail, in a first launch (compact.py).
"""

from __future__ import annotations

import torch

from .paged import cache_geometry, gather_kv_tokens, scatter_kv_tokens


def check_kept(kept: torch.Tensor, seq_len: int, block_size: int) -> int:
    """Validate kept [H, b'] for a request of length seq_len; returns b'."""
    if kept.dim() != 2:
        raise ValueError(f"kept must be [kv_heads, b']; got {tuple(kept.shape)}")
    count = kept.shape[1]
    if count > seq_len:
        raise ValueError(f"{count} kept tokens for a sequence of {seq_len}")
    if count < seq_len and (seq_len - count) % block_size:
        raise ValueError(f"b'={count} is not block aligned for length {seq_len} and block size "
                         f"{block_size} (seq_len - b' must be a multiple of the block size)")
    return count


def compact_tail_ref(kv_cache: torch.Tensor, layout: str, block_table_row: torch.Tensor,
                     seq_len: int, kept: torch.Tensor) -> int:
    """Move each head's kept tokens kept [H, b'] (ascending) into the tail [seq_len - b', seq_len) of
    the request's blocks, in place. Returns the number of leading blocks now free:
    (seq_len - b') / block_size."""
    g = cache_geometry(kv_cache, layout)
    seq_len = int(seq_len)
    count = check_kept(kept, seq_len, g.block_size)
    if count >= seq_len:
        return 0
    src = kept.to(kv_cache.device, torch.long)
    dst = (seq_len - count + torch.arange(count, device=kv_cache.device)).expand_as(src)
    keys, values = gather_kv_tokens(kv_cache, layout, block_table_row, src)   # copies
    scatter_kv_tokens(kv_cache, layout, block_table_row, dst, keys, values)
    return (seq_len - count) // g.block_size


def compact_tail_batched_ref(kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor,
                             seq_lens, kept: torch.Tensor, counts) -> list:
    """:func:`compact_tail_ref` for every request: kept [B, H, >=max b'], counts [B]."""
    lens = [int(x) for x in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    cnts = [int(x) for x in (counts.tolist() if torch.is_tensor(counts) else counts)]
    return [compact_tail_ref(kv_cache, layout, block_tables[i], lens[i], kept[i, :, :cnts[i]])
            for i in range(len(lens))]
