"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

The last `window` queries vote: their causal attention is averaged over the window, smoothed along
the keys with a 1-D average pool (kernel `kernel_size`), averaged over the GQA group; the observation
window itself is always kept.
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
    needs_queries = True

    @property
    def query_window(self) -> int:
        return self.window

    def score(self, kv: LayerKV) -> torch.Tensor:
        q = kv.grouped_queries()
        w = min(self.window, q.shape[2], kv.length)
        q = q[:, :, -w:]
        probs = attention_probs(q, kv.keys, kv.positions[-w:], kv.positions)  # [H, G, w, T]
        votes = probs.mean(dim=2)  # [H, G, T]
        h, g, t = votes.shape
        pooled = F.avg_pool1d(votes.reshape(h * g, 1, t), self.kernel_size, stride=1,
                              padding=self.kernel_size // 2, count_include_pad=False)
        scores = pooled.reshape(h, g, t).mean(dim=1)
        # Keep the observation window: lift it above every attention score (which are <= 1).
        scores[:, t - w:] = 2.0 + scores[:, t - w:]
        return scores
