"""Eviction through vLLM's V1 GPU model runner, on a tiny random Llama (head_dim 64, block 16).

Three engines, most valuable first:
  graphs  bf16, the default backend (FlashAttention on Hopper), FULL_DECODE_ONLY CUDA graphs,
          prefix caching on: plain-vLLM equivalence, exact freed-block counts, FULL graphs after a
          compaction (checked), query capture, concurrency without leaks, prefix-shared blocks,
          replays within bf16 tolerance
  exact   fp32, Triton attention, FULL_DECODE_ONLY graphs: K-Norm and KVP (with a decode-time
          re-compaction) are greedy under a Hugging Face reference that keeps the same tokens (up to
          fp32 noise: vLLM's fused kernels sum in another order than transformers)
  eager   fp32, Triton attention, no graphs: plain-vLLM equivalence and the K-Norm replay again
"""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import BLOCK, DEVICE, ON_CPU, close_engine, make_engine  # noqa: E402

if not (torch.cuda.is_available() or ON_CPU):
    pytest.skip("the GPU suite needs CUDA", allow_module_level=True)
graphs_only = pytest.mark.skipif(ON_CPU, reason="CUDA graphs: GPU only")

pytestmark = pytest.mark.timeout(900)

BUDGET = 128
INTERVAL = 32
POOL = 6400 // BLOCK  # 6 requests of 1000 tokens without eviction
PROMPT = 1000


def prompt_ids(seed: int, n: int = PROMPT):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def params(max_tokens: int, budget=BUDGET, rule=None, **kw):
    from vllm import SamplingParams

    extra = {"kv_budget": budget}
    if rule is not None:
        extra["kv_rule"] = rule
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                          extra_args=extra, **kw)


def generate(llm, prompts, sampling):
    from vllm.inputs import TokensPrompt

    if not isinstance(sampling, list):
        sampling = [sampling] * len(prompts)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def core(llm):
    return llm.llm_engine.engine_core.engine_core


def pool(llm):
    return core(llm).scheduler.kv_cache_manager.block_pool


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()


def knorm_positions(model, ids, budget):
    """K-Norm's kept positions [layers, H, b'] computed independently on the HF prompt cache."""
    from transformers import DynamicCache

    from kvp_vllm.scorers import LayerKV, make_scorer
    from kvp_vllm.selection import block_aligned_budget, select_topb

    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids], device=DEVICE), past_key_values=cache, use_cache=True)
    keep = block_aligned_budget(len(ids), budget, BLOCK)
    scorer = make_scorer("knorm")
    kept = []
    for li, layer in enumerate(cache.layers):
        k, v = layer.keys[0].float(), layer.values[0].float()
        scores = scorer.score(LayerKV(k, v, torch.arange(len(ids), device=DEVICE), layer=li))
        kept.append(select_topb(scores, keep))
    return torch.stack(kept).cpu()


# -- bf16, FlashAttention, FULL_DECODE_ONLY graphs -------------------------------------------------

