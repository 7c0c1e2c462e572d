"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the tokens the last query
attends to most, attention averaged over the query heads of each KV head's GQA group."""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, attention_probs, register


@register("tova")
@dataclass
class TOVAScorer(Scorer):
    needs_queries = True

    @property
    def query_window(self) -> int:
        return 1

    def score(self, kv: LayerKV) -> torch.Tensor:
        q = kv.grouped_queries()[:, :, -1:]  # the last query only
        probs = attention_probs(q, kv.keys, kv.positions[-1:], kv.positions)
        return probs[:, :, 0].mean(dim=1)
