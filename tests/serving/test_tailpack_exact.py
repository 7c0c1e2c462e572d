"""Tail-pack is exact: vLLM with eviction (in-process engine, fp32, real SmolLM2, chunked prefill in
128-token chunks) produces the same greedy tokens as a Hugging Face reference whose cache keeps
exactly the same tokens per layer and KV head (positions preserved), and differs from the
uncompressed reference (so the check has teeth): K-Norm's selection recomputed independently after
prefill, and KVP's own server path (the fused score + select) through a decode-time re-compaction,
replayed from what the worker kept (`kvp_vllm.serving.replay`). The freed blocks go back to the pool and come back
when the request ends. The engine has a small block pool so a second test can force preemption.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(900)

PROMPT_REPEATS = 40
BUDGET = 100
BLOCK = 32
NEW_TOKENS = 24
INTERVAL = 48
LONG_TOKENS = 96  # > BUDGET + BLOCK + INTERVAL: compacted after prefill and again while decoding
POOL_BLOCKS = 24  # 768 tokens: room for the exactness test, too small for the preemption test


@pytest.fixture(scope="module")
def engine():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvp_vllm.serving import plugin
    from kvp_vllm.serving.config import ENV_VAR, EvictionConfig

    old = os.environ.get(ENV_VAR)
    from kvp_vllm.serving.config import shipped_checkpoint

    os.environ[ENV_VAR] = EvictionConfig(rule="knorm", budget=BUDGET, interval=INTERVAL,
                                         checkpoint=str(shipped_checkpoint("SmolLM2-135M-Instruct"))).to_env()
    plugin.register()
    from vllm import LLM

    from kvp_vllm.assets import smollm2_path

    llm = LLM(str(smollm2_path()), enforce_eager=True, dtype="float32", max_model_len=736,
              block_size=BLOCK, seed=0, enable_prefix_caching=False, enable_chunked_prefill=True,
              max_num_batched_tokens=128, num_gpu_blocks_override=POOL_BLOCKS)
    yield llm
    del llm
    if old is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = old


def _prompt_ids(tok):
    text = ("Alice keeps her spare key under the blue flower pot. " * PROMPT_REPEATS
            + "Where does Alice keep her spare key?")
    return tok(text).input_ids


@torch.no_grad()
def _hf_reference(model, ids, keep_rule):
    """Greedy decode where, after prefill, each layer/KV head keeps the tokens keep_rule picks."""
    from transformers import DynamicCache

    from kvp_vllm.scorers import LayerKV, make_scorer
    from kvp_vllm.selection import block_aligned_budget, gather_kept, select_topb

    L = len(ids)
    cache = DynamicCache()
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    kept_len = L
    if keep_rule is not None:
        scorer = make_scorer(keep_rule)
        keep = block_aligned_budget(L, BUDGET, BLOCK)
        for li, layer in enumerate(cache.layers):
            k, v = layer.keys[0], layer.values[0]  # [H, L, d], keys post-RoPE
            scores = scorer.score(LayerKV(k, v, torch.arange(L), layer=li))
            kept = select_topb(scores, keep)
            layer.keys = gather_kept(k, kept)[None].contiguous()
            layer.values = gather_kept(v, kept)[None].contiguous()
        kept_len = keep
    for step in range(NEW_TOKENS - 1):
        pos = L + step
        n_cached = kept_len + step
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[pos]]), attention_mask=torch.ones(1, n_cached + 1))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_knorm_eviction_matches_reference_that_keeps_the_same_tokens(engine, smollm2):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, tok = smollm2
    ids = _prompt_ids(tok)
    pool = engine.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            extra_args={"kv_budget": BUDGET})
    got = list(engine.generate([TokensPrompt(prompt_token_ids=ids)], params)[0].outputs[0].token_ids)
    assert pool.get_num_free_blocks() == free_before, "blocks leaked"
    want = _hf_reference(model, ids, "knorm")
    full = _hf_reference(model, ids, None)
    assert got == want
    assert got != full, "the compressed and uncompressed references agree: the check has no teeth"


def test_kvp_and_decode_recompaction_match_a_replay_of_the_kept_tokens(engine, smollm2):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvp_vllm.serving.replay import hf_replay, record_compactions

    model, tok = smollm2
    ids = _prompt_ids(tok)
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True,
                            extra_args={"kv_budget": BUDGET, "kv_rule": "kvp"})
    with record_compactions(engine) as history:
        out = engine.generate([TokensPrompt(prompt_token_ids=ids)], params)[0]
    got = list(out.outputs[0].token_ids)
    (record,) = history.values()
    lengths = [length for length, _ in record]
    assert lengths[0] == len(ids), "the first compaction is right after prefill"
    assert len(lengths) >= 2, f"no decode-time re-compaction in {LONG_TOKENS} tokens: {lengths}"
    for length, kept in record:
        assert kept.shape[2] == length - (length - BUDGET) // BLOCK * BLOCK
        assert not torch.equal(kept[:, 0], kept[:, 1]), "KV heads kept the same tokens"
    want, _, _ = hf_replay(model, ids, LONG_TOKENS, record)
    assert got == want
    full, _, _ = hf_replay(model, ids, LONG_TOKENS)
    assert got != full, "the compressed and uncompressed references agree: the check has no teeth"


def test_preemption_and_recompute_with_mixed_budgets(engine):
    """Requests that outgrow the pool are preempted and recomputed; evicting and non-evicting ones
    mixed. Everything completes, the scheduler's eviction state follows the restarts, no block leaks."""
    from vllm import SamplingParams

    engine_core = engine.llm_engine.engine_core.engine_core
    pool = engine_core.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    # Short prompts are all admitted at once; their growth (80 tokens each) overflows the pool.
    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 5
    budgets = ["none", 32, "none", "none", "none"]
    prompts = [text + f" Item {i}:" for i in range(len(budgets))]
    params = [SamplingParams(max_tokens=80, temperature=0, ignore_eos=True,
                             extra_args={"kv_budget": b}) for b in budgets]
    preemptions = []
    scheduler = engine_core.scheduler
    original = scheduler._preempt_request

    def spy(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = spy
    try:
        outs = engine.generate(prompts, params)
    finally:
        del scheduler._preempt_request
    assert preemptions, "the pool was large enough: nothing was preempted"
    assert all(len(o.outputs[0].token_ids) == 80 for o in outs)
    assert pool.get_num_free_blocks() == free_before, "blocks leaked"
    assert not scheduler._kvp.reqs, "eviction state of finished requests was kept"


@pytest.mark.parametrize("rule", ["kvp", "snapkv"])
def test_long_generation_harness_replays_the_servers_compactions(engine, smollm2, rule):
    """The harness's long-generation protocol (kvp_vllm.eval.longgen) claims to evict exactly as the
    server does while decoding: fed the server's own greedy tokens, its replay compacts at the same
    lengths and keeps the same positions per layer and head (KVP through the policy, SnapKV through
    queries the replay captures itself), and every forced token is its own argmax (the replayed
    caches predict what the server generated)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvp_vllm.eval.longgen import replay
    from kvp_vllm.scorers import make_scorer
    from kvp_vllm.serving.config import shipped_checkpoint
    from kvp_vllm.serving.replay import record_compactions

    model, tok = smollm2
    ids = _prompt_ids(tok)
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True,
                            extra_args={"kv_budget": BUDGET, "kv_rule": rule})
    with record_compactions(engine) as history:
        got = list(engine.generate([TokensPrompt(prompt_token_ids=ids)], params)[0].outputs[0].token_ids)
    (record,) = history.values()
    scorer = (make_scorer("kvp", checkpoint=str(shipped_checkpoint("SmolLM2-135M-Instruct")))
              if rule == "kvp" else make_scorer(rule))
    # the server fed got[:-1] (the last token was sampled, never fed)
    rep = replay(model, ids, got[:-1], [scorer], BUDGET, interval=INTERVAL, block_size=BLOCK, record=True)
    assert [length for length, _ in rep.history] == [length for length, _ in record]
    assert len(record) >= 2, "no decode-time re-compaction: the check covers the prefill only"
    for (length, ours), (_, theirs) in zip(rep.history, record):
        ours = ours[:, 0].to(theirs.dtype)
        assert ours.shape == theirs.shape
        if rule == "kvp":
            assert torch.equal(ours, theirs), f"kept positions differ at length {length}"
        else:  # queries recomputed in fp32 by HF vs captured from vLLM: allow a rare near-tie swap
            same = sum(len(set(a.tolist()) & set(b.tolist()))
                       for a, b in zip(ours.flatten(0, 1), theirs.flatten(0, 1)))
            assert same >= 0.995 * theirs.numel(), f"kept positions differ at length {length}"
    assert all(rep.top1[0]), "the replayed caches do not predict the server's own tokens"


def test_expected_attention_through_the_server(engine, smollm2):
    """Expected Attention served: the worker captures every prompt query across the 128-token prefill
    chunks and un-rotates them with vLLM's own RoPE (`worker.model_rope`, equal to HF's); after prefill it keeps, per
    layer and KV head, the tokens the rule keeps from Hugging Face's queries of the same prompt (>= 99.5%:
    vLLM's and HF's fp32 queries differ by rounding), and the decode-time re-compaction (queries of the
    tokens since the last compaction, per-head positions) scores without error; the generated tokens
    are those of a replay of the kept tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvp_vllm.capture import forward_capture
    from kvp_vllm.scorers import make_scorer
    from kvp_vllm.selection import select_topb
    from kvp_vllm.serving.metrics import metrics
    from kvp_vllm.serving.replay import hf_replay, record_compactions, worker_eviction

    model, tok = smollm2
    ids = _prompt_ids(tok)
    errors = metrics().scoring_errors.labels("expected_attention")
    errors_before = errors._value.get()
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True,
                            extra_args={"kv_budget": BUDGET, "kv_rule": "expected_attention"})
    with record_compactions(engine) as history:
        out = engine.generate([TokensPrompt(prompt_token_ids=ids)], params)[0]
    got = list(out.outputs[0].token_ids)
    assert errors._value.get() == errors_before, "the rule failed and recency was used"
    (record,) = history.values()
    assert record[0][0] == len(ids) and len(record) >= 2, [length for length, _ in record]
    # vLLM's RoPE, as the worker reads it, is the model's own (HF's)
    rope = worker_eviction(engine).rope
    cap = forward_capture(model, torch.tensor([ids]), query_last=len(ids))
    assert rope is not None and torch.allclose(rope.inv_freq.cpu(), cap.rope.inv_freq)
    assert rope.attention_scaling == pytest.approx(cap.rope.attention_scaling)
    scorer = make_scorer("expected_attention")
    kept = record[0][1]  # [layers, H, b'] positions kept after prefill
    same = 0
    for layer in range(len(cap.keys)):
        ours = select_topb(scorer.score(cap.layer_kv(layer)), kept.shape[2])
        same += sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ours, kept[layer]))
    print(f"expected_attention: server kept {same / kept.numel():.4f} of the harness definition's tokens")
    assert same >= 0.995 * kept.numel(), same / kept.numel()
    want, _, _ = hf_replay(model, ids, LONG_TOKENS, record)
    assert got == want
