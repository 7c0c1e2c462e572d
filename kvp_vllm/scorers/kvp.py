"""KVP (Moschella et al., ICML 2026, "Learning to Evict from Key-Value Cache"): a learned scorer per
(layer, KV head) that reads each token's key, value and position. The weights live in
`kvp_vllm.policy.KVPPolicy`; this file only adapts it to the scoring interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .base import LayerKV, Scorer, register


@register("kvp")
@dataclass
class KVPScorer(Scorer):
    policy: Optional["KVPPolicy"] = None  # noqa: F821 - imported lazily to avoid a cycle
    checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        from ..policy import KVPPolicy

        if self.policy is None:
            if self.checkpoint is None:
                raise ValueError("the kvp rule needs a policy or a checkpoint path")
            self.policy = KVPPolicy.load(self.checkpoint)
        self.policy.eval()

    @torch.no_grad()
    def score(self, kv: LayerKV) -> torch.Tensor:
        return self.policy.score_layer(kv.layer, kv.keys, kv.values, kv.positions)
