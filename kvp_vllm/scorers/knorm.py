"""K-Norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a low L2 norm attract more attention, so keep the lowest-norm keys."""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


@register("knorm")
@dataclass
class KNormScorer(Scorer):
    def score(self, kv: LayerKV) -> torch.Tensor:
        return -kv.keys.float().norm(dim=-1)
