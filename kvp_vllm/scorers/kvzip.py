"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction";
NVIDIA kvpress 0.5 `KVzipPress`, kvpress/presses/kvzip_press.py, v0.5.4). Evaluation only.

Reference definition (kvpress, defaults n_sink=4, chunk_size=2048, prev_postfix_size=8,
kvzip_plus_normalization=False): after the context's prefill, the model is fed, on top of the context's
cache, a reconstruction prompt and the context again, chunk by chunk (`prepare`):
  chunk 0:   "\\n\\nRepeat the previous context exactly." + chat-template suffix + chunk tokens
  chunk i>0: "\\n\\nRepeat the part of the previous context exactly, starting with" + the previous
             chunk's last prev_postfix_size tokens + suffix + chunk tokens
where the context (what is reconstructed) is the cache without the chat template's head (its
`prefix_length` tokens) and the chunks are chunk_size tokens of it. For each chunk, each layer's
post-RoPE queries of that input attend (softmax, causal among themselves) over the keys of
[the first min(n_sink, prefix_length) cached tokens] + [the chunk's own cached tokens] + [the input's
own keys]; a chunk token's score is the maximum of that attention over the KV head's query group and
over every query of the input (`attn_weights.amax(dim=(-3, -2))`). The cache is cut back to the
context after each layer (every chunk starts at position = the context length). Scores start at 0
with the first n_sink tokens at 1.0 (`score_val[..., :n_sink] = 1.0`); the chunks' scores then
overwrite their tokens, so the chat-template head's tokens after the first n_sink keep 0 (evicted
first).

That second forward pass is the harness's (`kvp_vllm.eval.protocol.kvzip_importance`, which reads this
scorer's options); this rule only ranks by it (`LayerKV.reconstruction`). It cannot be served: the
server would have to run the reconstruction pass for every request (2-3x the prefill, kvpress notes).
The harness records that extra prefill per row (`extra_prefill_tokens`, `extra_prefill_seconds`).

Documented deviations:
- every KV head keeps the same budget (the tail-pack layout needs it): kvpress's default
  (`layerwise=False`) evicts the globally lowest scores across layers and heads, so its layers and
  heads keep different numbers of tokens; the per-token scores are kvpress's;
- kvzip_plus_normalization (off by default in kvpress) is not implemented;
- the query-aware protocol reconstructs its whole cache (context + question, the chat template's
  head left out), as kvpress does when the question is compressed with the context;
- attention computed in fp32 (kvpress: the model's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


@register("kvzip")
@dataclass
class KVzipScorer(Scorer):
    n_sink: int = 4
    chunk_size: int = 2048
    prev_postfix_size: int = 8
    evaluation_only = True

    def __post_init__(self) -> None:
        if self.n_sink < 0 or self.chunk_size < 1 or self.prev_postfix_size < 0:
            raise ValueError(f"KVzip needs n_sink >= 0, chunk_size >= 1, prev_postfix_size >= 0; got "
                             f"{self.n_sink}, {self.chunk_size}, {self.prev_postfix_size}")

    def score(self, kv: LayerKV) -> torch.Tensor:
        if kv.reconstruction is None:
            raise ValueError("kvzip needs LayerKV.reconstruction, the attention of the context "
                             "reconstruction pass (evaluation only: kvp_vllm.eval.protocol.kvzip_importance)")
        if kv.reconstruction.shape != (kv.num_kv_heads, kv.length):
            raise ValueError(f"reconstruction must be [kv_heads, T]={kv.num_kv_heads, kv.length}; "
                             f"got {tuple(kv.reconstruction.shape)}")
        return kv.reconstruction.float()
