"""Random eviction: a seeded uniform score per head and token (a floor every rule must beat).
The same seed, layer and length always give the same scores."""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


@register("random")
@dataclass
class RandomScorer(Scorer):
    seed: int = 0
    not_definition_options = ("seed",)  # the harness seeds it per sample

    def score(self, kv: LayerKV) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + kv.layer)
        return torch.rand(kv.num_kv_heads, kv.length, generator=gen).to(kv.keys.device)
