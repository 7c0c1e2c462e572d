"""LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens
Are Important"). Attention-free: after the sinks, split the cache into chunks of `lag` tokens;
normalise each chunk's keys and values per channel by the min/max of the *next* chunk, score each
token by the std over channels of its normalised key plus that of its value, each softmaxed within
its chunk. The sinks and the last (partial or reference-less) chunk are always kept.
"""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


def _lag_relative_score(x: torch.Tensor, lag: int) -> torch.Tensor:
    """x [H, n_chunks + 1, lag, d] -> [H, n_chunks, lag] softmaxed std of lag-normalised chunks."""
    ref, cur = x[:, 1:], x[:, :-1]
    lo = ref.amin(dim=2, keepdim=True)
    hi = ref.amax(dim=2, keepdim=True)
    normed = (cur - lo) / (hi - lo).clamp_min(1e-6)
    return normed.std(dim=-1).softmax(dim=-1)


@register("lagkv")
@dataclass
class LagKVScorer(Scorer):
    lag: int = 128
    sinks: int = 4

    def score(self, kv: LayerKV) -> torch.Tensor:
        h, t, d = kv.keys.shape
        # Chunks that have a full next chunk as reference; everything after them is kept.
        n_chunks = max((t - self.sinks) // self.lag - 1, 0)
        scores = torch.full((h, t), 3.0, device=kv.keys.device)  # 3 > any softmax sum of two
        if n_chunks == 0:
            return scores
        end = self.sinks + (n_chunks + 1) * self.lag
        span = slice(self.sinks, end)
        k = kv.keys[:, span].float().reshape(h, n_chunks + 1, self.lag, d)
        v = kv.values[:, span].float().reshape(h, n_chunks + 1, self.lag, d)
        chunk_scores = _lag_relative_score(k, self.lag) + _lag_relative_score(v, self.lag)
        scores[:, self.sinks:self.sinks + n_chunks * self.lag] = chunk_scores.reshape(h, -1)
        return scores
