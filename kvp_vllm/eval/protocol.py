"""Compress-after-prefill evaluation protocol, with physical compaction of the cache.

Two protocols (PAPER.md / issue 3):
- query_aware (the paper's): prefill everything but the last prompt token, compress that cache, then
  feed the last token and generate greedily; no generated token ever sees an evicted entry.
- query_agnostic (serving a cached document): compress after the context, then feed the question and
  generate.

One prefill per sample is shared by every rule, budget and both protocols: the prompt is prefilled in
two chunks (context, then question minus its last token), so the context cache (query-agnostic) is a
prefix of the query-aware cache. Compaction is a per-head gather into a smaller cache
(`kvp_vllm.capture.compact_cache` semantics); positions of later tokens stay logical.

Efficiency without changing the result: every rule and budget of a sample runs in one padded batch
(shorter caches padded, the padding masked out), first feeding the tokens after the cache, then decoding
greedily and, from the same state, teacher-forcing the gold answer (its log-likelihood under the
compressed cache; the perplexity of the held-out text for the perplexity task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..capture import forward_capture, hf_rope
from ..importance import future_importance
from ..scorers import ALL_QUERIES, LayerKV, Rope, Scorer
from ..selection import DEFAULT_PROTECT, gather_kept, min_budget, protected_counts, select_topb

PROTOCOLS = ("query_aware", "query_agnostic")
Budget = Union[int, float]


def _cache(layers: Sequence[Tuple[torch.Tensor, torch.Tensor]], spare: int = 0):
    """A DynamicCache from per-layer (keys, values) [B, H, T, d]: the tensors themselves (no copy), or,
    with spare > 0, copied into buffers with room for `spare` more tokens (PreallocatedLayer)."""
    from transformers import DynamicCache

    if spare <= 0:
        return DynamicCache(ddp_cache_data=list(layers))
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in layers])
    cache.layers = [_preallocated_layer(k, v, spare) for k, v in layers]
    return cache


def _preallocated_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """DynamicLayer appending into spare capacity. The stock layer concatenates, copying the whole
        cache for every token fed: 70% of a batched decode step over a 1K-token cache on CPU."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int):
            super().__init__()
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self._k = self._v = None
            self._n = 0
            self._reserve(keys.shape[-2] + spare, keys, values)
            self.update(keys, values)

        def _reserve(self, capacity: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
            k = like_k.new_empty(*like_k.shape[:-2], capacity, like_k.shape[-1])
            v = like_v.new_empty(*like_v.shape[:-2], capacity, like_v.shape[-1])
            if self._n:
                k[..., :self._n, :].copy_(self.keys)
                v[..., :self._n, :].copy_(self.values)
            self._k, self._v = k, v

        def _views(self) -> None:
            self.keys, self.values = self._k[..., :self._n, :], self._v[..., :self._n, :]

        def crop(self, tokens_to_remove: int) -> None:
            """Forget the last -tokens_to_remove tokens (negative, as transformers' crop): O(1), the
            next update overwrites them."""
            if tokens_to_remove > 0:
                raise ValueError("crop takes minus the number of tokens to remove")
            self._n += tokens_to_remove
            self._views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)
            self._views()

        def update(self, key_states, value_states, *args, **kwargs):
            n, m = self._n, key_states.shape[-2]
            if n + m > self._k.shape[-2]:  # out of room: double (amortised O(1) per token)
                self._reserve(max(2 * self._k.shape[-2], n + m), key_states, value_states)
            self._k[..., n:n + m, :].copy_(key_states)
            self._v[..., n:n + m, :].copy_(value_states)
            self._n = n + m
            self._views()
            return self.keys, self.values

    return PreallocatedLayer


def _preallocated_layer(keys: torch.Tensor, values: torch.Tensor, spare: int):
    global _PREALLOCATED
    if _PREALLOCATED is None:  # transformers is imported lazily
        _PREALLOCATED = _preallocated_layer_class()
    return _PREALLOCATED(keys, values, spare)


_PREALLOCATED = None


def resolve_budget(budget: Budget, cache_len: int, protect: str = DEFAULT_PROTECT) -> int:
    """Absolute budget (int tokens) or fraction of the compressed cache (0 < f <= 1) -> tokens, at
    least the --protect mode's minimum budget."""
    minimum = min_budget(*protected_counts(protect))
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"a fractional budget must be in (0, 1]; got {budget}")
        b = int(round(budget * cache_len))
    else:
        b = int(budget)
    if b <= 0:
        raise ValueError(f"the budget must be positive; got {budget}")
    return max(b, minimum)


