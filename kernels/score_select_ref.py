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

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from kvp_vllm.policy import KVPPolicy, position_features, position_frequencies
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
    folded: Optional["FoldedMLP"] = None  # the CPU torch path's form (fp32 packs only), see fold_layer


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
    freqs = position_frequencies(c.pos_frequencies, device)  # what position_features uses
    packed = PackedLayer(
        wk=w(policy.key_proj.weight), bk=v(policy.key_proj.bias), gk=v(policy.key_norm.weight),
        betak=v(policy.key_norm.bias),
        wv=w(policy.value_proj.weight), bv=v(policy.value_proj.bias), gv=v(policy.value_norm.weight),
        betav=v(policy.value_norm.bias),
        wp=wp.contiguous(), bp=v(policy.pos_proj.bias), gp=v(policy.pos_norm.weight),
        betap=v(policy.pos_norm.bias),
        w0=w(hid[0].weight), b0=v(hid[0].bias), g0=v(norms[0].weight), beta0=v(norms[0].bias),
        wh=wh, bh=bh, gh=gh, betah=betah,
        wo=v(policy.out.weight), bo=v(policy.out.bias).reshape(h),
        freqs=freqs.to(device=device), eps=eps, depth=c.depth,
        num_features=npf,
    )
    if dtype == torch.float32:
        packed.folded = fold_layer(packed)
    return packed


@dataclass
class FoldedMLP:
    """A PackedLayer rewritten for few CPU memory passes (same function, fp32).

    LayerNorm(y) = (y - mean y) / sqrt(var y + eps) * g + beta. The mean subtraction is linear, so it
    is folded into the Linear before it (each weight column minus the row mean): that Linear then
    outputs centred values and LayerNorm is one RMS scaling. The key/value/position LayerNorms'
    affine (g, beta) is folded into the first hidden Linear, which reads their concatenation. Native
    LayerNorm + a separate affine were two thirds of the CPU time (several passes over [H, N, width]
    each); this form runs the same scores ~1.7x faster."""

    wk: torch.Tensor
    bk: torch.Tensor
    wv: torch.Tensor
    bv: torch.Tensor
    wp: torch.Tensor
    bp: torch.Tensor
    w0: torch.Tensor
    b0: torch.Tensor
    hidden: List[tuple]   # per hidden layer after the first: its Linear (w, b), centred
    norms: List[tuple]    # per hidden layer: its LayerNorm (g, beta), applied before SiLU
    wo: torch.Tensor
    bo: torch.Tensor
    eps: float


def _centred(w: torch.Tensor, b: torch.Tensor):
    """w [H, in, out], b [H, out] -> the Linear whose outputs have zero mean over `out`."""
    return (w - w.mean(-1, keepdim=True)).contiguous(), (b - b.mean(-1, keepdim=True))[:, None, :].contiguous()


def fold_layer(p: PackedLayer) -> FoldedMLP:
    f32 = torch.float32
    p32 = {name: getattr(p, name).to(f32) for name in ("wk", "bk", "wv", "bv", "wp", "bp", "w0", "b0",
                                                      "gk", "gv", "gp", "betak", "betav", "betap")}
    wk, bk = _centred(p32["wk"], p32["bk"])
    wv, bv = _centred(p32["wv"], p32["bv"])
    wp, bp = _centred(p32["wp"][:, :p.num_features], p32["bp"])
    g = torch.cat([p32["gk"], p32["gv"], p32["gp"]], 1)               # [H, KD+VD+PD]
    beta = torch.cat([p32["betak"], p32["betav"], p32["betap"]], 1)
    w0, b0 = _centred(p32["w0"] * g[:, :, None], p32["b0"] + torch.einsum("hi,hio->ho", beta, p32["w0"]))
    hidden = [_centred(p.wh[:, i].to(f32), p.bh[:, i]) for i in range(p.depth - 1)]
    norms = [(p.g0[:, None, :], p.beta0[:, None, :])] + [
        (p.gh[:, i, None, :], p.betah[:, i, None, :]) for i in range(p.depth - 1)]
    return FoldedMLP(wk, bk, wv, bv, wp, bp, w0, b0, hidden, norms, p.wo[:, :, None].to(f32),
                     p.bo[:, None, None], p.eps)


def _rms_scale_(y: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine of an already centred y, in place."""
    return y.mul_(y.square().mean(-1, keepdim=True).add_(eps).rsqrt_())


def mlp_ref(p: PackedLayer, keys: torch.Tensor, values: torch.Tensor, pos_feats: torch.Tensor) -> torch.Tensor:
    """Per-head MLP on packed weights (same function as ``KVPPolicy.forward``, up to fp32 rounding),
    through the FoldedMLP form. keys, values [H, N, d]; pos_feats [H or 1, N, F] -> fp32 [H, N].
    (Weights in fp32; a bf16 PackedLayer is only for the Triton path.)"""
    f = p.folded if p.folded is not None else fold_layer(p)
    h, n, _ = keys.shape
    kd, vd = f.wk.shape[2], f.wv.shape[2]
    f32 = torch.float32
    x = torch.empty(h, n, kd + vd + f.wp.shape[2], dtype=f32, device=keys.device)
    for inp, w, b, part in ((keys, f.wk, f.bk, x[..., :kd]), (values, f.wv, f.bv, x[..., kd:kd + vd]),
                            (pos_feats.expand(h, -1, -1), f.wp, f.bp, x[..., kd + vd:])):
        part.copy_(_rms_scale_(torch.baddbmm(b, inp.to(f32), w), f.eps))
    for i, (g, beta) in enumerate(f.norms):
        w, b = (f.w0, f.b0) if i == 0 else f.hidden[i - 1]
        y = _rms_scale_(torch.baddbmm(b, x, w), f.eps)
        x = F.silu(torch.addcmul(beta, y, g, out=y), inplace=True)
    return torch.baddbmm(f.bo, x, f.wo).squeeze(-1)


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
