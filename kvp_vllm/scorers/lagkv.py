"""LagKV (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens
Are Important"). Attention-free: after the sinks, split the cache into partitions of `lag` tokens;
normalise each partition's keys and values per channel by the min/max of the *next* partition, score
each token by the std over channels of its normalised key and of its value, each softmaxed within its
partition, averaged. The sinks and the last (full + partial) partition, which has no reference, are
always kept.

Default (v2) = NVIDIA kvpress 0.5 `LagKVPress` with its default `cross_scoring=False`: the scores are
replaced by the token's rank within its partition (`score.argsort(dim=-1).argsort(dim=-1) / lag_size`),
so every partition keeps about the same share of its tokens; sinks and tail score 1. A cache shorter
than `sinks + 2 * lag` is not compressed by LagKV: the sinks score 1 and the rest `i / (T - sinks)`
(kvpress), i.e. the sinks and then the most recent tokens are kept.

Option: `cross_scoring=True` ranks the raw scores across partitions (kvpress's non-default
`cross_scoring=True`, and this rule's definition before v2, "v1"). v1 also gave every token of a short
cache the same score (ties -> the oldest tokens kept); `cross_scoring=True` uses kvpress's recency
scores there (no committed result had a cache that short).

Numerical guard (both settings, not in kvpress): a channel whose reference partition is constant
(max == min) is divided by 1e-6 instead of 0, so the scores stay finite.
"""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


def _lag_relative_score(x: torch.Tensor) -> torch.Tensor:
    """x [H, n_parts + 1, lag, d] -> [H, n_parts, lag]: softmaxed std of each partition normalised by
    the next one's per-channel min/max (kvpress `LagKVPress._get_states_score`)."""
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
    #: rank raw scores across partitions (kvpress's non-default option; this rule's v1)
    cross_scoring: bool = False
    version = 2

    def __post_init__(self) -> None:
        if self.lag < 2 or self.sinks < 0:
            raise ValueError(f"LagKV needs lag >= 2 and sinks >= 0; got lag={self.lag}, sinks={self.sinks}")

    def score(self, kv: LayerKV) -> torch.Tensor:
        h, t, d = kv.keys.shape
        dev = kv.keys.device
        scores = torch.ones(h, t, device=dev)
        if t < self.sinks + 2 * self.lag:  # too short to have a partition and its reference
            if t > self.sinks:
                scores[:, self.sinks:] = torch.arange(t - self.sinks, device=dev) / (t - self.sinks)
            return scores
        end = self.sinks + ((t - self.sinks) // self.lag) * self.lag  # partitions [sinks, end)
        span = slice(self.sinks, end)
        k = kv.keys[:, span].float().reshape(h, -1, self.lag, d)
        v = kv.values[:, span].float().reshape(h, -1, self.lag, d)
        part = (_lag_relative_score(k) + _lag_relative_score(v)) / 2  # [H, n_parts - 1, lag] in [0, 1]
        if not self.cross_scoring:
            ranks = part.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True)
            part = ranks.float() / self.lag
        # the last full partition (the reference of the one before) and the remainder stay at 1
        scores[:, self.sinks:end - self.lag] = part.reshape(h, -1)
        return scores
