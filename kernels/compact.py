"""In-place tail compaction of the paged KV cache (Triton). Reference: compact_ref.py.

Head h of a request of length L keeps b' tokens kept[0] < ... < kept[b'-1]; token j moves to slot
dst_j = L - b' + j (the block-aligned tail [L - b', L)). Because the b' - 1 - j kept tokens after
kept[j] are distinct and < L, kept[j] <= dst_j: every token moves towards the end (or stays).

Two launches over a grid (token chunks, kv_heads, requests), so every SM takes part (one program per
head would leave a batch-1 request of a 4-KV-head model on 4 SMs):

1. stage: every token whose source lies inside the tail (kept[j] >= L - b') and that moves is copied
   to a staging buffer [B, H, b', 2*head_dim] -- only those sources can be overwritten by the move;
2. move: every moving token is written to dst_j, read from the staging buffer if it was staged, else
   from its slot (< L - b', never a destination).

Race-free without any ordering inside a launch: launch 2 writes only slots in [L - b', L) and reads
from the cache only slots < L - b'; launch 1 only reads the cache. Tokens already in place are not
touched. Heads and requests touch disjoint memory. Bytes moved: K+V of each moving token read and
written once, plus twice for the tail-sourced ones (at most b' - (tokens in place)).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .compact_ref import check_kept
from .paged import cache_geometry, int32_on

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# size-dependent arguments unspecialised (no recompiles as batches change); token strides runtime
# (NHD and HND share a binary), dim strides constexpr -- see score_select.py
@triton.jit(do_not_specialize=["bt_stride", "kp_sb", "kp_sh", "sg_sb", "sg_sh"])
def _compact_kernel(cache_ptr, stage_ptr, bt_ptr, lens_ptr, counts_ptr, kept_ptr,
                    k_base, v_base, s_blk, s_head, k_st, k_sd: tl.constexpr, v_st, v_sd: tl.constexpr,
                    bt_stride, kp_sb, kp_sh, sg_sb, sg_sh,
                    PAGE: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, STAGE: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    count = tl.load(counts_ptr + b)
    if (count < length) & (c * CHUNK < count):
        first = length - count
        h64 = h.to(tl.int64)
        bt_row = bt_ptr + b.to(tl.int64) * bt_stride
        kp_row = kept_ptr + b.to(tl.int64) * kp_sb + h * kp_sh
        j = c * CHUNK + tl.arange(0, CHUNK)
        m = j < count
        src = tl.load(kp_row + j, mask=m, other=0)
        dst = first + j
        move = m & (src != dst)
        tail = src >= first
        od = tl.arange(0, D)
        staged = stage_ptr + (b.to(tl.int64) * sg_sb + h64 * sg_sh + j.to(tl.int64) * (2 * D))[:, None] \
            + od[None, :]
        if STAGE:
            sel = move & tail
            blk = tl.load(bt_row + src // PAGE, mask=sel, other=0).to(tl.int64)
            slab = blk * s_blk + h64 * s_head
            within = (src % PAGE).to(tl.int64)
            ms = sel[:, None]
            kk = tl.load(cache_ptr + k_base + (slab + within * k_st)[:, None] + od[None, :] * k_sd,
                         mask=ms)
            vv = tl.load(cache_ptr + v_base + (slab + within * v_st)[:, None] + od[None, :] * v_sd,
                         mask=ms)
            tl.store(staged, kk, mask=ms)
            tl.store(staged + D, vv, mask=ms)
        else:
            direct = move & ~tail
            blk = tl.load(bt_row + src // PAGE, mask=direct, other=0).to(tl.int64)
            slab = blk * s_blk + h64 * s_head
            within = (src % PAGE).to(tl.int64)
            md = direct[:, None]
            mt = (move & tail)[:, None]
            kk = tl.load(cache_ptr + k_base + (slab + within * k_st)[:, None] + od[None, :] * k_sd,
                         mask=md, other=0.0)
            vv = tl.load(cache_ptr + v_base + (slab + within * v_st)[:, None] + od[None, :] * v_sd,
                         mask=md, other=0.0)
            kk = tl.where(mt, tl.load(staged, mask=mt, other=0.0), kk)
            vv = tl.where(mt, tl.load(staged + D, mask=mt, other=0.0), vv)
            dblk = tl.load(bt_row + dst // PAGE, mask=move, other=0).to(tl.int64)
            d_slab = dblk * s_blk + h64 * s_head
            d_in = (dst % PAGE).to(tl.int64)
            mm = move[:, None]
            tl.store(cache_ptr + k_base + (d_slab + d_in * k_st)[:, None] + od[None, :] * k_sd, kk,
                     mask=mm)
            tl.store(cache_ptr + v_base + (d_slab + d_in * v_st)[:, None] + od[None, :] * v_sd, vv,
                     mask=mm)


class CompactLaunch:
    """Validated, device-resident inputs of one compaction (see :func:`compact_prepare`)."""

    def __init__(self, kv_cache, geometry, block_tables, lens_t, counts_t, kept, stage, freed):
        self.kv_cache, self.g, self.block_tables = kv_cache, geometry, block_tables
        self.lens_t, self.counts_t, self.kept, self.stage, self.freed = lens_t, counts_t, kept, stage, freed


def compact_prepare(kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor, seq_lens,
                    kept: torch.Tensor, counts) -> CompactLaunch:
    """Validate and move to the device what :func:`compact_launch` needs (host work: lists, checks,
    small host-to-device copies, the staging buffer)."""
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
    lens_t = int32_on(lens, dev)
    cnts_t = int32_on(cnts, dev)
    width = max([c for c, n in zip(cnts, lens) if c < n], default=0)
    stage = (torch.empty(len(lens), g.num_kv_heads, width, 2 * g.head_dim, dtype=kv_cache.dtype,
                         device=dev) if width else None)
    freed = [(length - cnt) // g.block_size if cnt < length else 0 for length, cnt in zip(lens, cnts)]
    return CompactLaunch(kv_cache, g, bt, lens_t, cnts_t, kept_d, stage, freed)


def compact_launch(p: CompactLaunch, chunk: int = 0, num_warps: int = 0) -> None:
    """The two launches (stage, move) on the current stream; no host work besides the launches."""
    if p.stage is None:   # nothing moves
        return
    g = p.g
    # GPU: CHUNK * head_dim = 2048 elements per tile (16 tokens at head_dim 128); programs are many
    # (chunks x heads x requests), so small tiles cost nothing and keep registers low
    chunk = chunk or (16 if INTERPRET else max(1, 2048 // g.head_dim))
    off = p.kv_cache.storage_offset()
    grid = (triton.cdiv(p.stage.shape[2], chunk), g.num_kv_heads, p.lens_t.shape[0])
    for phase in (1, 0):   # stage, then move (stream order separates them)
        _compact_kernel[grid](
            p.kv_cache, p.stage, p.block_tables, p.lens_t, p.counts_t, p.kept,
            g.key.base - off, g.value.base - off, g.key.block, g.key.head, g.key.token, g.key.dim,
            g.value.token, g.value.dim, p.block_tables.stride(0), p.kept.stride(0), p.kept.stride(1),
            p.stage.stride(0), p.stage.stride(1),
            PAGE=g.block_size, D=g.head_dim, CHUNK=chunk, STAGE=phase,
            num_warps=num_warps or (1 if INTERPRET else 4),
        )


def compact_triton(kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor, seq_lens,
                   kept: torch.Tensor, counts, chunk: int = 0, num_warps: int = 0) -> list:
    """Tail-pack every request (two launches: stage, move): kept [B, H, >=max b'] (ascending per
    head), counts [B] (b' per request). Returns the number of freed leading blocks per request."""
    p = compact_prepare(kv_cache, layout, block_tables, seq_lens, kept, counts)
    compact_launch(p, chunk, num_warps)
    return p.freed
