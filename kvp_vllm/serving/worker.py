"""Worker side of tail-pack eviction (vLLM V1 model runner, CPU attention backend).

Per step, before the model runner builds its inputs, the worker carries out the scheduler's
compaction orders: for each ordered request and each layer it reads the live tokens, scores them
with the configured rule, keeps b' per KV head and writes them into the block-aligned tail
[new_k * block_size, L). Reading, writing and KVP's score + select go through `kvp_vllm.kernels`
(the fused Triton kernels on CUDA tensors, their torch reference here), so the server and the
benchmarks run one implementation. From then on the request's attention metadata is shifted: its block-table
row starts at block new_k and its sequence length drops by new_k * block_size. Token positions (and
so RoPE and the slot mapping of new tokens) stay logical.

Query-aware rules (TOVA, SnapKV) read the last queries, captured by a wrapper around the CPU
attention backend's forward.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from ..kernels import gather_kv, gather_kv_tokens, paged_score_select, scatter_kv_tokens
from ..scorers import LayerKV, make_scorer
from ..selection import select_topb
from .config import EvictionConfig, request_budget, request_rule
from .metrics import metrics

logger = logging.getLogger("vllm.kvp_vllm.worker")

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
QUERY_WINDOW = 64  # SnapKV's observation window (TOVA uses the last query only)


def layer_index(layer_name: str) -> int:
    m = _LAYER_RE.search(layer_name)
    if m is None:
        raise RuntimeError(f"kvp-vllm cannot tell the layer index of attention layer {layer_name!r}")
    return int(m.group(1))


@dataclass
class StepContext:
    """What the runner hook hands to the attention hooks within one step."""

    offsets: Optional[np.ndarray] = None      # tokens to drop from each batch row's front
    block_shift: Optional[np.ndarray] = None  # blocks to drop from each batch row's front
    capture: List = field(default_factory=list)  # (req_id, start, end) query rows to keep


STEP = StepContext()


@dataclass
class RequestEviction:
    """A request's eviction state in the worker."""

    k_blocks: int = 0                      # leading blocks already freed (null)
    kept_len: int = 0                      # logical length at the last compaction
    positions: Optional[torch.Tensor] = None  # [layers, H, kept] logical positions of the kept slots
    queries: Dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [W, q_heads, d]


