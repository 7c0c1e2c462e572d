"""Run a Hugging Face causal LM and capture, per layer, the cached keys/values (post-RoPE) and the
post-RoPE queries of chosen tokens; compact a cache physically (per-head gather, positions preserved).
Used by the demo, the evaluation harness and trace collection.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .scorers import LayerKV, Rope

#: transformers RoPE types whose frequencies change with the sequence length (no fixed `Rope`).
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def _rope_of(rotary_emb, head_dim: int) -> Optional[Rope]:
    """`Rope` of a transformers rotary-embedding module (its inv_freq and attention_scaling), or None
    when it has no fixed frequencies (dynamic/longrope types) or rotates part of the head only."""
    inv_freq = getattr(rotary_emb, "inv_freq", None)
    rope_type = str(getattr(rotary_emb, "rope_type", "default"))
    if inv_freq is None or any(t in rope_type for t in _DYNAMIC_ROPE_TYPES) or 2 * inv_freq.numel() != head_dim:
        return None
    return Rope(inv_freq.detach().float().cpu().clone(), float(getattr(rotary_emb, "attention_scaling", 1.0)))


def hf_rope(model) -> Optional[Rope]:
    """The rotary embedding of a loaded Llama/Qwen2/Mistral-style Hugging Face model
    (`model.model.rotary_emb`), as a `Rope`; None if the model has none in that form."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    layers = getattr(inner, "layers", None)
    if rotary is None or not layers:
        return None
    return _rope_of(rotary, int(layers[0].self_attn.head_dim))


def config_rope(model_path) -> Optional[Rope]:
    """The rotary embedding of a Hugging Face model folder, from its config alone (no weights: the
    model's own rotary-embedding class is built from the config); None if that fails."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        rotary = type(skeleton.model.rotary_emb)(config)
        return _rope_of(rotary, int(skeleton.model.layers[0].self_attn.head_dim))
    except Exception:  # noqa: BLE001 - a folder that is gone or of another kind: no RoPE
        return None


@dataclass
class Capture:
    """What one forward pass left behind. keys/values[l]: [kv_heads, T, d]; queries[l]: [q_heads, W, d]
    for the captured tokens (the last W of the forward, or none); rope: the model's rotary embedding."""

    cache: object
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    queries: List[Optional[torch.Tensor]] = field(default_factory=list)
    logits: Optional[torch.Tensor] = None  # [1, 1, V]: the last input token's only
    rope: Optional[Rope] = None

    def layer_kv(self, layer: int, positions: Optional[torch.Tensor] = None,
                 future_importance: Optional[torch.Tensor] = None) -> LayerKV:
        t = self.keys[layer].shape[1]
        if positions is None:
            positions = torch.arange(t, device=self.keys[layer].device)
        return LayerKV(keys=self.keys[layer], values=self.values[layer], positions=positions,
                       queries=self.queries[layer] if self.queries else None,
                       future_importance=future_importance, layer=layer, rope=self.rope)


def attention_modules(model) -> list:
    layers = model.model.layers
    mods = [layer.self_attn for layer in layers]
    for m in mods:
        if not all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim")):
            raise NotImplementedError(f"{type(m).__name__} is not a Llama/Qwen2-style attention module")
    return mods


def _post_rope_queries(attn, hidden_states: torch.Tensor, position_embeddings, last: int,
                       all_rows: bool = False) -> torch.Tensor:
    """The module's own q projection + RoPE for the last `last` tokens -> [q_heads, last, d] (batch 0),
    or [B, q_heads, last, d] for every batch row with all_rows."""
    h = hidden_states[:, -last:] if all_rows else hidden_states[:1, -last:]
    q = attn.q_proj(h).view(h.shape[0], h.shape[1], -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3/Gemma-style per-head query norm
        q = attn.q_norm(q)
    cos, sin = position_embeddings
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, _ = rope(q, q, cos[:, -last:], sin[:, -last:])
    return q.detach() if all_rows else q[0].detach()


@torch.no_grad()
def forward_capture(model, input_ids: torch.Tensor, cache=None, query_last: int = 0,
                    position_ids: Optional[torch.Tensor] = None, all_rows: bool = False,
                    logits_to_keep: int = 1) -> Capture:
    """Forward `input_ids` [1, n] (optionally on top of `cache`), capturing the post-RoPE queries of
    the last `query_last` input tokens per layer. Returns the updated cache and its keys/values, and the
    last token's logits (logits for every position would cost a fifth of a 2K-token prefill; pass
    logits_to_keep=0 for all of them). With all_rows, input_ids may be [B, n] and keys/values/queries
    keep the batch dimension ([B, kv_heads, T, d], [B, q_heads, W, d])."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache()
    queries: List[Optional[torch.Tensor]] = []
    hooks = []
    if query_last > 0:
        mods = attention_modules(model)
        queries = [None] * len(mods)

        def make_hook(i):
            def hook(module, args, kwargs, output):
                hs = kwargs.get("hidden_states", args[0] if args else None)
                queries[i] = _post_rope_queries(module, hs, kwargs["position_embeddings"],
                                                min(query_last, hs.shape[1]), all_rows)
            return hook

        hooks = [m.register_forward_hook(make_hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
                    **kwargs)
    finally:
        for h in hooks:
            h.remove()
    row = slice(None) if all_rows else 0
    keys = [layer.keys[row] for layer in out.past_key_values.layers]
    values = [layer.values[row] for layer in out.past_key_values.layers]
    return Capture(cache=out.past_key_values, keys=keys, values=values, queries=queries,
                   logits=out.logits, rope=hf_rope(model))


def compact_cache(keys: List[torch.Tensor], values: List[torch.Tensor], kept: List[torch.Tensor]):
    """A new DynamicCache holding, per layer and head, only the kept entries (physically smaller).
    keys/values[l]: [kv_heads, T, d]; kept[l]: [kv_heads, b] ascending indices."""
    from transformers import DynamicCache

    from .selection import gather_kept

    data = [(gather_kept(k, idx)[None], gather_kept(v, idx)[None])
            for k, v, idx in zip(keys, values, kept)]
    return DynamicCache(ddp_cache_data=data)
