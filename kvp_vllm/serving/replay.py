"""Replay a served request's compactions in Hugging Face transformers: the exactness reference.

The server keeps, per layer and KV head, the tokens its rule picked and rewrites them into fewer
blocks. If that machinery (paged compaction, shifted attention view, logical RoPE positions) is exact,
vLLM's generation equals a plain transformers decode whose cache keeps exactly the same tokens per
layer and head at the same lengths. `record_compactions` reads what the worker kept; `hf_replay`
decodes with those caches (greedy, or teacher-forced on given tokens to compare log-probabilities).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

#: request id -> [(length L at which it compacted, kept logical positions [layers, H, keep]), ...]
History = Dict[str, List[Tuple[int, torch.Tensor]]]


def worker_eviction(llm):
    """The WorkerEviction of an in-process `vllm.LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    ev = getattr(runner, "_kvp", None)
    if ev is None:
        raise RuntimeError("this engine has no kvp-vllm worker (eviction not configured?)")
    return ev


@contextmanager
def record_compactions(llm) -> Iterator[History]:
    """Within the block, every compaction of the engine is recorded (positions copied to the CPU)."""
    ev = worker_eviction(llm)
    history: History = {}
    ev.history = history
    try:
        yield history
    finally:
        ev.history = None


@torch.no_grad()
def hf_replay(model, prompt_ids: Sequence[int], steps: int,
              compactions: Sequence[Tuple[int, torch.Tensor]] = (),
              forced: Optional[Sequence[int]] = None) -> Tuple[List[int], List[float], List[float]]:
    """Decode `steps` tokens after the prompt; before the token at position L is fed, the cache keeps
    exactly the recorded positions of each compaction made at length L.

    Returns (tokens, logprob of each token, best logprob at each step): greedy tokens, or `forced`
    (teacher forcing, e.g. vLLM's own output) when given."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    cache = DynamicCache()
    L = len(prompt_ids)
    out = model(torch.tensor([list(prompt_ids)], device=dev), past_key_values=cache, use_cache=True)
    by_length = {int(length): kept for length, kept in compactions}
    n_layers = len(cache.layers)
    heads = cache.layers[0].keys.shape[1]
    held = [torch.arange(L, device=dev).expand(heads, L) for _ in range(n_layers)]  # positions cached
    tokens, logprobs, best = [], [], []
    for step in range(steps):
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(lp.argmax()) if forced is None else int(forced[step])
        tokens.append(token)
        logprobs.append(float(lp[token]))
        best.append(float(lp.max()))
        if step == steps - 1:
            break
        position = L + step
        kept = by_length.get(position)
        if kept is not None:
            kept = kept.to(dev).long()
            for li, layer in enumerate(cache.layers):
                # index of each kept position among the entries this head holds now
                index = torch.searchsorted(held[li].contiguous(), kept[li].contiguous())
                if not torch.equal(held[li].gather(1, index), kept[li]):
                    raise ValueError(f"layer {li}: a recorded position was not in the cache")
                gather = index[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
                layer.keys = layer.keys.gather(2, gather).contiguous()
                layer.values = layer.values.gather(2, gather).contiguous()
                held[li] = kept[li]
        n_cached = held[0].shape[1]
        out = model(torch.tensor([[token]], device=dev), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[position]], device=dev),
                    attention_mask=torch.ones(1, n_cached + 1, device=dev, dtype=torch.long))
        held = [torch.cat([h, torch.full((heads, 1), position, device=dev, dtype=h.dtype)], dim=1)
                for h in held]
    return tokens, logprobs, best
