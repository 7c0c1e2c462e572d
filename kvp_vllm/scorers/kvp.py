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
    # the weights are identified apart (evaluation rows record their sha256)
    not_definition_options = ("policy", "checkpoint")

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

    @torch.no_grad()
    def score_heads(self, layer, keys, values, positions, queries=None, rope=None) -> torch.Tensor:
        """Each head with its own positions [kv_heads, T], in one call (the policy has a scorer per
        head and takes per-head positions)."""
        return self.policy.score_layer(layer, keys, values, positions)

    def select_paged(self, layer, kv_cache, layout, block_tables, seq_lens, budgets, positions,
                     position_lengths, n_sink, n_recent):
        """The fused score + select kernel (Triton on CUDA tensors, its torch reference on CPU)."""
        from ..kernels import paged_score_select

        return paged_score_select(self.policy, layer, kv_cache, layout, block_tables, seq_lens, budgets,
                                  n_sink, n_recent, positions=positions,
                                  position_lengths=position_lengths)
