"""The two stronger baselines of issue 16 in the harness: KVzip's reconstruction pass (scores equal a
direct computation from the model's own attention weights; the runner records its extra prefill) and
Expected Attention (fed every cached token's query and the model's RoPE; equal to kvpress on the same
queries: tests/test_scorers.py)."""

import pytest
import torch

from kvp_vllm.assets import tiny_model
from kvp_vllm.eval import protocol as P
from kvp_vllm.scorers import make_scorer


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama", seed=0)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


@torch.no_grad()
def _direct_kvzip(model, ids, prompts, n_sink=4, chunk_size=2048, prev_postfix_size=8):
    """KVzip's scores from the model's own (eager) attention weights: for each chunk, the whole
    sequence cache + reconstruction input run from scratch, the input's attention over the kept subset
    (first min(n_sink, head) tokens, the chunk, the input itself) renormalised, max over the group and
    the input's queries."""
    t = len(ids)
    start = prompts.prefix_length
    ctx = ids[start:]
    chunks = [ctx[i:i + chunk_size] for i in range(0, len(ctx), chunk_size)]
    layers = model.config.num_hidden_layers
    h = model.config.num_key_value_heads
    out = torch.zeros(layers, h, t)
    out[:, :, :n_sink] = 1.0
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for i, chunk in enumerate(chunks):
            q_ids = prompts.first_ids if i == 0 else prompts.next_ids + chunks[i - 1][-prev_postfix_size:]
            feed = q_ids + prompts.suffix_ids + chunk
            seq = torch.tensor([ids + feed])
            att = model(seq, output_attentions=True).attentions  # per layer [1, Hq, t+q, t+q]
            end = start + len(chunk)
            sink = min(n_sink, start)
            subset = list(range(sink)) + list(range(start, end)) + list(range(t, t + len(feed)))
            for layer in range(layers):
                a = att[layer][0, :, t:][:, :, subset]          # [Hq, q, S]
                a = a / a.sum(-1, keepdim=True)
                a = a[:, :, sink:sink + len(chunk)]
                a = a.reshape(h, -1, len(feed), len(chunk)).amax(dim=(1, 2))
                out[layer, :, start:end] = a
            start = end
    finally:
        model.set_attn_implementation(impl)
    return out


@pytest.mark.parametrize("prefix, chunk_size", [(0, 2048), (6, 2048), (6, 17), (2, 25)])
def test_kvzip_scores_equal_the_max_reconstruction_attention(model, prefix, chunk_size):
    ids = _ids(60, seed=prefix + chunk_size)
    prompts = P.KVzipPrompts(prefix_length=prefix, suffix_ids=[7, 8, 9], first_ids=[11, 12, 13, 14],
                             next_ids=[21, 22, 23, 24, 25])
    pre = P.prefill(model, ids + [30, 31, 32], n_context=60, window=8)
    sc = make_scorer("kvzip", chunk_size=chunk_size)
    got, fed = P.kvzip_importance(model, pre, "query_agnostic", prompts, sc)
    want = _direct_kvzip(model, ids, prompts, chunk_size=chunk_size)
    n_chunks = -(-(60 - prefix) // chunk_size)
    # chunk 0: repeat prompt (4) + suffix (3) + chunk; next chunks: prompt (5) + the previous 8 + suffix + chunk
    assert fed == 60 - prefix + 3 * n_chunks + 4 + 13 * (n_chunks - 1), "tokens fed: the extra prefill"
    # also with queries in blocks smaller than the input: the causal mask of each block's own keys
    blocked, _ = P.kvzip_reconstruction(model, [k[:, :60] for k in pre.keys], [v[:, :60] for v in pre.values],
                                        ids, prompts, chunk_size=chunk_size, query_block=5)
    for layer in range(len(got)):
        assert got[layer].shape == (2, 60)
        for s in (got[layer], blocked[layer]):
            assert torch.allclose(s, want[layer], atol=1e-5), (layer, (s - want[layer]).abs().max())
    if prefix > 4:  # the chat template's head after the sinks is never reconstructed: scored 0
        assert (got[0][:, 4:prefix] == 0).all() and (got[0][:, :4] == 1).all()
    # the rule ranks by those scores; query-aware reconstructs context + question
    kept = P.kept_indices(P.rule_scores(sc, pre, "query_agnostic", reconstruction=got), 20, "none")
    assert all(k.shape == (2, 20) for k in kept)
    aware, fed_aware = P.kvzip_importance(model, pre, "query_aware", prompts, sc)
    assert aware[0].shape == (2, 62) and fed_aware == fed + 2


def test_kvzip_prompts_split_the_chat_template_like_kvpress():
    """kvpress KVzipPress.__call__: prefix = the template before a dummy context, suffix = after a
    "\\n####..." separator; the two repeat prompts of KVzipPress.prepare."""
    from transformers import AutoTokenizer

    from kvp_vllm.assets import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path(verify=False))
    dummy_context = "dummy context"
    separator = "\n" + "#" * len(dummy_context)
    temp_context = tok.apply_chat_template([{"role": "user", "content": dummy_context + separator}],
                                           add_generation_prompt=True, tokenize=False, enable_thinking=False)
    context, suffix_text = temp_context.split(separator)
    prefix_text = context.split(dummy_context)[0]
    got = P.KVzipPrompts.for_tokenizer(tok)
    assert got.prefix_length == tok.encode(prefix_text, return_tensors="pt", add_special_tokens=False).shape[-1]
    assert got.suffix_ids == tok.encode(suffix_text, add_special_tokens=False)
    assert got.first_ids == tok.encode("\n\nRepeat the previous context exactly.", add_special_tokens=False)
    assert got.next_ids == tok.encode("\n\nRepeat the part of the previous context exactly, starting with",
                                      add_special_tokens=False)


