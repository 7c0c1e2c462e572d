"""Oracle (evaluation only): rank by the true future importance c_i, the attention mass the answer's
queries put on each token (PAPER.md). It minimises the budget-integrated cost by construction."""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


@register("oracle")
@dataclass
class OracleScorer(Scorer):
    evaluation_only = True

    def score(self, kv: LayerKV) -> torch.Tensor:
        if kv.future_importance is None:
            raise ValueError("the oracle needs LayerKV.future_importance (evaluation only)")
        if kv.future_importance.shape != (kv.num_kv_heads, kv.length):
            raise ValueError(
                f"future_importance must be [kv_heads, T]={kv.num_kv_heads, kv.length}; "
                f"got {tuple(kv.future_importance.shape)}"
            )
        return kv.future_importance.float()
