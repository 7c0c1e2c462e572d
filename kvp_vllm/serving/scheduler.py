"""Scheduler side of tail-pack eviction: decide (deterministically) which requests to compact this
step, give their rewritten tail private blocks, and free their leading blocks at once.

Timing (synchronous scheduling only, checked at start-up): the orders are made at the end of
`schedule()` for requests in a pure decode step; the worker carries them out in the same step before
the forward pass; the scheduler frees blocks `[k_old, new_k)` right away. That is safe because no
other request can be handed those blocks before the next `schedule()`, by which time the worker has
finished reading them. Freed blocks become vLLM's null block in the request's list (the path sliding
windows use), so the allocation arithmetic, slot mapping and positions are untouched.

Prefix caching: the freed leading blocks are not rewritten, so their cache entries stay valid. A tail
block that is shared with another request or registered in the prefix cache is never rewritten in
place: the request gets a fresh block (copy-on-write; the worker writes every kept slot, so nothing
needs copying) and the old block stays with its other owners / in the cache. After its first
compaction a request never registers new cache entries (its later KV depends on what was evicted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

from .config import EvictionConfig, request_budget, request_rule
from .metrics import gauges, metrics

logger = logging.getLogger("vllm.kvp_vllm.scheduler")

_NEVER_CACHE = 1 << 40  # num_cached_block high-water mark that stops a request's block caching


@dataclass
class SchedState:
    budget: int
    rule: str
    k_blocks: int = 0          # leading blocks freed so far
    compacted: bool = False    # the post-prefill compaction point has passed


def freed_blocks_at(length: int, k_blocks: int, first: bool, budget: int, interval: int,
                    block_size: int) -> int:
    """Blocks a request of `length` cached tokens (k_blocks of them already freed) frees at a decode
    step: after its prefill (`first`) once it holds more than `budget` live tokens, later once it
    holds more than budget + interval; always whole blocks, keeping at least `budget`."""
    live = length - k_blocks * block_size
    if live <= (budget if first else budget + interval):
        return 0
    return (live - budget) // block_size


def next_compaction_length(num_prompt: int, k_blocks: int, first_done: bool, budget: int, interval: int,
                           block_size: int) -> int:
    """The smallest length at which `freed_blocks_at` orders the request's next compaction (the
    worker captures the queries of the tokens just before it)."""
    if not first_done and freed_blocks_at(num_prompt, k_blocks, True, budget, interval, block_size):
        return num_prompt
    later = k_blocks * block_size + budget + max(interval + 1, block_size)
    return later if first_done else max(num_prompt + 1, later)


class SchedulerEviction:
    def __init__(self, scheduler, cfg: EvictionConfig):
        self.sched = scheduler
        self.cfg = cfg
        self.reqs: Dict[str, SchedState] = {}
        mgr = scheduler.kv_cache_manager
        managers = mgr.coordinator.single_type_managers
        self.manager = managers[0]
        self.pool = self.manager.block_pool
        self.block_size = self.manager.block_size
        self.max_model_len = scheduler.vllm_config.model_config.max_model_len

    def _state(self, request) -> Optional[SchedState]:
        params = request.sampling_params
        if params is None:
            return None
        try:
            budget = request_budget(params.extra_args, self.cfg, self.max_model_len)
            rule = request_rule(params.extra_args, self.cfg)
        except ValueError as e:  # the API validates first; a direct engine client may not have
            logger.warning("kvp-vllm: request %s: %s; serving it without eviction", request.request_id, e)
            return None
        return None if budget is None else SchedState(budget, rule)

    def forget(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    def plan(self, scheduler_output) -> None:
        """Called before num_computed_tokens advances: it still counts the tokens already cached."""
        orders = {}
        resumed = set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
        new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            if rid in new_ids or rid in resumed:
                self.reqs.pop(rid, None)
                continue
            request = self.sched.requests[rid]
            L = request.num_computed_tokens
            # Pure decode steps only: the whole prompt (and every earlier output) is in the cache.
            if n_sched != 1 or L != request.num_tokens - 1 or L < request.num_prompt_tokens:
                continue
            st = self.reqs.get(rid)
            if st is None:
                st = self._state(request)
                if st is None:
                    continue
                self.reqs[rid] = st
            first = not st.compacted
            st.compacted = True
            k_inc = freed_blocks_at(L, st.k_blocks, first, st.budget, self.cfg.interval, self.block_size)
            if k_inc < 1:
                continue
            order = self._order(rid, L, st, k_inc)
            if order is not None:
                orders[rid] = order
                self._record(order, L, first, st.rule)
        scheduler_output.kvp_orders = orders

    def _order(self, rid: str, L: int, st: SchedState, k_inc: int) -> Optional[dict]:
        bs = self.block_size
        blocks = self.manager.req_to_blocks[rid]
        end = -(-L // bs)
        k_old, new_k = st.k_blocks, st.k_blocks + k_inc
        src_ids = [b.block_id for b in blocks[k_old:end]]
        if any(b.is_null for b in blocks[k_old:end]):
            raise RuntimeError(f"kvp-vllm: request {rid} has freed blocks inside its live range")
        # Copy-on-write for tail blocks someone else may read (shared, or in the prefix cache).
        cow = [i for i in range(new_k, end) if blocks[i].ref_cnt > 1 or blocks[i].block_hash is not None]
        if cow:
            if self.pool.get_num_free_blocks() >= len(cow):
                fresh = self.pool.get_new_blocks(len(cow))
                old = [blocks[i] for i in cow]
                for i, b in zip(cow, fresh):
                    blocks[i] = b
                self.pool.free_blocks(old)  # drops our reference; others keep reading them
            elif any(blocks[i].ref_cnt > 1 for i in cow):
                return None  # no room to copy a shared block: retry on a later step
            else:
                for i in cow:  # sole owner, no room: drop the cache entries instead
                    self.pool._maybe_evict_cached_block(blocks[i])
        self.manager._remove_blocks_in_range(rid, k_old, new_k)
        # Later KV of this request depends on what was evicted: never publish it to the prefix cache.
        self.manager.num_cached_block[rid] = _NEVER_CACHE
        st.k_blocks = new_k
        return {
            "length": L, "k_old": k_old, "new_k": new_k, "keep": L - new_k * bs,
            "src_ids": src_ids, "dst_ids": [b.block_id for b in blocks[new_k:end]],
        }

    def _record(self, order: dict, L: int, first: bool, rule: str) -> None:
        m = metrics()
        order["rule"] = rule
        freed = order["new_k"] - order["k_old"]
        m.blocks_freed.labels(rule).inc(freed)
        m.tokens_evicted.labels(rule).inc(freed * self.block_size)
        m.compactions.labels(rule, "prefill" if first else "decode").inc()
        m.retained_fraction.labels(rule).observe(order["keep"] / L)

    def refresh_gauges(self) -> None:
        m = gauges()
        free = self.pool.get_num_free_blocks()
        m.blocks_free.set(free)
        m.blocks_used.set(self.pool.num_gpu_blocks - 1 - free)  # block 0 is vLLM's null block