@dataclass
class Prefill:
    """The one prefill of a sample. keys/values[l]: [H, n-1, d] (prompt without its last token);
    q_aware[l]: queries of the last C of those n-1 tokens; q_context[l]: of the last C context tokens,
    C >= `window` (a rule reading every query, Expected Attention, has them all captured); a rule gets
    the last max(window, its query_window) of them. rope: the model's rotary embedding."""

    ids: torch.Tensor  # [n] the full prompt
    n_context: int
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    q_aware: List[torch.Tensor]
    q_context: List[torch.Tensor]
    window: int = 64
    rope: Optional[Rope] = None

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    def cache_len(self, protocol: str) -> int:
        return self.n - 1 if protocol == "query_aware" else self.n_context

    def rest_ids(self, protocol: str) -> torch.Tensor:
        """Tokens fed after compression."""
        return self.ids[self.cache_len(protocol):]

    def layer_kv(self, layer: int, protocol: str, future: Optional[torch.Tensor] = None,
                 window: Optional[int] = None, reconstruction: Optional[torch.Tensor] = None) -> LayerKV:
        """The cache a rule scores under `protocol`, with the last `window` (default: the prefill's)
        queries, the oracle's future attention and KVzip's reconstruction attention when given."""
        t = self.cache_len(protocol)
        q = self.q_aware[layer] if protocol == "query_aware" else self.q_context[layer]
        w = self.window if window is None else window
        q = q[:, max(q.shape[1] - w, 0):]
        return LayerKV(keys=self.keys[layer][:, :t], values=self.values[layer][:, :t],
                       positions=torch.arange(t), queries=q, future_importance=future, layer=layer,
                       rope=self.rope, reconstruction=reconstruction)

    def full_cache(self, protocol: str, batch: int = 1):
        t = self.cache_len(protocol)
        return _cache([(k[None, :, :t].expand(batch, -1, -1, -1).contiguous(),
                        v[None, :, :t].expand(batch, -1, -1, -1).contiguous())
                       for k, v in zip(self.keys, self.values)])


def capture_window(window: int, scorers: Sequence[Scorer] = ()) -> int:
    """Queries the prefill captures: the harness window, or more for a rule reading more (Expected
    Attention reads every cached token's query: `ALL_QUERIES`)."""
    return max([window] + [s.query_window for s in scorers if s.needs_queries])