def test_expected_attention_in_the_harness_reads_every_query_and_the_rope(model):
    """The prefill captures every cached token's query when Expected Attention is among the rules (other
    rules still get the last `window`), and the rule's scores are those of a LayerKV built directly from
    a full capture and the model's RoPE."""
    from kvp_vllm.capture import forward_capture, hf_rope
    from kvp_vllm.scorers import LayerKV

    ids = _ids(70, seed=3)
    ea, snap = make_scorer("expected_attention"), make_scorer("snapkv")
    assert P.capture_window(8, [ea, snap]) > 70 and P.capture_window(8, [snap]) == 64
    pre = P.prefill(model, ids, n_context=50, window=8, capture=P.capture_window(8, [ea, snap]))
    assert pre.q_aware[0].shape[1] == 69 and pre.q_context[0].shape[1] == 50
    assert pre.layer_kv(0, "query_aware").queries.shape[1] == 8, "other rules get the harness window"
    for protocol, t in (("query_aware", 69), ("query_agnostic", 50)):
        got = P.rule_scores(ea, pre, protocol)
        cap = forward_capture(model, torch.tensor([ids[:t]]), query_last=t)
        for layer in range(3):
            kv = LayerKV(cap.keys[layer], cap.values[layer], torch.arange(t), cap.queries[layer],
                         rope=hf_rope(model))
            assert torch.allclose(got[layer], ea.score(kv), rtol=1e-4, atol=1e-6)
    small = P.prefill(model, ids, n_context=50, window=8)
    with pytest.raises(ValueError, match="every cached token"):
        P.rule_scores(ea, small, "query_aware")


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from kvp_vllm.assets import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path(verify=False))


@pytest.fixture(scope="module")
def small_model(smol_tokenizer):
    """A small random Llama with SmolLM2's vocabulary (the real tokenizer and chat template work)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=4096, eos_token_id=smol_tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("protect", ["paper", "none"])
def test_runner_runs_both_rules_and_records_kvzips_extra_prefill(tmp_path, small_model, smol_tokenizer, protect):
    from kvp_vllm.eval.runner import EvalConfig, read_rows, run

    cfg = EvalConfig(tasks=["niah_single_repeat"], lengths=[256], samples=1, budgets=[32, 4096],
                     rules=["kvzip", "expected_attention"], protocols=["query_aware", "query_agnostic"],
                     protect=protect)
    res = run(cfg, small_model, smol_tokenizer, tmp_path, progress=False, plots=False)
    rows = read_rows(tmp_path / "rows.jsonl")
    by = {(r["protocol"], r["rule"], r["budget"]): r for r in rows}
    assert len(rows) == 2 * (1 + 2 * 2)
    for protocol in ("query_aware", "query_agnostic"):
        z = by[(protocol, "kvzip", "32")]
        assert z["kept"] == 32 and z["rule_def"] == "v1" and z["protect"] == protect
        # the reconstruction feeds the context again (plus the prompt), once per protocol
        assert z["extra_prefill_tokens"] > 0.8 * z["cache_len"] and z["extra_prefill_seconds"] > 0
        assert by[(protocol, "kvzip", "4096")]["extra_prefill_tokens"] == z["extra_prefill_tokens"]
        assert "extra_prefill_tokens" not in by[(protocol, "expected_attention", "32")]
        assert by[(protocol, "expected_attention", "32")]["kept"] == 32
    assert "kvzip_reconstruction" in res["measured"]["this_invocation"]["seconds_by_stage"]
    agg = {(a["protocol"], a["rule"], a["budget"]): a for a in res["aggregate"]}
    assert agg[("query_aware", "kvzip", "32")]["extra_prefill_tokens_mean"] > 0
    assert "extra_prefill_tokens_mean" not in agg[("query_aware", "expected_attention", "32")]


@pytest.mark.real_model
def test_real_smollm2_kvzip_and_expected_attention_end_to_end(smol_tokenizer):
    """SmolLM2-135M on a short needle sample: the harness runs both rules under both protocols; the full
    cache answers, and so does KVzip at half the context (it keeps what the model can reconstruct)."""
    from collections import defaultdict

    from transformers import AutoModelForCausalLM

    from kvp_vllm.assets import smollm2_path
    from kvp_vllm.eval.runner import evaluate_sample
    from kvp_vllm.eval.tasks import make_sample

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(verify=False), dtype=torch.float32).eval()
    s = make_sample("niah_single_repeat", smol_tokenizer, 512, 0)
    timings = defaultdict(float)
    rows = evaluate_sample(model, smol_tokenizer, s, ["kvzip", "expected_attention"], [0.5],
                           ["query_aware", "query_agnostic"], timings=timings)
    by = {(r["protocol"], r["rule"]): r for r in rows}
    print({k: (r["output"], r.get("extra_prefill_tokens")) for k, r in by.items()})
    assert len(rows) == 6
    assert by[("query_aware", "full")]["correct"], by[("query_aware", "full")]["output"]
    assert by[("query_aware", "kvzip")]["correct"], by[("query_aware", "kvzip")]["output"]
    for protocol in ("query_aware", "query_agnostic"):
        z = by[(protocol, "kvzip")]
        assert z["kept"] == round(0.5 * z["cache_len"])
        prefix = P.KVzipPrompts.for_tokenizer(smol_tokenizer).prefix_length
        assert z["extra_prefill_tokens"] > z["cache_len"] - prefix
    assert timings["kvzip_reconstruction"] > 0
