"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"): keep the keys most
unlike the average direction, score = -cosine(key, mean of the L2-normalised keys), per KV head."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import LayerKV, Scorer, register


@register("keydiff")
@dataclass
class KeyDiffScorer(Scorer):
    def score(self, kv: LayerKV) -> torch.Tensor:
        keys = kv.keys.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)  # [H, 1, d]
        return -F.cosine_similarity(keys, anchor, dim=-1)