@pytest.fixture(scope="module")
def graphs(tiny_path, tiny_policy):
    llm = make_engine(tiny_path, "knorm", BUDGET, INTERVAL, checkpoint=tiny_policy, dtype="bfloat16",
                      block_size=BLOCK, max_model_len=2048, num_gpu_blocks_override=POOL,
                      max_num_seqs=16, enable_prefix_caching=True,
                      compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                          "cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    yield llm
    close_engine(llm)


def test_the_gpu_engine_runs_the_v1_runner_with_a_verified_layout(graphs):
    from kvp_vllm.serving.replay import worker_eviction

    ev = worker_eviction(graphs)
    assert (ev.device.type, ev.layout) == (("cpu", "cpu") if ON_CPU else ("cuda", "gpu"))
    assert not core(graphs).vllm_config.scheduler_config.async_scheduling


def test_budget_at_least_prompt_is_plain_vllm_with_cuda_graphs(graphs):
    ids = prompt_ids(1, 300)
    graphs.reset_prefix_cache()  # both from scratch: a prefix-cache hit computes in another order (bf16)
    plain, _ = generate(graphs, [ids], params(48, budget="none"))
    graphs.reset_prefix_cache()
    big, _ = generate(graphs, [ids], params(48, budget=1000))
    assert plain == big


def test_freed_blocks_rise_by_exactly_the_evicted_blocks_and_come_back(graphs):
    engine = graphs.llm_engine
    blocks = pool(graphs)
    start = blocks.get_num_free_blocks()
    ids = prompt_ids(2)
    engine.add_request("freed", {"prompt_token_ids": ids}, params(24))
    free = []
    while engine.has_unfinished_requests():
        engine.step()
        free.append(blocks.get_num_free_blocks())
    # step 0: prefill (63 blocks); step 1: first decode, compacted: the scheduler frees floor((L-b)/bs)
    assert free[1] - free[0] == (PROMPT - BUDGET) // BLOCK
    assert blocks.get_num_free_blocks() == start, "blocks leaked"


def test_aborting_a_compacted_request_returns_every_block(graphs):
    engine = graphs.llm_engine
    blocks = pool(graphs)
    start = blocks.get_num_free_blocks()
    engine.add_request("aborted", {"prompt_token_ids": prompt_ids(11)}, params(200))
    engine.add_request("kept", {"prompt_token_ids": prompt_ids(12)}, params(40))
    for _ in range(6):  # prefill, the compaction step, a few decode steps
        engine.step()
    evicting = core(graphs).scheduler._kvp.reqs  # keyed by vLLM's internal request ids
    aborted = [rid for rid in evicting if rid.startswith("aborted")]
    assert aborted and evicting[aborted[0]].k_blocks > 0, "not compacted before the abort"
    engine.abort_request(["aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    assert blocks.get_num_free_blocks() == start, "blocks leaked"
    assert not core(graphs).scheduler._kvp.reqs


@graphs_only
def test_decode_after_a_compaction_runs_the_full_cuda_graph(graphs):
    from kvp_vllm.serving.replay import worker_eviction

    ev = worker_eviction(graphs)
    ev.cudagraph_modes.clear()
    generate(graphs, [prompt_ids(3)], params(40))
    assert ev.cudagraph_modes["FULL"] >= 38, dict(ev.cudagraph_modes)
    assert set(ev.cudagraph_modes) == {"FULL"}, dict(ev.cudagraph_modes)


def test_query_capture_steps_run_without_the_full_graph_and_score(graphs):
    """TOVA reads the last query before each compaction: those steps run eagerly (captured), the
    others keep their graph, and no scoring error happens (a missing capture would be one)."""
    from kvp_vllm.serving.metrics import metrics
    from kvp_vllm.serving.replay import record_compactions, worker_eviction

    ev = worker_eviction(graphs)
    errors = metrics().scoring_errors.labels("tova")
    before = errors._value.get()
    ev.cudagraph_modes.clear()
    with record_compactions(graphs) as history:
        generate(graphs, [prompt_ids(4)], params(120, rule="tova"))
    (record,) = history.values()
    assert len(record) >= 3, [length for length, _ in record]
    assert errors._value.get() == before, "a TOVA compaction found no captured query"
    for length, kept in record:  # TOVA (kvpress): one set for every KV head, re-compactions too
        assert torch.equal(kept[:, 0], kept[:, 1]), f"heads kept different tokens at L={length}"
    modes = dict(ev.cudagraph_modes)
    if not ON_CPU:
        assert modes.get("FULL", 0) > modes.get("NONE", 0) > 0, modes


def test_bf16_replays_within_tolerance(graphs, tiny_path):
    """K-Norm after prefill and KVP through decode-time re-compactions: vLLM's tokens are (near-)greedy
    under a transformers decode that keeps the same tokens, and not under the uncompressed one."""
    from kvp_vllm.serving.replay import hf_replay, record_compactions

    model = hf_model(tiny_path, torch.bfloat16)
    for seed, rule in ((5, None), (6, "kvp")):
        ids = prompt_ids(seed)
        with record_compactions(graphs) as history:
            (got,), _ = generate(graphs, [ids], params(96, rule=rule))
        (record,) = history.values()
        assert len(record) >= 2
        _, lp, best = hf_replay(model, ids, 96, record, forced=got)
        gaps = [b - x for x, b in zip(lp, best)]
        _, lp_full, best_full = hf_replay(model, ids, 96, forced=got)
        gaps_full = [b - x for x, b in zip(lp_full, best_full)]
        assert sum(gaps) / len(gaps) < 0.02 and max(gaps) < 0.25, (rule, gaps)
        assert sum(gaps_full) > 5 * sum(gaps) + 0.5, "the uncompressed reference agrees: no teeth"


def test_concurrent_requests_reuse_freed_blocks_without_leaks(graphs):
    scheduler = core(graphs).scheduler
    blocks = pool(graphs)
    start = blocks.get_num_free_blocks()
    peak = []
    original = scheduler.schedule

    def spy(*a, **k):
        out = original(*a, **k)
        peak.append(len(scheduler.running))
        return out

    scheduler.schedule = spy
    try:
        prompts = [prompt_ids(100 + i, 900 + 10 * i) for i in range(12)]
        budgets = [BUDGET] * 10 + ["none", "none"]
        outs, _ = generate(graphs, prompts, [params(64, budget=b) for b in budgets])
    finally:
        del scheduler.schedule
    assert all(len(o) == 64 for o in outs)
    assert blocks.get_num_free_blocks() == start, "blocks leaked"
    assert max(peak) > POOL // -(-PROMPT // BLOCK), f"peak running {max(peak)}: freed blocks were not reused"
    assert not scheduler._kvp.reqs


def test_prefix_shared_blocks_are_unchanged_after_another_request_compacts(graphs):
    ids = prompt_ids(7)
    generate(graphs, [ids], params(8, budget="none"))        # fills the prefix cache
    (before,), o1 = generate(graphs, [ids], params(32, budget="none"))
    assert o1[0].num_cached_tokens > 0, "the prefix cache was not hit"
    _, o2 = generate(graphs, [ids], params(32))               # evicting request on the same blocks
    assert o2[0].num_cached_tokens > 0
    (after,), _ = generate(graphs, [ids], params(32, budget="none"))
    assert after == before


# -- fp32, Triton attention: exact ------------------------------------------------------------------

@pytest.fixture(scope="module")
def exact(graphs, tiny_path, tiny_policy):
    close_engine(graphs)  # one engine at a time
    llm = make_engine(tiny_path, "knorm", BUDGET, INTERVAL, checkpoint=tiny_policy, dtype="float32",
                      block_size=BLOCK, max_model_len=2048, num_gpu_blocks_override=POOL,
                      max_num_seqs=8, enable_prefix_caching=False, attention_backend="TRITON_ATTN",
                      compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                          "cudagraph_capture_sizes": [1, 2, 4, 8]})
    yield llm
    close_engine(llm)


def _exact_replays(llm, tiny_path):
    """fp32: K-Norm keeps what transformers' own keys say (up to fp32 near-ties at the cut: vLLM's
    fused projections sum in another order), and vLLM's greedy tokens are the greedy tokens of a
    transformers decode keeping the recorded tokens (teacher-forced: each one its argmax up to fp32
    noise), after prefill and through decode-time re-compactions (KVP's own path)."""
    from kvp_vllm.serving.replay import record_compactions

    model = hf_model(tiny_path, torch.float32)
    ids = prompt_ids(8)
    with record_compactions(llm) as history:
        (got,), _ = generate(llm, [ids], params(32))
    (record,) = history.values()
    ours, theirs = record[0][1].long(), knorm_positions(model, ids, BUDGET)
    for layer in range(ours.shape[0]):
        for head in range(ours.shape[1]):
            shared = len(set(ours[layer, head].tolist()) & set(theirs[layer, head].tolist()))
            assert shared >= 0.98 * ours.shape[2], (layer, head, shared)
    _assert_greedy_under(model, ids, got, record)
    ids = prompt_ids(9)
    with record_compactions(llm) as history:
        (got,), _ = generate(llm, [ids], params(96, rule="kvp"))
    (record,) = history.values()
    assert len(record) >= 2, "no decode-time re-compaction"
    _assert_greedy_under(model, ids, got, record)


def _assert_greedy_under(model, ids, got, record, tol=1e-2):
    from kvp_vllm.serving.replay import hf_replay

    _, lp, best = hf_replay(model, ids, len(got), record, forced=got)
    gaps = [b - x for x, b in zip(lp, best)]
    assert max(gaps) < tol, gaps
    _, lp, best = hf_replay(model, ids, len(got), forced=got)
    assert max(b - x for x, b in zip(lp, best)) > 10 * tol, "the uncompressed reference agrees: no teeth"


def test_fp32_triton_graphs_equal_a_reference_keeping_the_same_tokens(exact, tiny_path):
    from kvp_vllm.serving.replay import worker_eviction

    ev = worker_eviction(exact)
    ev.cudagraph_modes.clear()
    _exact_replays(exact, tiny_path)
    if not ON_CPU:
        assert set(ev.cudagraph_modes) == {"FULL"}, dict(ev.cudagraph_modes)


@pytest.fixture(scope="module")
def eager(exact, tiny_path, tiny_policy):
    close_engine(exact)
    llm = make_engine(tiny_path, "knorm", BUDGET, INTERVAL, checkpoint=tiny_policy, dtype="float32",
                      block_size=BLOCK, max_model_len=2048, num_gpu_blocks_override=POOL,
                      max_num_seqs=8, enable_prefix_caching=False, attention_backend="TRITON_ATTN",
                      enforce_eager=True)
    yield llm
    close_engine(llm)


def test_eager_budget_at_least_prompt_is_plain_vllm(eager):
    ids = prompt_ids(10, 300)
    plain, _ = generate(eager, [ids], params(48, budget="none"))
    big, _ = generate(eager, [ids], params(48, budget=1000))
    assert plain == big


def test_eager_fp32_equals_a_reference_keeping_the_same_tokens(eager, tiny_path):
    _exact_replays(eager, tiny_path)
