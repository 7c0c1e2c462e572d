"""In-place tail compaction of the paged KV cache (Triton). Reference: compact_ref.py.

Grid (kv_heads, requests). Head h of a request of length L keeps b' tokens kept[0] < ... < kept[b'-1];
token j moves to slot dst_j = L - b' + j. Because the b' - 1 - j kept tokens after kept[j] are distinct
and < L, kept[j] <= dst_j: every token moves towards the end (or stays).

Overlap safety: the program walks chunks of j from the last chunk to the first. A chunk's sources
are all < the smallest destination of any later chunk (kept[j] <= L - b' + j < L - b' + j0' for
every j < j0'), so no chunk reads a slot a previously processed chunk wrote. Inside a chunk all
loads happen before any store (a barrier between them), so destinations that are also sources of
the same chunk are read first. Tokens already in place (kept[j] == dst_j) are skipped. Heads and
requests touch disjoint memory (each (block, head) slab is its own; requests own their blocks).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .compact_ref import check_kept
from .paged import cache_geometry

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# size-dependent arguments unspecialised (no recompiles as batches change); token strides runtime
# (NHD and HND share a binary), dim strides constexpr -- see score_select.py
@triton.jit(do_not_specialize=["bt_stride", "kp_sb", "kp_sh"])
def _compact_kernel(cache_ptr, bt_ptr, lens_ptr, counts_ptr, kept_ptr,
                    k_base, v_base, s_blk, s_head, k_st, k_sd: tl.constexpr, v_st, v_sd: tl.constexpr,
                    bt_stride, kp_sb, kp_sh,
                    PAGE: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    count = tl.load(counts_ptr + b)
    if count < length:
        first = length - count
        bt_row = bt_ptr + b.to(tl.int64) * bt_stride
        kp_row = kept_ptr + b.to(tl.int64) * kp_sb + h * kp_sh
        od = tl.arange(0, D)
        n_chunks = tl.cdiv(count, CHUNK)
        for c in range(0, n_chunks):
            j = (n_chunks - 1 - c) * CHUNK + tl.arange(0, CHUNK)
            m = j < count
            src = tl.load(kp_row + j, mask=m, other=0)
            dst = first + j
            move = m & (src != dst)
            sblk = tl.load(bt_row + src // PAGE, mask=move, other=0).to(tl.int64)
            dblk = tl.load(bt_row + dst // PAGE, mask=move, other=0).to(tl.int64)
            s_slab = sblk * s_blk + h.to(tl.int64) * s_head
            d_slab = dblk * s_blk + h.to(tl.int64) * s_head
            s_in = (src % PAGE).to(tl.int64)
            d_in = (dst % PAGE).to(tl.int64)
            mm = move[:, None]
            ks = cache_ptr + k_base + (s_slab + s_in * k_st)[:, None] + od[None, :] * k_sd
            vs = cache_ptr + v_base + (s_slab + s_in * v_st)[:, None] + od[None, :] * v_sd
            kd = cache_ptr + k_base + (d_slab + d_in * k_st)[:, None] + od[None, :] * k_sd
            vd = cache_ptr + v_base + (d_slab + d_in * v_st)[:, None] + od[None, :] * v_sd
            kk = tl.load(ks, mask=mm)
            vv = tl.load(vs, mask=mm)
            tl.debug_barrier()
            tl.store(kd, kk, mask=mm)
            tl.store(vd, vv, mask=mm)
            tl.debug_barrier()


def compact_triton(kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor, seq_lens,
                   kept: torch.Tensor, counts, chunk: int = 0, num_warps: int = 0) -> list:
    """Tail-pack every request in one launch: kept [B, H, >=max b'] (ascending per head, int),
    counts [B] (b' per request). Returns the number of freed leading blocks per request."""
    g = cache_geometry(kv_cache, layout)
    dev = kv_cache.device
    lens = [int(x) for x in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    cnts = [int(x) for x in (counts.tolist() if torch.is_tensor(counts) else counts)]
    if kept.dim() != 3 or kept.shape[0] != len(lens) or kept.shape[1] != g.num_kv_heads:
        raise ValueError(f"kept must be [{len(lens)} requests, {g.num_kv_heads} kv_heads, b']; "
                         f"got {tuple(kept.shape)}")
    for i, (length, cnt) in enumerate(zip(lens, cnts)):
        if cnt > kept.shape[2]:
            raise ValueError(f"request {i}: count {cnt} > kept width {kept.shape[2]}")
        check_kept(kept[i, :, :cnt], length, g.block_size)
    if g.head_dim & (g.head_dim - 1):
        raise ValueError(f"head_dim must be a power of two; got {g.head_dim}")
    kept_d = kept.to(device=dev, dtype=torch.int32)
    if kept_d.stride(2) != 1:
        kept_d = kept_d.contiguous()
    bt = block_tables.to(device=dev, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    cnts_t = torch.tensor(cnts, dtype=torch.int32, device=dev)
    # GPU: CHUNK * head_dim = 4096 elements per tile keeps the kernel spill-free at 4 warps (ptxas
    # for sm_90: 232-244 registers, no stack at head_dim 64/128); 128 x 128 spills
    chunk = chunk or (16 if INTERPRET else max(16, 4096 // g.head_dim))
    off = kv_cache.storage_offset()
    _compact_kernel[(g.num_kv_heads, len(lens))](
        kv_cache, bt, lens_t, cnts_t, kept_d,
        g.key.base - off, g.value.base - off, g.key.block, g.key.head, g.key.token, g.key.dim,
        g.value.token, g.value.dim, bt.stride(0), kept_d.stride(0), kept_d.stride(1),
        PAGE=g.block_size, D=g.head_dim, CHUNK=chunk, num_warps=num_warps or (1 if INTERPRET else 4),
    )
    return [(length - cnt) // g.block_size if cnt < length else 0 for length, cnt in zip(lens, cnts)]