@torch.no_grad()
def prefill(model, prompt_ids: Sequence[int], n_context: int, window: int = 64,
            capture: Optional[int] = None) -> Prefill:
    """Prefill prompt[:-1] in two chunks (context, rest) capturing the last `capture` (default
    `window`) queries of each; rules get the last `window` unless they read more."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    n = ids.shape[0]
    if not 1 <= n_context <= n - 1:
        raise ValueError(f"the context ({n_context} tokens) must leave at least one prompt token "
                         f"after it (prompt of {n})")
    capture = max(window, capture or 0)
    cap1 = forward_capture(model, ids[None, :n_context], query_last=capture)
    q_context = list(cap1.queries)
    if n - 1 > n_context:
        cap2 = forward_capture(model, ids[None, n_context:n - 1], cache=cap1.cache, query_last=capture,
                               position_ids=torch.arange(n_context, n - 1)[None])
        keys, values = cap2.keys, cap2.values
        q_aware = [torch.cat([a, b], dim=1)[:, -capture:] for a, b in zip(q_context, cap2.queries)]
        if capture >= n - 1:  # every query captured: the context's are a prefix (one copy in memory)
            q_context = [q[:, :n_context] for q in q_aware]
    else:
        keys, values, q_aware = cap1.keys, cap1.values, q_context
    keys = [k.clone() for k in keys]
    values = [v.clone() for v in values]
    return Prefill(ids=ids, n_context=n_context, keys=keys, values=values, q_aware=q_aware,
                   q_context=q_context, window=window, rope=hf_rope(model))


def _eos_ids(model, extra: Sequence[int] = ()) -> set:
    eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") \
        else None
    ids = set(extra)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    return ids


@torch.no_grad()
def greedy(model, cache, first_ids: torch.Tensor, start: int, max_new: int, eos: set) -> List[int]:
    """Feed first_ids [1, k] at positions start.., then decode greedily; returns the new tokens
    (the EOS token included when hit)."""
    out: List[int] = []
    x, pos = first_ids, start
    while len(out) < max_new:
        logits = model(input_ids=x, past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(pos, pos + x.shape[1])[None]).logits
        pos += x.shape[1]
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos:
            break
        x = torch.tensor([[tok]])
    return out


@torch.no_grad()
def full_answer(model, pre: Prefill, max_new: int, eos: set) -> List[int]:
    """Greedy answer with the full cache (query-aware path: feed the last prompt token)."""
    if max_new <= 0:
        return []
    return greedy(model, pre.full_cache("query_aware"), pre.ids[None, -1:], pre.n - 1, max_new, eos)


@torch.no_grad()
def oracle_importance(model, pre: Prefill, future_ids: Sequence[int]) -> Dict[str, List[torch.Tensor]]:
    """Future attention c per protocol and layer, from the queries of everything after the compressed
    cache: question + the given future tokens (the full-cache answer, or the held-out text)."""
    m, n = pre.n_context, pre.n
    fut = torch.as_tensor(list(future_ids), dtype=torch.long)
    feed = torch.cat([pre.ids[m:], fut])
    cache = _cache([(k[None, :, :m].contiguous(), v[None, :, :m].contiguous())
                    for k, v in zip(pre.keys, pre.values)])
    cap = forward_capture(model, feed[None], cache=cache, query_last=feed.shape[0],
                          position_ids=torch.arange(m, m + feed.shape[0])[None])
    out: Dict[str, List[torch.Tensor]] = {"query_agnostic": [], "query_aware": []}
    total = m + feed.shape[0]
    for q, k in zip(cap.queries, cap.keys):
        out["query_agnostic"].append(future_importance(q, k, m))
        out["query_aware"].append(future_importance(q[:, n - 1 - m:], k, n - 1,
                                                    query_positions=torch.arange(n - 1, total)))
    return out


#: kvpress 0.5 KVzipPress.prepare: the reconstruction prompt of the first chunk, and of the next ones
#: (followed by the previous chunk's last prev_postfix_size tokens).
KVZIP_FIRST_PROMPT = "\n\nRepeat the previous context exactly."
KVZIP_NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class KVzipPrompts:
    """Token ids of KVzip's reconstruction inputs for one tokenizer (kvpress KVzipPress.__call__):
    the chat template's head is the cache's first `prefix_length` tokens (not reconstructed), its tail
    (`suffix_ids`) follows the repeat prompt; without a chat template head "" and tail "\n"."""

    prefix_length: int
    suffix_ids: List[int]
    first_ids: List[int]
    next_ids: List[int]

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "KVzipPrompts":
        from .tasks import Renderer

        r = Renderer(tokenizer)  # head/tail: the chat template around the user message, as kvpress splits it
        return cls(prefix_length=len(r.ids(r.head)) if r.head else 0, suffix_ids=r.ids(r.tail),
                   first_ids=r.ids(KVZIP_FIRST_PROMPT), next_ids=r.ids(KVZIP_NEXT_PROMPT))


@torch.no_grad()
def kvzip_reconstruction(model, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                         ids: Sequence[int], prompts: KVzipPrompts, n_sink: int = 4, chunk_size: int = 2048,
                         prev_postfix_size: int = 8, query_block: int = 256) -> Tuple[List[torch.Tensor], int]:
    """KVzip's scores (kvpress 0.5 KVzipPress.prepare / score_kvzip; see kvp_vllm/scorers/kvzip.py) of
    the cache keys/values[l] [H, t, d] of `ids` (t tokens, positions 0..t-1). The context after the chat
    template's head is reconstructed chunk by chunk on top of the cache (each chunk at positions
    t, t+1, ..); a chunk token's score is the maximum attention it gets from the reconstruction input's
    queries (max over the query group and the input's tokens), the softmax taken over the first
    min(n_sink, head) tokens, the chunk and the input itself. Returns (fp32 scores [H, t] per layer,
    tokens fed: the extra prefill)."""
    t = len(ids)
    ids = [int(i) for i in ids]
    start = min(prompts.prefix_length, t)
    context = ids[start:]
    chunks = [context[i:i + chunk_size] for i in range(0, len(context), chunk_size)]
    scores = [torch.zeros(k.shape[0], t, device=k.device) for k in keys]
    for s in scores:
        s[:, :n_sink] = 1.0  # kvpress: score_val[..., :n_sink] = 1.0 (then overwritten by any chunk)
    fed = 0
    hidden = torch.full((query_block, query_block), float("-inf"), device=keys[0].device).triu(1)  # key j > query i
    for i, chunk in enumerate(chunks):
        if i == 0:
            q_ids = list(prompts.first_ids)
        else:
            q_ids = list(prompts.next_ids) + (chunks[i - 1][-prev_postfix_size:] if prev_postfix_size else [])
        feed = torch.as_tensor(q_ids + list(prompts.suffix_ids) + chunk, dtype=torch.long, device=keys[0].device)
        q_len, end = feed.shape[0], start + len(chunk)
        fed += q_len
        cache = _cache([(k[None, :, :t].contiguous(), v[None, :, :t].contiguous()) for k, v in zip(keys, values)])
        cap = forward_capture(model, feed[None], cache=cache, query_last=q_len,
                              position_ids=torch.arange(t, t + q_len, device=feed.device)[None])
        sink = min(n_sink, start)
        for l, (q, k_all) in enumerate(zip(cap.queries, cap.keys)):
            h, d = k_all.shape[0], k_all.shape[-1]
            k = torch.cat([k_all[:, :sink], k_all[:, start:end], k_all[:, t:]], dim=1).float()  # [H, S, d]
            q = q.float().reshape(h, q.shape[0] // h, q_len, d) * d ** -0.5
            n_prev = k.shape[1] - q_len  # keys before the input's own
            # max over queries of softmax = exp(max of (logit - logsumexp)): no softmax tensor is written
            best = torch.full((h, end - start), float("-inf"), device=k.device)
            for a in range(0, q_len, query_block):  # bounded memory; softmax is per query row
                b = min(a + query_block, q_len)
                # causal among the input's own keys: these queries see none after position b - 1, and
                # within [a, b) only those not after themselves
                logits = torch.einsum("hgqd,hsd->hgqs", q[:, :, a:b], k[:, :n_prev + b])
                logits[..., n_prev + a:] += hidden[:b - a, :b - a]
                log_probs = logits[..., sink:sink + end - start] - torch.logsumexp(logits, dim=-1, keepdim=True)
                best = torch.maximum(best, log_probs.amax(dim=(1, 2)))
            best = best.exp()
            scores[l][:, start:end] = best
        start = end
    return scores, fed


def kvzip_importance(model, pre: "Prefill", protocol: str, prompts: KVzipPrompts,
                     scorer: Optional[Scorer] = None) -> Tuple[List[torch.Tensor], int]:
    """KVzip's reconstruction scores of the cache compressed under `protocol` (the context for
    query_agnostic, context + question for query_aware), with the kvzip scorer's options (n_sink,
    chunk_size, prev_postfix_size). Returns (scores [H, cache_len] per layer, extra tokens fed)."""
    from ..scorers import make_scorer

    sc = scorer if scorer is not None else make_scorer("kvzip")
    t = pre.cache_len(protocol)
    return kvzip_reconstruction(model, [k[:, :t] for k in pre.keys], [v[:, :t] for v in pre.values],
                                pre.ids[:t].tolist(), prompts, n_sink=sc.n_sink, chunk_size=sc.chunk_size,
                                prev_postfix_size=sc.prev_postfix_size)


def rule_scores(scorer: Scorer, pre: Prefill, protocol: str,
                future: Optional[List[torch.Tensor]] = None,
                reconstruction: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    """Per-layer scores [H, cache_len] of one rule under one protocol (`future`: the oracle's future
    attention per layer; `reconstruction`: KVzip's, from `kvzip_importance`)."""
    window = max(pre.window, scorer.query_window)
    captured = min(pre.q_aware[0].shape[1] if protocol == "query_aware" else pre.q_context[0].shape[1], window)
    if scorer.query_window >= ALL_QUERIES and captured < pre.cache_len(protocol):
        raise ValueError(f"{scorer.name} reads the query of every cached token, but the prefill captured "
                         f"the last {captured}: prefill(..., capture=capture_window(window, scorers))")
    return [scorer.score(pre.layer_kv(l, protocol, None if future is None else future[l], window=window,
                                      reconstruction=None if reconstruction is None else reconstruction[l]))
            for l in range(len(pre.keys))]


def kept_indices(scores: List[torch.Tensor], budget: int,
                 protect: str = DEFAULT_PROTECT) -> List[torch.Tensor]:
    """Per layer, the kept indices [H, b]: the rule's top-b, plus the --protect mode's protected tokens
    (`paper`: 4 sinks + 16 recent, the KVP paper's protocol; `none`: the rule's own choice)."""
    n_sink, n_recent = protected_counts(protect)
    return [select_topb(s, budget, n_sink, n_recent) for s in scores]


def compacted_layers(pre: Prefill, protocol: str, kept: List[torch.Tensor]):
    """Per layer (keys, values) [1, H, b, d]: the physical per-head gather."""
    t = pre.cache_len(protocol)
    return [(gather_kept(k[:, :t], idx)[None], gather_kept(v[:, :t], idx)[None])
            for k, v, idx in zip(pre.keys, pre.values, kept)]


@dataclass
class Outcome:
    tokens: List[int]          # generated tokens (EOS included when hit)
    agree: int                 # leading tokens equal to the full-cache answer
    gold_logprob: float        # teacher-forced log-likelihood of the gold tokens
    gold_tokens: int
    gold_token_logprobs: List[float] = field(default_factory=list)


@torch.no_grad()
def evaluate_caches(model, pre: Prefill, protocol: str, layers_per_rule: List[list],
                    answer: List[int], gold: List[int], max_new: int, eos: set,
                    max_batch: int = 20, pad: bool = False) -> List[Outcome]:
    """Run compacted caches (one per rule and budget; sizes may differ) as padded batches.
    layers_per_rule[r][l] = (keys, values) [1, H, b_r, d]. Per row: feed the tokens after the cache
    (`rest`), then (a) decode greedily up to max_new tokens and (b) teacher-force the gold tokens
    (log-likelihood under the compressed cache). `answer` (the full-cache answer) is only compared
    with. Positions stay logical.

    By default rows are batched only with rows of the same cache size (every rule at one budget): no
    attention mask is needed then, and PyTorch's SDPA runs grouped-query attention directly (with a
    mask, transformers copies the KV cache to every query head on each step, which dominated the run
    time). pad=True batches caches of different sizes together, padded, the padding masked out."""
    size = lambda i: layers_per_rule[i][0][0].shape[2]  # noqa: E731
    order = sorted(range(len(layers_per_rule)), key=size)
    groups = [order] if pad else [[i for i in order if size(i) == t] for t in sorted({size(i) for i in order})]
    chunks = [g[c:c + max_batch] for g in groups for c in range(0, len(g), max_batch)]
    outcomes: List[Optional[Outcome]] = [None] * len(layers_per_rule)
    for idx in chunks:
        outs = _evaluate_batch(model, pre, protocol, [layers_per_rule[i] for i in idx], gold, max_new, eos)
        for i, o in zip(idx, outs):
            agree = 0
            while agree < min(len(answer), len(o.tokens)) and o.tokens[agree] == answer[agree]:
                agree += 1
            o.agree = agree
            outcomes[i] = o
    return outcomes  # type: ignore[return-value]


def _padded_cache(rows: List[list], spare: int = 0):
    """Per-row caches [1, H, T_r, d] -> one cache [B, H, T_max, d] (zero padding at each row's end) and
    the [B, T_max] validity mask."""
    lens = [r[0][0].shape[2] for r in rows]
    t_max = max(lens)
    layers = []
    for l in range(len(rows[0])):
        k0 = rows[0][l][0]
        if all(n == t_max for n in lens):
            k = torch.cat([r[l][0] for r in rows])
            v = torch.cat([r[l][1] for r in rows])
        else:
            k = k0.new_zeros(len(rows), k0.shape[1], t_max, k0.shape[3])
            v = torch.zeros_like(k)
            for i, r in enumerate(rows):
                k[i, :, :lens[i]] = r[l][0][0]
                v[i, :, :lens[i]] = r[l][1][0]
        layers.append((k, v))
    valid = torch.zeros(len(rows), t_max, dtype=torch.long)
    for i, n in enumerate(lens):
        valid[i, :n] = 1
    return _cache(layers, spare), valid


def _evaluate_batch(model, pre: Prefill, protocol: str, rows: List[list], gold: List[int],
                    max_new: int, eos: set) -> List[Outcome]:
    """One cache in preallocated buffers serves every step: the gold tokens are teacher-forced and
    then cropped away (O(1)), decoding continues in place, finished rows leave the batch."""
    bsz = len(rows)
    rest = pre.rest_ids(protocol)
    start = pre.cache_len(protocol)
    n_rest = rest.shape[0]
    cache, valid = _padded_cache(rows, spare=n_rest + max(len(gold), max_new))
    padded = bool((valid == 0).any())
    pos = torch.arange(start, start + n_rest)[None].expand(bsz, -1)
    mask = torch.cat([valid, torch.ones(bsz, n_rest, dtype=torch.long)], dim=1)
    kw = {"attention_mask": mask} if padded else {}
    first = model(input_ids=rest[None].expand(bsz, -1), past_key_values=cache, use_cache=True,
                  position_ids=pos, logits_to_keep=1, **kw).logits[:, -1].float()  # [B, V]
    gold_lp = [[] for _ in range(bsz)]
    if len(gold):
        g = torch.as_tensor(gold, dtype=torch.long)
        lps = [torch.log_softmax(first, -1).gather(1, g[:1].expand(bsz)[:, None])[:, 0]]
        if len(gold) > 1:
            x = g[None, :-1].expand(bsz, -1)
            gm = torch.cat([mask, torch.ones(bsz, len(gold) - 1, dtype=torch.long)], dim=1)
            gpos = torch.arange(start + n_rest, start + n_rest + len(gold) - 1)[None].expand(bsz, -1)
            lg = model(input_ids=x, past_key_values=cache, use_cache=True, position_ids=gpos,
                       **({"attention_mask": gm} if padded else {})).logits.float()
            for layer in cache.layers:  # back to the state after `rest`
                layer.crop(-(len(gold) - 1))
            lps.append(torch.log_softmax(lg, -1).gather(2, g[None, 1:, None].expand(bsz, -1, 1))[..., 0].T)
        lp = torch.cat([t if t.dim() == 2 else t[None] for t in lps], dim=0)  # [len(gold), B]
        gold_lp = [lp[:, i].tolist() for i in range(bsz)]
    tokens: List[List[int]] = [[] for _ in range(bsz)]
    if max_new > 0:
        nxt = first.argmax(-1)
        tokens = [[int(t)] for t in nxt]
        if max_new > 1:
            more = _decode(model, cache, mask, nxt[:, None], torch.full((bsz, 1), start + n_rest),
                           max_new - 1, eos, padded, done=[t[0] in eos for t in tokens])
            for i, m in enumerate(more):
                tokens[i] += m
    return [Outcome(tokens=tokens[i], agree=0, gold_logprob=float(sum(gold_lp[i])), gold_tokens=len(gold),
                    gold_token_logprobs=gold_lp[i]) for i in range(bsz)]


def _decode(model, cache, mask, x, pos, max_new: int, eos: set, padded: bool,
            done: Optional[List[bool]] = None) -> List[List[int]]:
    """Batched greedy decoding: feed x [B, 1] at pos [B, 1], make up to max_new tokens per row (none
    for rows already `done`). Once half the batch has finished, the finished rows leave it (one copy
    of the live rows' cache), so a few long answers do not keep every finished row computing."""
    out: List[List[int]] = [[] for _ in range(x.shape[0])]
    done = list(done) if done is not None else [False] * x.shape[0]
    batch = list(range(x.shape[0]))  # original row of each batch row
    while not all(done[i] for i in batch):
        if 2 * sum(done[i] for i in batch) >= len(batch):
            keep = [j for j, i in enumerate(batch) if not done[i]]
            sel = torch.tensor(keep)
            cache.batch_select_indices(sel)
            mask, x, pos, batch = mask[sel], x[sel], pos[sel], [batch[j] for j in keep]
        mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
        logits = model(input_ids=x, past_key_values=cache, use_cache=True, position_ids=pos,
                       **({"attention_mask": mask} if padded else {})).logits[:, -1]
        nxt = logits.argmax(-1)
        for j, i in enumerate(batch):
            if not done[i]:
                out[i].append(int(nxt[j]))
                done[i] = out[i][-1] in eos or len(out[i]) >= max_new
        x, pos = nxt[:, None], pos + 1
    return out
