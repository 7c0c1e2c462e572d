"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the tokens the last query
attends to most.

Default (v2) = NVIDIA kvpress 0.5 `TOVAPress` (and the TOVA paper): the last query's causal softmax
attention over the cache, averaged over ALL query heads (`attn_weights.mean(1)`), the same scores for
every KV head (`scores.repeat(1, num_key_value_heads, 1)`, so every head keeps the same tokens), and the
last token itself (the query's own key) lifted to `max + 1` so it is always kept.

Option (the definition before v2, "v1"): `per_kv_group=True` averages the attention over each KV head's
GQA group only, so each KV head keeps its own set. v1 also left the last token at its attention score
rather than lifting it; that only matters when nothing protects the recent window (`--protect none`):
with `--protect paper` `TOVAScorer(per_kv_group=True)` keeps exactly v1's tokens.
"""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, attention_probs, register


@register("tova")
@dataclass
class TOVAScorer(Scorer):
    #: average over each KV head's GQA group instead of over all query heads (v1)
    per_kv_group: bool = False
    needs_queries = True
    version = 2

    @property
    def query_window(self) -> int:
        return 1

    @property
    def one_set_for_all_heads(self) -> bool:
        return not self.per_kv_group

    def score(self, kv: LayerKV) -> torch.Tensor:
        q = kv.grouped_queries()[:, :, -1:]  # the last query only: [H, G, 1, d]
        probs = attention_probs(q, kv.keys, kv.positions[-1:], kv.positions)[:, :, 0]  # [H, G, T]
        if self.per_kv_group:
            scores = probs.mean(dim=1)
        else:
            scores = probs.mean(dim=(0, 1)).expand(kv.num_kv_heads, -1).clone()
        # kvpress: F.pad(scores, (0, 1), value=scores.max().item() + 1) for the query's own token
        scores[:, -1] = scores[:, :-1].max() + 1.0 if kv.length > 1 else 1.0
        return scores
