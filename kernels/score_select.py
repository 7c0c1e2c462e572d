"""Fused paged score + select (Triton). Reference: score_select_ref.py.

Two launches per layer:

1. ``_score_kernel`` — grid (token tiles, kv_heads, requests). Each program reads BLOCK_T tokens'
   keys and values straight out of the paged cache through the request's block table (no gathered
   copy; any element strides, see paged.py: vLLM's GPU layout in NHD or HND order, the CPU layout),
   builds the position features in
   registers, and runs the head's whole MLP with ``tl.dot`` (fp32 accumulation): key/value/position
   Linear+LayerNorm, the first hidden layer as three partial products (no concat), the remaining
   [Linear, LayerNorm, SiLU] blocks and the output projection. Writes fp32 scores [B, H, max_len].
2. ``_select_kernel`` — grid (kv_heads, requests). Radix select without a sort: scores are mapped to
   order-preserving integer keys (protected sinks/recent window get the largest key), four 8-bit
   histogram passes find the b'-th largest key tau and how many ties at tau to take (the first pass
   is fused into the score kernel: each tile adds its top-byte histogram atomically), then one
   compaction pass writes the kept positions in ascending order: every key > tau, plus the
   lowest-index keys == tau. This is exactly ``select_topb``'s stable sort (ties: lower index wins).

Under ``TRITON_INTERPRET=1`` (CPU tests) the dots run on fp32 operands (the interpreter's bf16 dot is
wrong).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from kvp_vllm.selection import DEFAULT_RECENT, DEFAULT_SINKS

from .paged import cache_geometry, int32_on
from .score_select_ref import PAD, PackedLayer, Selection, _as_list, _next_pow2, aligned_counts

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(x, w, PRECISION: tl.constexpr):
    if PRECISION == "bf16":
        return tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), out_dtype=tl.float32)
    elif PRECISION == "tf32":
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="tf32")
    else:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")


@triton.jit
def _layernorm(x, g_ptr, b_ptr, N: tl.constexpr, eps):
    mean = tl.sum(x, 1) / N
    xc = x - mean[:, None]
    var = tl.sum(xc * xc, 1) / N
    o = tl.arange(0, N)
    g = tl.load(g_ptr + o)
    b = tl.load(b_ptr + o)
    return xc * (1.0 / tl.sqrt(var + eps))[:, None] * g[None, :] + b[None, :]


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _scratch_linear(scratch, w_ptr, b_ptr, KIN: tl.constexpr, OUT: tl.constexpr, SW: tl.constexpr,
                    BLOCK_T: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """x @ W + b with x [BLOCK_T, KIN] read from the program's scratch tile in K-chunks of BK, so
    only a [BK, OUT] weight slice is live at a time (W [KIN, OUT] row-major)."""
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, OUT)
    acc = tl.zeros([BLOCK_T, OUT], dtype=tl.float32)
    for k0 in tl.static_range(0, KIN, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < KIN
        xa = tl.load(scratch + rows[:, None] * SW + kk[None, :], mask=km[None, :], other=0.0)
        w = tl.load(w_ptr + kk[:, None] * OUT + cols[None, :], mask=km[:, None], other=0.0)
        acc += _dot(xa, w, PRECISION)
    return acc + tl.load(b_ptr + cols)[None, :]


@triton.jit
def _paged_linear(cache_ptr, base, tok_off, d_stride, mask_t, w_ptr, b_ptr, D: tl.constexpr,
                  OUT: tl.constexpr, BLOCK_T: tl.constexpr, BK: tl.constexpr,
                  PRECISION: tl.constexpr):
    """keys (or values) @ W + b, reading the cache tile straight from the pages in K-chunks."""
    cols = tl.arange(0, OUT)
    acc = tl.zeros([BLOCK_T, OUT], dtype=tl.float32)
    for k0 in tl.static_range(0, D, BK):
        od = k0 + tl.arange(0, BK)
        x = tl.load(cache_ptr + base + tok_off[:, None] + od[None, :] * d_stride,
                    mask=mask_t[:, None], other=0.0)
        w = tl.load(w_ptr + od[:, None] * OUT + cols[None, :])
        acc += _dot(x, w, PRECISION)
    return acc + tl.load(b_ptr + cols)[None, :]


# Size-dependent integer arguments are not specialised (Triton would otherwise compile a new variant
# whenever e.g. max_len switches between a multiple of 16 and not: tens of seconds of ptxas for the
# reference-size scorer, in the middle of serving). The cache's strides stay specialised: they are
# fixed for a server and their divisibility lets the paged loads vectorise. The dim strides are
# constexpr (1 on the GPU layout, block_size for the CPU layout's transposed keys); the token strides
# are runtime values, so NHD and HND caches and models with different head counts share one binary.
_SCORE_NO_SPEC = ["bt_stride", "sc_sb", "sc_sh", "pos_stride", "pos_stride_h", "n_tiles",
                  "tiles_per_req", "num_heads", "n_sink", "n_recent"]


@triton.jit(do_not_specialize=_SCORE_NO_SPEC)
def _score_kernel(
    cache_ptr, bt_ptr, lens_ptr, pos_ptr, plen_ptr, scores_ptr, scratch_ptr, hist_ptr,
    wk, bk, gk, betak, wv, bv, gv, betav, wp, bp, gp, betap, freqs_ptr,
    w0, b0, g0, beta0, wh, bh, gh, betah, wo, bo,
    k_base, v_base, s_blk, s_head, k_st, k_sd: tl.constexpr, v_st, v_sd: tl.constexpr,
    bt_stride, sc_sb, sc_sh, pos_stride, pos_stride_h, eps, n_tiles, tiles_per_req, num_heads, n_sink, n_recent,
    PAGE: tl.constexpr, D: tl.constexpr, KD: tl.constexpr, VD: tl.constexpr, PD: tl.constexpr,
    HD: tl.constexpr, NPF: tl.constexpr, NPF_PAD: tl.constexpr, NFREQ: tl.constexpr,
    DEPTH: tl.constexpr, BLOCK_T: tl.constexpr, BK: tl.constexpr, SW: tl.constexpr,
    HAS_POS: tl.constexpr, PRECISION: tl.constexpr, FUSE_HIST: tl.constexpr,
):
    """Persistent: program p scores tiles p, p + P, ... of the (request, head, token-tile) space.
    The concat input of the first hidden layer and each hidden activation go through the program's
    own [BLOCK_T, SW] fp32 scratch tile (L1/L2 resident) so every matmul runs in K-chunks."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scratch = scratch_ptr + pid.to(tl.int64) * (BLOCK_T * SW)
    rows = tl.arange(0, BLOCK_T)
    KIN0: tl.constexpr = KD + VD + PD
    for tile in range(pid, n_tiles, nprog):
        b = tile // (num_heads * tiles_per_req)
        h = (tile // tiles_per_req) % num_heads
        t0 = (tile % tiles_per_req) * BLOCK_T
        length = tl.load(lens_ptr + b)
        if t0 < length:
            offs_t = t0 + rows
            mask_t = offs_t < length
            # ---- paged read: block table -> physical block, offset in block
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + offs_t // PAGE, mask=mask_t, other=0)
            slab = blk.to(tl.int64) * s_blk + h.to(tl.int64) * s_head
            within = (offs_t % PAGE).to(tl.int64)
            # ---- position features (position_features in policy.py)
            if HAS_POS:
                pos = tl.load(pos_ptr + b.to(tl.int64) * pos_stride + h * pos_stride_h + offs_t,
                              mask=mask_t, other=0)
                pos = pos.to(tl.float32)
                plen = tl.load(plen_ptr + b).to(tl.float32)
            else:
                pos = offs_t.to(tl.float32)
                plen = length.to(tl.float32)
            dist = (plen - 1.0) - pos
            lp = tl.log(1.0 + tl.maximum(pos, 0.0))
            ld = tl.log(1.0 + tl.maximum(dist, 0.0))
            j = tl.arange(0, NPF_PAD)
            s = j - 2
            s2 = tl.where(s >= 2 * NFREQ, s - 2 * NFREQ, s)
            s2 = tl.maximum(s2, 0)
            which = s2 // NFREQ
            fidx = s2 % NFREQ
            freq = tl.load(freqs_ptr + fidx, mask=(j >= 2) & (j < NPF), other=0.0)
            base = tl.where(which[None, :] == 0, lp[:, None], ld[:, None])
            ang = base * freq[None, :]
            trig = tl.where((s < 2 * NFREQ)[None, :], tl.sin(ang), tl.cos(ang))
            raw = tl.where((j == 0)[None, :], lp[:, None], ld[:, None]) / 10.0
            feats = tl.where((j < 2)[None, :], raw, trig)
            feats = tl.where((j < NPF)[None, :], feats, 0.0)
            # ---- input projections + LayerNorm -> scratch columns [k | v | p] (the concat);
            # each is stored as soon as it is computed so only one [BLOCK_T, width] tile is live
            tl.debug_barrier()  # the previous tile's reads of the scratch tile are done
            hk = _paged_linear(cache_ptr, k_base, slab + within * k_st, k_sd, mask_t,
                               wk + h * D * KD, bk + h * KD, D, KD, BLOCK_T, BK, PRECISION)
            hk = _layernorm(hk, gk + h * KD, betak + h * KD, KD, eps)
            tl.store(scratch + rows[:, None] * SW + tl.arange(0, KD)[None, :], hk)
            hv = _paged_linear(cache_ptr, v_base, slab + within * v_st, v_sd, mask_t,
                               wv + h * D * VD, bv + h * VD, D, VD, BLOCK_T, BK, PRECISION)
            hv = _layernorm(hv, gv + h * VD, betav + h * VD, VD, eps)
            tl.store(scratch + rows[:, None] * SW + KD + tl.arange(0, VD)[None, :], hv)
            pcols = tl.arange(0, PD)
            wpt = tl.load(wp + h * NPF_PAD * PD + j[:, None] * PD + pcols[None, :])
            hp = _dot(feats, wpt, PRECISION) + tl.load(bp + h * PD + pcols)[None, :]
            hp = _layernorm(hp, gp + h * PD, betap + h * PD, PD, eps)
            tl.store(scratch + rows[:, None] * SW + KD + VD + pcols[None, :], hp)
            tl.debug_barrier()
            # ---- hidden layers
            x = _scratch_linear(scratch, w0 + h * KIN0 * HD, b0 + h * HD, KIN0, HD, SW, BLOCK_T, BK,
                                PRECISION)
            x = _silu(_layernorm(x, g0 + h * HD, beta0 + h * HD, HD, eps))
            for i in tl.static_range(DEPTH - 1):
                gi = h * (DEPTH - 1) + i
                tl.debug_barrier()
                tl.store(scratch + rows[:, None] * SW + tl.arange(0, HD)[None, :], x)
                tl.debug_barrier()
                x = _scratch_linear(scratch, wh + gi * HD * HD, bh + gi * HD, HD, HD, SW, BLOCK_T,
                                    BK, PRECISION)
                x = _silu(_layernorm(x, gh + gi * HD, betah + gi * HD, HD, eps))
            # ---- output projection
            w_out = tl.load(wo + h * HD + tl.arange(0, HD))
            score = tl.sum(x * w_out[None, :], 1) + tl.load(bo + h)
            tl.store(scores_ptr + b.to(tl.int64) * sc_sb + h * sc_sh + offs_t, score, mask=mask_t)
            if FUSE_HIST:  # the selection's first radix pass, for free while the scores are here
                top = ((_keys_of(score, offs_t, length, n_sink, n_recent) >> 24) & 255).to(tl.int32)
                tl.atomic_add(hist_ptr + (b.to(tl.int64) * num_heads + h) * 256 + tl.arange(0, 256),
                              tl.histogram(top, 256, mask=mask_t))


@triton.jit
def _sort_keys(scores_ptr, offs, mask, length, n_sink, n_recent):
    """Order-preserving int64 keys in [0, 2^32): larger score -> larger key; protected -> 2^32-1."""
    s = tl.load(scores_ptr + offs, mask=mask, other=0.0)
    return _keys_of(s, offs, length, n_sink, n_recent)


@triton.jit
def _keys_of(s, offs, length, n_sink, n_recent):
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = bits.to(tl.int64) + 2147483648
    protected = (offs < n_sink) | (offs >= length - n_recent)
    return tl.where(protected, 4294967295, key)


@triton.jit(do_not_specialize=["sc_sb", "sc_sh", "kp_sb", "kp_sh", "n_sink", "n_recent",
                               "num_heads"])
def _select_kernel(scores_ptr, lens_ptr, counts_ptr, kept_ptr, hist_ptr, sc_sb, sc_sh, kp_sb, kp_sh,
                   n_sink, n_recent, num_heads, BLOCK: tl.constexpr, HIST_IN: tl.constexpr):
    """HIST_IN: the first (top 8 bits) histogram pass was already accumulated by the score kernel
    into hist [B, H, 256], so this kernel scans its row 4 times instead of 5."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    length = tl.load(lens_ptr + b)
    count = tl.load(counts_ptr + b)
    row = scores_ptr + b.to(tl.int64) * sc_sb + h * sc_sh
    out = kept_ptr + b.to(tl.int64) * kp_sb + h * kp_sh
    if count >= length:
        for start in range(0, length, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(out + offs, offs, mask=offs < length)
    else:
        # ---- radix select: 4 passes of 8 bits, most significant first
        prefix = tl.zeros([1], dtype=tl.int64)
        remaining = tl.zeros([1], dtype=tl.int64) + count
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):
            if HIST_IN and p == 0:
                hist = tl.load(hist_ptr + (b.to(tl.int64) * num_heads + h) * 256 + bins)
            else:
                hist = tl.zeros([256], dtype=tl.int32)
                for start in range(0, length, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    m = offs < length
                    key = _sort_keys(row, offs, m, length, n_sink, n_recent)
                    if p > 0:
                        m = m & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                    digit = ((key >> (24 - 8 * p)) & 255).to(tl.int32)
                    hist += tl.histogram(digit, 256, mask=m)
            ge = tl.cumsum(hist, 0, reverse=True)            # keys with digit >= d
            dstar = tl.max(tl.where(ge.to(tl.int64) >= remaining, bins, -1), 0)
            above = tl.sum(tl.where(bins > dstar, hist, 0), 0)
            remaining = remaining - above
            prefix = prefix + (dstar.to(tl.int64) << (24 - 8 * p))
        # ---- compaction: keys > tau, then the lowest-index ties at tau, in ascending order
        written = tl.zeros([1], dtype=tl.int32)
        ties_seen = tl.zeros([1], dtype=tl.int32)
        for start in range(0, length, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < length
            key = _sort_keys(row, offs, m, length, n_sink, n_recent)
            gt = m & (key > prefix)
            eq = m & (key == prefix)
            eq_i = eq.to(tl.int32)
            tie_rank = ties_seen + tl.cumsum(eq_i, 0) - eq_i
            take = gt | (eq & (tie_rank.to(tl.int64) < remaining))
            take_i = take.to(tl.int32)
            slot = written + tl.cumsum(take_i, 0) - take_i
            tl.store(out + slot, offs, mask=take)
            written += tl.sum(take_i, 0)
            ties_seen += tl.sum(eq_i, 0)


# ---------------------------------------------------------------------------------------------------
# Launchers


def default_precision(device: torch.device) -> str:
    """fp32 (IEEE) under the interpreter; tf32 tensor cores on GPU (bf16 is opt-in)."""
    return "ieee" if INTERPRET or device.type != "cuda" else "tf32"


def _block_t(p: PackedLayer, d: int) -> int:
    return 64  # interpreter: its cost is per program, so few large tiles; GPU: 64-row MMA tiles


def _num_warps(p: PackedLayer) -> int:
    return 8 if p.w0.shape[2] >= 256 else 4


def _num_programs(n_tiles: int, device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return max(1, min(n_tiles, 8))  # > 1 tile per program exercises the persistent loop
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, 2 * sms))


def score_triton(packed: PackedLayer, kv_cache: torch.Tensor, layout: str, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, positions: Optional[torch.Tensor] = None,
                 position_lengths: Optional[torch.Tensor] = None, precision: Optional[str] = None,
                 out: Optional[torch.Tensor] = None, block_t: Optional[int] = None,
                 block_k: Optional[int] = None, num_warps: Optional[int] = None,
                 num_programs: Optional[int] = None, hist: Optional[torch.Tensor] = None,
                 n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> torch.Tensor:
    """Scores [B, H, max_len] fp32 of every cached token (positions past a request's length are not
    written). seq_lens int32 on the cache's device. With `hist` (a zeroed int32 [B, H, 256]) the
    kernel also accumulates the selection's first radix pass (protection by n_sink / n_recent)."""
    g = cache_geometry(kv_cache, layout)
    p = packed
    bsz = block_tables.shape[0]
    h, d = g.num_kv_heads, g.head_dim
    kd, vd, pd, hd = p.wk.shape[2], p.wv.shape[2], p.wp.shape[2], p.w0.shape[2]
    for name, n in (("head_dim", d), ("key_dim", kd), ("value_dim", vd), ("pos_dim", pd),
                    ("hidden_dim", hd)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"the Triton scorer needs {name} a power of two >= 16; got {n}")
    if p.wk.shape[0] != h or p.wk.shape[1] != d:
        raise ValueError(f"policy layer is [{p.wk.shape[0]} heads, head_dim {p.wk.shape[1]}], "
                         f"cache is [{h} heads, head_dim {d}]")
    precision = precision or default_precision(kv_cache.device)
    if out is None:
        out = torch.empty(bsz, h, max_len, device=kv_cache.device, dtype=torch.float32)
    bt = block_t or _block_t(p, d)
    has_pos = positions is not None
    pos = positions if has_pos else seq_lens
    plen = position_lengths if position_lengths is not None else seq_lens
    tiles_per_req = triton.cdiv(max_len, bt)
    n_tiles = tiles_per_req * h * bsz
    nprog = num_programs or _num_programs(n_tiles, kv_cache.device)
    # interpreter: fewer, larger chunks (its cost is per op) but still several per matmul
    bk = min(block_k or (64 if INTERPRET else 32), d)
    sw = max(kd + vd + pd, hd)
    scratch = torch.empty(nprog * bt * sw, device=kv_cache.device, dtype=torch.float32)
    _score_kernel[(nprog,)](
        kv_cache, block_tables, seq_lens, pos, plen, out, scratch,
        hist if hist is not None else seq_lens,
        p.wk, p.bk, p.gk, p.betak, p.wv, p.bv, p.gv, p.betav, p.wp, p.bp, p.gp, p.betap, p.freqs,
        p.w0, p.b0, p.g0, p.beta0, p.wh, p.bh, p.gh, p.betah, p.wo, p.bo,
        g.key.base - kv_cache.storage_offset(), g.value.base - kv_cache.storage_offset(),
        g.key.block, g.key.head, g.key.token, g.key.dim, g.value.token, g.value.dim,
        block_tables.stride(0), out.stride(0), out.stride(1), pos.stride(0) if has_pos else 0,
        pos.stride(1) if has_pos and pos.dim() == 3 else 0, p.eps,
        n_tiles, tiles_per_req, h, n_sink, n_recent,
        PAGE=g.block_size, D=d, KD=kd, VD=vd, PD=pd, HD=hd, NPF=p.num_features,
        NPF_PAD=p.wp.shape[1], NFREQ=p.freqs.numel(), DEPTH=p.depth, BLOCK_T=bt, BK=bk, SW=sw,
        HAS_POS=has_pos, PRECISION=precision, FUSE_HIST=hist is not None,
        num_warps=num_warps or _num_warps(p),
    )
    return out


def select_triton(scores: torch.Tensor, seq_lens: torch.Tensor, counts: torch.Tensor, width: int,
                  n_sink: int, n_recent: int, out: Optional[torch.Tensor] = None,
                  block: Optional[int] = None, num_warps: Optional[int] = None,
                  hist: Optional[torch.Tensor] = None) -> torch.Tensor:
    """kept [B, H, width] int32 from scores [B, H, >=max_len]; entries past each count are -1.
    `hist` [B, H, 256]: the first radix pass as accumulated by score_triton(hist=...)."""
    bsz, h, _ = scores.shape
    if out is None:
        out = torch.full((bsz, h, width), PAD, device=scores.device, dtype=torch.int32)
    # one program per (request, head) walks its row 5 times (4 radix passes + compaction): large
    # chunks keep the number of dependent L2 round trips small
    blk = block or (256 if INTERPRET else 2048)
    _select_kernel[(h, bsz)](scores, seq_lens, counts, out, hist if hist is not None else counts,
                             scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
                             n_sink, n_recent, h, BLOCK=blk, HIST_IN=hist is not None,
                             num_warps=1 if INTERPRET else (num_warps or 8))
    return out


def score_select_triton(policy, layer: int, kv_cache: torch.Tensor, layout: str,
                        block_tables: torch.Tensor, seq_lens, budgets, n_sink: int, n_recent: int,
                        positions=None, position_lengths=None, return_scores: bool = False,
                        packed: Optional[PackedLayer] = None, precision: Optional[str] = None,
                        check_finite: bool = False) -> Selection:
    """The fused path behind ``kvp_vllm.kernels.paged_score_select`` on GPU tensors."""
    from .score_select_ref import pack_layer

    g = cache_geometry(kv_cache, layout)
    dev = kv_cache.device
    lens = _as_list(seq_lens)
    counts = aligned_counts(lens, budgets, g.block_size, n_sink, n_recent)
    if packed is None:
        packed = pack_layer(policy, layer, torch.float32, dev)
    lens_t = int32_on(lens, dev)
    counts_t = int32_on(counts, dev)
    bt = block_tables.to(device=dev, dtype=torch.int32)
    if positions is not None:
        positions = positions.to(device=dev, dtype=torch.int32).contiguous()
        plens = _as_list(position_lengths) if position_lengths is not None else lens
        position_lengths = int32_on(plens, dev)
    max_len = max(lens)
    hist = torch.zeros(len(lens), g.num_kv_heads, 256, dtype=torch.int32, device=dev)
    scores = score_triton(packed, kv_cache, layout, bt, lens_t, max_len, positions,
                          position_lengths, precision, hist=hist, n_sink=n_sink, n_recent=n_recent)
    if check_finite:
        valid = torch.arange(max_len, device=dev)[None, None, :] < lens_t[:, None, None]
        protected = ((torch.arange(max_len, device=dev)[None, None, :] < n_sink)
                     | (torch.arange(max_len, device=dev)[None, None, :]
                        >= lens_t[:, None, None] - n_recent))
        bad = valid & ~protected & ~torch.isfinite(scores)
        if bool(bad.any()):
            raise ValueError(f"scoring produced {int(bad.sum())} non-finite scores")
    kept = select_triton(scores, lens_t, counts_t, max(counts), n_sink, n_recent, hist=hist)
    sel = Selection(kept, torch.tensor(counts, dtype=torch.int64))
    if return_scores:
        valid = torch.arange(max_len, device=dev)[None, None, :] < lens_t[:, None, None]
        sel.scores = torch.where(valid, scores, torch.full_like(scores, float("nan")))
    return sel
