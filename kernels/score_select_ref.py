"""Pure-torch references for paged score + select (the Triton kernel lives in score_select.py).

Two torch paths:

* :func:`unfused_score_select` — the baseline: per request, gather K/V out of the pages
  (:func:`gather_kv`), ``policy.score_layer``, ``selection.select_topb`` (a full stable sort).
* :func:`score_select_ref` — the same computation organised like the fused kernel: every request's
  tokens scored in one batched pass with the layer's packed weights (:func:`pack_layer`), then a
  sort-free selection (:func:`threshold_select_ref`: find the b'-th key, keep everything above it and
  the lowest-index ties). It is what ``kvp_vllm.kernels.paged_score_select`` runs without a GPU.

Selection semantics (shared by all paths, defined in ``kvp_vllm.selection``): sinks ``[0, n_sink)``
and the recent window ``[L - n_recent, L)`` are lifted to +inf, then the top b' by (score desc,
index asc) are kept, returned in ascending order. b' = ``block_aligned_budget(L, budget, block_size)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from kvp_vllm.policy import KVPPolicy, position_features
from kvp_vllm.selection import (DEFAULT_RECENT, DEFAULT_SINKS, block_aligned_budget, check_budget,
                                protect, select_topb)

from .paged import cache_geometry, gather_kv

PAD = -1  # kept-index padding beyond a request's count


@dataclass
class Selection:
    """kept [B, H, max_count] int32 (ascending positions, padded with -1), counts [B] int64 (b' per
    request, equal for every head), scores [B, H, max_len] fp32 (only when asked; NaN past each length)."""

    kept: torch.Tensor
    counts: torch.Tensor
    scores: Optional[torch.Tensor] = None

    def request(self, i: int) -> torch.Tensor:
        """Kept indices [H, b'] of request i."""
        return self.kept[i, :, : int(self.counts[i])]


def _as_list(x) -> List[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def aligned_counts(seq_lens: Sequence[int], budgets: Sequence[int], block_size: int,
                   n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> List[int]:
    """b' per request (validates each budget like ``select_topb``)."""
    lens, buds = _as_list(seq_lens), _as_list(budgets)
    if len(lens) != len(buds):
        raise ValueError(f"{len(lens)} seq_lens but {len(buds)} budgets")
    out = []
    for length, budget in zip(lens, buds):
        check_budget(budget, n_sink, n_recent)
        if length < 1:
            raise ValueError(f"seq_len must be >= 1; got {length}")
        out.append(block_aligned_budget(length, budget, block_size))
    return out


def _empty_selection(batch: int, heads: int, counts: List[int], device) -> Selection:
    width = max(counts) if counts else 0
    kept = torch.full((batch, heads, width), PAD, dtype=torch.int32, device=device)
    return Selection(kept, torch.tensor(counts, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------
# The unfused baseline


def unfused_score_select(policy: KVPPolicy, layer: int, kv_cache: torch.Tensor, layout: str,
                         block_tables: torch.Tensor, seq_lens, budgets,
                         n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT,
                         return_scores: bool = False) -> Selection:
    """Baseline: gather each request's K/V, ``policy.score_layer``, ``select_topb`` (full sort)."""
    g = cache_geometry(kv_cache, layout)
    lens = _as_list(seq_lens)
    counts = aligned_counts(lens, budgets, g.block_size, n_sink, n_recent)
    sel = _empty_selection(len(lens), g.num_kv_heads, counts, kv_cache.device)
    if return_scores:
        sel.scores = torch.full((len(lens), g.num_kv_heads, max(lens)), float("nan"),
                                device=kv_cache.device)
    for i, (length, count) in enumerate(zip(lens, counts)):
        keys, values = gather_kv(kv_cache, layout, block_tables[i], length)
        pos = torch.arange(length, device=kv_cache.device)
        with torch.no_grad():
            scores = policy.score_layer(layer, keys, values, pos, length)
        # count < n_sink + n_recent only when count == length (keep everything)
        keep = select_topb(scores, max(count, n_sink + n_recent), n_sink, n_recent)
        sel.kept[i, :, :count] = keep.to(torch.int32)
        if return_scores:
            sel.scores[i, :, :length] = scores
    return sel


# ---------------------------------------------------------------------------------------------------
# Packed weights (shared with the Triton kernel)


@dataclass
class PackedLayer:
    """One layer's per-head MLP weights, contiguous, heads first. w_* are [H, in, out] in the dot dtype;
    biases and LayerNorm affine are fp32 [H, out]."""

    wk: torch.Tensor
    bk: torch.Tensor
    gk: torch.Tensor
    betak: torch.Tensor
    wv: torch.Tensor
    bv: torch.Tensor
    gv: torch.Tensor
    betav: torch.Tensor
    wp: torch.Tensor      # [H, NPF_PAD, PD] (rows past the feature count are zero)
    bp: torch.Tensor
    gp: torch.Tensor
    betap: torch.Tensor
    w0: torch.Tensor      # [H, KD+VD+PD, HD]
    b0: torch.Tensor
    g0: torch.Tensor
    beta0: torch.Tensor
    wh: torch.Tensor      # [H, max(depth-1,1), HD, HD]
    bh: torch.Tensor      # [H, max(depth-1,1), HD]
    gh: torch.Tensor
    betah: torch.Tensor
    wo: torch.Tensor      # [H, HD] fp32
    bo: torch.Tensor      # [H] fp32
    freqs: torch.Tensor   # [F] fp32, the sinusoid frequencies of position_features
    eps: float
    depth: int
    num_features: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pack_layer(policy: KVPPolicy, layer: int, dtype: torch.dtype = torch.float32,
               device=None) -> PackedLayer:
    """Slice one layer's heads out of the stacked policy and lay them out for the fused paths."""
    c = policy.config
    h = c.num_kv_heads
    sel = slice(layer * h, (layer + 1) * h)
    device = device if device is not None else policy.key_proj.weight.device

    def w(t):
        return t.detach()[sel].to(device=device, dtype=dtype).contiguous()

    def v(t):
        return t.detach()[sel].reshape(h, -1).to(device=device, dtype=torch.float32).contiguous()

    npf = c.num_position_features
    wp = torch.zeros(h, _next_pow2(npf), c.pos_dim, device=device, dtype=dtype)
    wp[:, :npf] = w(policy.pos_proj.weight)
    eps = float(policy.key_norm.eps)
    hid, norms = policy.hidden, policy.hidden_norm
    if c.depth > 1:
        wh = torch.stack([w(hid[i].weight) for i in range(1, c.depth)], 1).contiguous()
        bh = torch.stack([v(hid[i].bias) for i in range(1, c.depth)], 1).contiguous()
        gh = torch.stack([v(norms[i].weight) for i in range(1, c.depth)], 1).contiguous()
        betah = torch.stack([v(norms[i].bias) for i in range(1, c.depth)], 1).contiguous()
    else:  # placeholders, never read
        wh = torch.zeros(h, 1, c.hidden_dim, c.hidden_dim, device=device, dtype=dtype)
        bh = gh = betah = torch.zeros(h, 1, c.hidden_dim, device=device)
    # the same fp32 frequencies position_features computes
    freqs = torch.exp(torch.linspace(math.log(0.25), math.log(8.0), c.pos_frequencies))
    return PackedLayer(
        wk=w(policy.key_proj.weight), bk=v(policy.key_proj.bias), gk=v(policy.key_norm.weight),
        betak=v(policy.key_norm.bias),
        wv=w(policy.value_proj.weight), bv=v(policy.value_proj.bias), gv=v(policy.value_norm.weight),
        betav=v(policy.value_norm.bias),
        wp=wp.contiguous(), bp=v(policy.pos_proj.bias), gp=v(policy.pos_norm.weight),
        betap=v(policy.pos_norm.bias),
        w0=w(hid[0].weight), b0=v(hid[0].bias), g0=v(norms[0].weight), beta0=v(norms[0].bias),
        wh=wh, bh=bh, gh=gh, betah=betah,
        wo=v(policy.out.weight), bo=v(policy.out.bias).reshape(h),
        freqs=freqs.to(device=device, dtype=torch.float32), eps=eps, depth=c.depth,
        num_features=npf,
    )


def mlp_ref(p: PackedLayer, keys: torch.Tensor, values: torch.Tensor, pos_feats: torch.Tensor) -> torch.Tensor:
    """Per-head MLP on packed weights (same math as ``KVPPolicy.forward``), written for few memory
    passes: bias folded into baddbmm, LayerNorm affine as one addcmul written straight into its slice
    of the concat buffer, SiLU in place. keys, values [H, N, d]; pos_feats [H or 1, N, F] -> fp32 [H, N].
    (Weights in fp32; a bf16 PackedLayer is only for the Triton path.)"""
    h, n, _ = keys.shape
    kd, vd, pd, hd = p.wk.shape[2], p.wv.shape[2], p.wp.shape[2], p.w0.shape[2]
    f32 = torch.float32

    def lin(x, w, b):
        return torch.baddbmm(b[:, None, :].to(f32), x.to(f32), w.to(f32))

    def ln_affine(x, g, b, out=None):
        y = F.layer_norm(x, x.shape[-1:], eps=p.eps)
        return torch.addcmul(b[:, None, :], y, g[:, None, :], out=out)

    x = torch.empty(h, n, kd + vd + pd, dtype=f32, device=keys.device)
    ln_affine(lin(keys, p.wk, p.bk), p.gk, p.betak, out=x[..., :kd])
    ln_affine(lin(values, p.wv, p.bv), p.gv, p.betav, out=x[..., kd:kd + vd])
    pf = pos_feats.expand(h, -1, -1)
    ln_affine(lin(pf, p.wp[:, :p.num_features], p.bp), p.gp, p.betap, out=x[..., kd + vd:])
    x = F.silu(ln_affine(lin(x, p.w0, p.b0), p.g0, p.beta0), inplace=True)
    for i in range(p.depth - 1):
        x = F.silu(ln_affine(lin(x, p.wh[:, i], p.bh[:, i]), p.gh[:, i], p.betah[:, i]), inplace=True)
    return torch.baddbmm(p.bo[:, None, None], x, p.wo[:, :, None].to(f32)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# Sort-free selection (the kernel's algorithm, in torch)


def threshold_select_ref(scores: torch.Tensor, count: int, n_sink: int = DEFAULT_SINKS,
                         n_recent: int = DEFAULT_RECENT) -> torch.Tensor:
    """Same result as ``select_topb(scores, count)`` for count >= n_sink + n_recent, without a sort:
    the count-th largest protected score is the threshold; keep everything above it, then the
    lowest-index ties. scores [H, L] -> kept [H, count] ascending (int64)."""
    h, length = scores.shape
    if count >= length:
        return torch.arange(length, device=scores.device).expand(h, length).clone()
    s = protect(scores, n_sink, n_recent)
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 ties with +0.0, as in the sort
    tau = torch.kthvalue(s, length - count + 1, dim=1, keepdim=True).values   # count-th largest
    above = s > tau
    tie = s == tau
    need = count - above.sum(1, keepdim=True)
    take = above | (tie & (torch.cumsum(tie, 1) <= need))
    return torch.nonzero(take)[:, 1].reshape(h, count)


def score_select_ref(policy: KVPPolicy, layer: int, kv_cache: torch.Tensor, layout: str,
                     block_tables: torch.Tensor, seq_lens, budgets,
                     n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT,
                     positions: Optional[torch.Tensor] = None, position_lengths=None,
                     return_scores: bool = False, packed: Optional[PackedLayer] = None,
                     chunk_tokens: int = 16384) -> Selection:
    """Torch mirror of the fused kernel: all requests' tokens scored together with packed weights
    (in chunks of `chunk_tokens` tokens to bound memory), then :func:`threshold_select_ref`.

    positions [B, >=max_len] or per head [B, H, >=max_len] (optional): the position of each cache
    slot (default: the slot index; per head after an earlier compaction kept different tokens per
    head); position_lengths [B] (optional): the length those positions belong to (default: seq_len).
    """
    g = cache_geometry(kv_cache, layout)
    lens = _as_list(seq_lens)
    counts = aligned_counts(lens, budgets, g.block_size, n_sink, n_recent)
    plens = lens if position_lengths is None else _as_list(position_lengths)
    p = packed if packed is not None else pack_layer(policy, layer, torch.float32, kv_cache.device)
    dev = kv_cache.device
    sel = _empty_selection(len(lens), g.num_kv_heads, counts, dev)
    all_scores = torch.full((len(lens), g.num_kv_heads, max(lens)), float("nan"), device=dev)
    # one token list over every request: (request, position)
    keys, values, feats, owners = [], [], [], []
    for i, length in enumerate(lens):
        k, v = gather_kv(kv_cache, layout, block_tables[i], length)
        pos = (torch.arange(length, device=dev)[None] if positions is None
               else positions[i, ..., :length].to(dev).reshape(-1, length))  # [1 or H, length]
        keys.append(k)
        values.append(v)
        feats.append(position_features(pos, plens[i], policy.config.pos_frequencies))
    per_head = max(f.shape[0] for f in feats)
    keys, values = torch.cat(keys, 1), torch.cat(values, 1)
    feats = torch.cat([f.expand(per_head, -1, -1) for f in feats], 1)  # [1 or H, tokens, F]
    flat = torch.empty(g.num_kv_heads, keys.shape[1], device=dev)
    with torch.no_grad():
        for s in range(0, keys.shape[1], chunk_tokens):
            e = s + chunk_tokens
            flat[:, s:e] = mlp_ref(p, keys[:, s:e], values[:, s:e], feats[:, s:e])
    start = 0
    for i, (length, count) in enumerate(zip(lens, counts)):
        scores = flat[:, start:start + length]
        start += length
        all_scores[i, :, :length] = scores
        sel.kept[i, :, :count] = threshold_select_ref(scores, count, n_sink, n_recent).to(torch.int32)
    if return_scores:
        sel.scores = all_scores
    return sel
