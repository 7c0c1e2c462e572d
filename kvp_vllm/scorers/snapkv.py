"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

The last `window` queries vote: their causal attention is averaged over the window, smoothed along the
keys with a 1-D average pool (kernel `kernel_size`), averaged over the GQA group; the observation
window itself is always kept.

Default (v2) = NVIDIA kvpress 0.5 `SnapKVPress`: only the prefix before the window is scored
(`attn_weights[..., :-window_size]`), the pool runs over that prefix alone with its zero padding
counted in the average (`F.avg_pool1d(scores, kernel_size, padding=kernel_size // 2, stride=1)`,
torch's default `count_include_pad=True`), and every window token gets `max + 1` (so the window ranks
above the prefix; among themselves window tokens tie, and ties go to the lower index).

Options (the definition before v2, "v1" = `SnapKVScorer(pool_across_window=True,
count_include_pad=False)`): `pool_across_window=True` pools the votes of every cached token, so the
prefix's last `kernel_size // 2` tokens average in the window's (large, local) attention, and lifts the
window by 2 + its own pooled score (window tokens ranked by their votes); `count_include_pad=False`
leaves the zero padding out of the average at the edges (the first tokens' scores are not diluted).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import LayerKV, Scorer, attention_probs, register


@register("snapkv")
@dataclass
class SnapKVScorer(Scorer):
    window: int = 64
    kernel_size: int = 5
    #: pool over every cached token, the window included, and rank the window by its votes (v1)
    pool_across_window: bool = False
    #: count the pool's zero padding in the average (kvpress, torch's default); False = v1
    count_include_pad: bool = True
    needs_queries = True
    version = 2

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"the SnapKV window must be at least 1 query; got {self.window}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"the SnapKV pooling kernel must be odd (centred); got {self.kernel_size}")

    @property
    def query_window(self) -> int:
        return self.window

    def _pool(self, votes: torch.Tensor) -> torch.Tensor:
        """votes [H, G, n] -> the same shape, averaged over `kernel_size` neighbours."""
        h, g, n = votes.shape
        return F.avg_pool1d(votes.reshape(h * g, 1, n), self.kernel_size, stride=1,
                            padding=self.kernel_size // 2,
                            count_include_pad=self.count_include_pad).reshape(h, g, n)

    def score(self, kv: LayerKV) -> torch.Tensor:
        q = kv.grouped_queries()
        w = min(self.window, q.shape[2], kv.length)
        q = q[:, :, -w:]
        probs = attention_probs(q, kv.keys, kv.positions[-w:], kv.positions)  # [H, G, w, T]
        votes = probs.mean(dim=2)  # [H, G, T]
        t = kv.length
        if self.pool_across_window:
            scores = self._pool(votes).mean(dim=1)
            # Keep the observation window: lift it above every attention score (which are <= 1).
            scores[:, t - w:] = 2.0 + scores[:, t - w:]
            return scores
        scores = torch.ones(kv.num_kv_heads, t, device=votes.device)
        if t > w:
            prefix = self._pool(votes[:, :, :t - w]).mean(dim=1)  # pool, then average the group
            scores[:, :t - w] = prefix
            scores[:, t - w:] = prefix.max() + 1.0
        return scores
