"""Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution"; NVIDIA kvpress 0.5 `ExpectedAttentionPress`,
kvpress/presses/expected_attention_press.py, v0.5.4).

Reference definition (kvpress, defaults n_future_positions=512, n_sink=4, use_covariance=True,
use_vnorm=True, epsilon=0.0), for a cache of q_len tokens:
  1. the pre-RoPE queries of the compressed forward pass, without its first n_sink tokens
     (`hidden_states[:, n_sink:]`), give per query head a mean mu and a covariance
     Sigma = sum (q - mu)(q - mu)^T / N (N = q_len - n_sink; biased);
  2. the RoPE rotation matrix R(p) = cos_p I + sin_p P (P = rotate_half as a matrix, cos/sin the model's
     rotary embedding, its attention scaling included) is averaged over the next n_future_positions
     positions p = q_len .. q_len + n_future_positions - 1: mu <- R mu, Sigma <- R Sigma R^T;
  3. for every cached key k (post-RoPE, the first n_sink cached tokens left out) and query head:
     z = k.mu / sqrt(d) + k^T Sigma k / (2 d)  (the log of E[exp(q.k / sqrt(d))] for Gaussian q),
     softmax over the keys, then averaged over the KV head's GQA group;
  4. times the value norm: (scores + epsilon) * ||v||_2;
  5. the n_sink first tokens get max + 1 (always kept).

Here the queries come from `LayerKV.queries`, post-RoPE as the server and the harness capture them:
each is un-rotated with the model's rotary embedding (`LayerKV.rope`, exact up to fp32 rounding) at
its logical position, which gives kvpress's pre-RoPE queries. By default (`window=0`) the rule reads
the queries of every cached token, which is kvpress's whole compressed forward pass (the server and
the harness capture them all for this rule: `query_window` is `ALL_QUERIES`), and leaves out those at
positions < n_sink. The future positions start after the newest cached token (`positions[-1] + 1`; =
q_len when nothing was evicted yet).

Documented deviations:
- computed in fp32 (kvpress computes in the model's dtype, bf16 on GPU);
- sink tokens are the first n_sink cached entries, as kvpress slices them; their score max + 1 uses the
  maximum of the heads scored in the call (kvpress: of the whole batch), which ranks the same per head;
- a cache of at most n_sink tokens is kept whole (all scores 1; kvpress asserts);
- when the server re-compacts a request while decoding, the statistics come from the queries of the
  tokens cached since the last compaction (the ones the server captured), like kvpress's DecodingPress
  buffer; with prefix caching, tokens whose prefill was skipped have no captured query;
- `window=W > 0` (not kvpress's) uses the last W queries only; the trainer's evaluation on collected
  traces has only the last W prompt queries (W = the traces' window) and uses those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import ALL_QUERIES, LayerKV, Scorer, register


@register("expected_attention")
@dataclass
class ExpectedAttentionScorer(Scorer):
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    #: 0 = the queries of every cached token (kvpress); W > 0 = only the last W
    window: int = 0
    needs_queries = True
    version = 1

    def __post_init__(self) -> None:
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be at least 1; got {self.n_future_positions}")
        if self.n_sink < 0 or self.window < 0:
            raise ValueError(f"n_sink and window must be >= 0; got {self.n_sink}, {self.window}")

    @property
    def query_window(self) -> int:
        return self.window or ALL_QUERIES

    def query_statistics(self, kv: LayerKV):
        """(mu [q_heads, d], Sigma [q_heads, d, d] or None), pre-RoPE, then rotated by the mean RoPE
        rotation of the next n_future_positions positions (kvpress `get_query_statistics`)."""
        if kv.rope is None:
            raise ValueError("expected_attention needs the model's rotary embedding (LayerKV.rope) to "
                             "un-rotate the captured queries and average RoPE over future positions")
        if kv.queries is None:
            raise ValueError("this scoring rule needs the last queries; LayerKV.queries is None")
        w = min(kv.queries.shape[1], kv.length)
        if self.window:
            w = min(w, self.window)
        q_pos = kv.positions[kv.length - w:]
        q = kv.rope.unrotate(kv.queries[:, kv.queries.shape[1] - w:], q_pos)  # [Hq, w, d] pre-RoPE
        outside_sinks = q_pos >= self.n_sink  # kvpress: hidden_states[:, n_sink:]
        if bool(outside_sinks.any()):
            q = q[:, outside_sinks]
        mu = q.mean(dim=1, keepdim=True)
        cov = None
        if self.use_covariance:
            centered = q - mu
            cov = torch.einsum("hsi,hsj->hij", centered, centered) / q.shape[1]
        mu = mu.squeeze(1)
        start = int(kv.positions[-1]) + 1
        future = torch.arange(start, start + self.n_future_positions, device=q.device)
        r = kv.rope.mean_rotation(future)
        mu = mu @ r.T
        if cov is not None:
            cov = r @ cov @ r.T
        return mu, cov

    def score(self, kv: LayerKV) -> torch.Tensor:
        h, t, d = kv.num_kv_heads, kv.length, kv.head_dim
        if t <= self.n_sink:  # kvpress asserts here; nothing to rank: keep everything
            return torch.ones(h, t, device=kv.keys.device)
        mu, cov = self.query_statistics(kv)
        g = mu.shape[0] // h
        keys = kv.keys[:, self.n_sink:].float()  # [H, t', d]
        values = kv.values[:, self.n_sink:].float()
        mu = mu.reshape(h, g, d)
        z = torch.einsum("hgd,htd->hgt", mu, keys) / math.sqrt(d)
        if cov is not None:
            z = z + torch.einsum("htd,hgde,hte->hgt", keys, cov.reshape(h, g, d, d), keys) / d / 2
        scores = torch.softmax(z, dim=-1).mean(dim=1)  # [H, t']
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        out = torch.empty(h, t, device=scores.device)
        out[:, self.n_sink:] = scores
        out[:, :self.n_sink] = scores.max() + 1.0
        return out