class WorkerEviction:
    def __init__(self, runner, cfg: EvictionConfig):
        from .cache_layout import verify_cpu_layout

        self.runner = runner
        self.cfg = cfg
        self.reqs: Dict[str, RequestEviction] = {}
        vc = runner.vllm_config
        groups = runner.kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_size
        self.num_q_heads = vc.model_config.get_num_attention_heads(vc.parallel_config)
        ctx = runner.compilation_config.static_forward_context
        self.layers = sorted((layer_index(n), n) for n in groups[0].layer_names)
        self.caches = {i: ctx[n].kv_cache for i, n in self.layers}
        for i, c in self.caches.items():
            if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[1:] != (
                    self.num_kv_heads, self.block_size, 2 * self.head_dim):
                raise RuntimeError(f"kvp-vllm: unexpected KV cache for layer {i}: "
                                   f"{getattr(c, 'shape', type(c))}")
        isa = getattr(ctx[self.layers[0][1]], "isa", None)
        if isa is None:
            raise RuntimeError("kvp-vllm: the CPU attention layer has no ISA set; is this the CPU backend?")
        self.layout = verify_cpu_layout(self.num_kv_heads, self.block_size, self.head_dim,
                                        next(iter(self.caches.values())).dtype, isa,
                                        vc.cache_config.cache_dtype)
        self.max_model_len = vc.model_config.max_model_len
        self.scorers = {}
        if cfg.checkpoint:  # load (and shape-check) the policy at start-up, not on a first request
            from ..policy import KVPPolicy, ModelShape

            shape = ModelShape(len(self.layers), self.num_kv_heads, self.head_dim, vc.model_config.model)
            self.scorers["kvp"] = make_scorer("kvp", policy=KVPPolicy.load(cfg.checkpoint, expect=shape))
        self.scorer_for(cfg.rule)
        logger.info("kvp-vllm worker ready: rule=%s, %d layers, block %d, CPU isa %s",
                    cfg.rule, len(self.layers), self.block_size, isa)

    def scorer_for(self, rule: str):
        if rule not in self.scorers:
            self.scorers[rule] = make_scorer(rule)
        return self.scorers[rule]

    def _request_rule(self, rid: str) -> Optional[str]:
        """The rule of an evicting request (None if it is not evicted)."""
        req = self.runner.requests.get(rid)
        params = getattr(req, "sampling_params", None)
        if params is None:
            return None
        try:
            if request_budget(params.extra_args, self.cfg) is None:
                return None
            return request_rule(params.extra_args, self.cfg)
        except ValueError:
            return None

    # -- per step ---------------------------------------------------------------------------------

    def before_prepare(self, scheduler_output) -> None:
        """Forget finished/restarted requests, then carry out this step's compaction orders."""
        for rid in scheduler_output.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.reqs.pop(new.req_id, None)
        for rid in getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ():
            self.reqs.pop(rid, None)
        for rid, order in (getattr(scheduler_output, "kvp_orders", None) or {}).items():
            self._compact(rid, order)

    def after_prepare(self, scheduler_output) -> None:
        """Per-row offsets for the attention metadata, and the query rows to capture."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        shift = np.zeros(num_reqs, dtype=np.int64)
        capture = []
        qsl = self.runner.query_start_loc.np
        for row, rid in enumerate(batch.req_ids[:num_reqs]):
            st = self.reqs.get(rid)
            if st is not None:
                shift[row] = st.k_blocks
            if rid in scheduler_output.num_scheduled_tokens:
                rule = self._request_rule(rid)
                if rule is not None and self.scorer_for(rule).needs_queries:
                    capture.append((rid, int(qsl[row]), int(qsl[row + 1])))
        STEP.block_shift = shift if shift.any() else None
        STEP.offsets = shift * self.block_size if shift.any() else None
        STEP.capture = capture

    # -- compaction -------------------------------------------------------------------------------

    def _compact(self, rid: str, order: dict) -> None:
        runner = self.runner
        req = runner.requests.get(rid)
        if req is None:  # finished or aborted since the scheduler decided: nothing to do
            return
        bs = self.block_size
        L, k_old, new_k, keep = order["length"], order["k_old"], order["new_k"], order["keep"]
        st = self.reqs.setdefault(rid, RequestEviction())
        if st.k_blocks != k_old:
            raise RuntimeError(f"kvp-vllm: request {rid} worker/scheduler disagree on freed blocks "
                               f"({st.k_blocks} vs {k_old})")
        # 1. Copy-on-write: the scheduler gave this request private blocks for the rewritten tail.
        ids = req.block_ids[0]
        row = runner.input_batch.req_id_to_index.get(rid)
        bt = runner.input_batch.block_table[0].block_table.np
        for i, b in enumerate(order["dst_ids"]):
            ids[new_k + i] = b
            if row is not None:
                bt[row, new_k + i] = b
        src = torch.tensor(order["src_ids"], dtype=torch.int32)
        dst = torch.tensor(order["dst_ids"], dtype=torch.int32)
        live = L - k_old * bs
        rule = order.get("rule", self.cfg.rule)
        scorer = self.scorer_for(rule)
        t0 = time.perf_counter()
        select_s = 0.0
        new_positions = []
        slots = torch.arange(keep).expand(self.num_kv_heads, keep)
        for li, _ in self.layers:
            cache = self.caches[li]
            pos = self._positions(st, li, L, live)  # [H, live]
            ts = time.perf_counter()
            try:
                kept = self._select(scorer, li, cache, src, live, pos, L, keep, st)  # [H, keep]
            except Exception:  # a scoring bug must not kill the engine: keep the most recent instead
                logger.exception("kvp-vllm: rule %s failed on layer %d of request %s; falling back "
                                 "to recency for this layer", rule, li, rid)
                metrics().scoring_errors.labels(rule).inc()
                kept = select_topb(pos.float(), keep, self.cfg.n_sink, self.cfg.n_recent)
            select_s += time.perf_counter() - ts
            # the kept entries are copied out before the tail is overwritten (sources may overlap it)
            keys, values = gather_kv_tokens(cache, self.layout, src, kept)
            scatter_kv_tokens(cache, self.layout, dst, slots, keys, values)
            new_positions.append(torch.gather(pos, 1, kept))
        st.positions = torch.stack(new_positions)
        st.kept_len = L
        st.k_blocks = new_k
        st.queries = {}  # the next compaction sees fresh queries only
        m = metrics()
        m.selection_latency.labels(rule).observe(select_s)
        m.compaction_latency.labels(rule).observe(time.perf_counter() - t0)

    def _positions(self, st: RequestEviction, layer: int, L: int, live: int) -> torch.Tensor:
        h = self.num_kv_heads
        if st.positions is None:
            return torch.arange(live).expand(h, live)
        kept = st.positions[layer]
        grown = torch.arange(st.kept_len, L).expand(h, L - st.kept_len)
        return torch.cat([kept, grown], dim=1)

    def _select(self, scorer, layer: int, cache, src, live: int, pos, L: int, keep: int,
                st: RequestEviction) -> torch.Tensor:
        """Kept slots [H, keep] (ascending) of one layer's `live` tokens."""
        if scorer.name == "kvp":  # fused score + select straight from the paged cache
            sel = paged_score_select(scorer.policy, layer, cache, self.layout, src[None], [live],
                                     [keep], self.cfg.n_sink, self.cfg.n_recent, positions=pos[None],
                                     position_lengths=[L])
            if int(sel.counts[0]) != keep:
                raise RuntimeError(f"kvp-vllm: the kernel kept {int(sel.counts[0])} tokens, ordered {keep}")
            return sel.kept[0, :, :keep].long()
        keys, values = gather_kv(cache, self.layout, src, live)
        scores = self._score(scorer, layer, keys, values, pos, L, st)
        return select_topb(scores, keep, self.cfg.n_sink, self.cfg.n_recent)

    def _score(self, scorer, layer: int, keys, values, pos, L: int, st: RequestEviction) -> torch.Tensor:
        keys, values = keys.float(), values.float()
        queries = None
        if scorer.needs_queries:
            q = st.queries.get(layer)
            if q is None:
                raise RuntimeError(f"kvp-vllm: no captured queries for layer {layer}")
            queries = q.permute(1, 0, 2).float()  # [q_heads, W, d]
        shared = bool((pos == pos[:1]).all())
        if shared:
            return scorer.score(LayerKV(keys, values, pos[0].contiguous(), queries, layer=layer))
        g = self.num_q_heads // self.num_kv_heads
        out = []
        for h in range(self.num_kv_heads):
            qh = None if queries is None else queries[h * g:(h + 1) * g]
            out.append(scorer.score(LayerKV(keys[h:h + 1], values[h:h + 1],
                                                 pos[h].contiguous(), qh, layer=layer)))
        return torch.cat(out, dim=0)

    # -- query capture (called from the attention backend wrapper) -------------------------------

    def capture_queries(self, layer_name: str, query: torch.Tensor) -> None:
        li = layer_index(layer_name)
        q = query.reshape(query.shape[0], self.num_q_heads, self.head_dim)
        for rid, start, end in STEP.capture:
            st = self.reqs.setdefault(rid, RequestEviction())
            rows = q[max(start, end - QUERY_WINDOW):end].detach().clone()
            old = st.queries.get(li)
            if old is not None:
                rows = torch.cat([old, rows])[-QUERY_WINDOW:]
            st.queries[li] = rows


def shift_common_metadata(cm):
    """A copy of CommonAttentionMetadata with each evicted request's freed blocks cut off."""
    shift = STEP.block_shift
    offsets = STEP.offsets
    n = cm.num_reqs
    if shift is None or not shift[:n].any():
        return cm
    off = torch.zeros(n, dtype=cm.seq_lens.dtype)
    m = min(n, len(offsets))
    off[:m] = torch.from_numpy(offsets[:m]).to(off.dtype)
    bt = cm.block_table_tensor.clone()  # on CPU the stored table aliases this buffer: never shift it
    width = bt.shape[1]
    for row in np.nonzero(shift[:m])[0]:
        k = int(shift[row])
        bt[row, :width - k] = cm.block_table_tensor[row, k:]
        bt[row, width - k:] = 0
    seq_lens = cm.seq_lens - off
    upper = None if cm.seq_lens_cpu_upper_bound is None else cm.seq_lens_cpu_upper_bound - off.to(
        cm.seq_lens_cpu_upper_bound.dtype)
    return dataclasses.replace(cm, seq_lens=seq_lens, seq_lens_cpu_upper_bound=upper,
                               block_table_tensor=bt, max_seq_len=int(seq_lens.max()))
