"""Long-generation protocol (kvp_vllm.eval.longgen): the server's re-compaction schedule, the chunked
teacher-forced replay against a token-by-token replay of the same compactions, the runner (outputs,
resume) and the CLI's errors. That the replay compacts exactly as the real server does is checked
against a vLLM engine in tests/serving/test_tailpack_exact.py."""

import json
import math

import pytest
import torch

from kvp_vllm.assets import tiny_model
from kvp_vllm.eval import longgen as LG
from kvp_vllm.scorers import make_scorer
from kvp_vllm.serving.replay import hf_replay
from kvp_vllm.serving.scheduler import next_compaction_length


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama", seed=0)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


@pytest.mark.parametrize("n,budget,interval,block", [(300, 64, 16, 8), (1536, 256, 64, 16), (100, 40, 5, 16)])
def test_schedule_is_the_servers(n, budget, interval, block):
    total = n + 700
    sched = LG.compaction_schedule(n, total, budget, interval, block)
    assert sched[0][0] == n, "the first compaction is right after the prompt"
    k_blocks, first_done = 0, False
    for L, keep in sched:
        # the worker's own prediction of the next compaction length agrees
        assert L == next_compaction_length(n, k_blocks, first_done, budget, interval, block)
        assert budget <= keep < budget + block
        assert (L - keep) % block == 0
        k_blocks, first_done = (L - keep) // block, True
    gaps = {b[0] - a[0] for a, b in zip(sched, sched[1:])}
    # the cache grows past budget + interval between compactions, by whole blocks freed
    assert all(interval + 2 - block <= g <= max(interval + 1, block) for g in gaps), gaps
    assert LG.compaction_schedule(n, total, total, interval, block) == []


@pytest.mark.parametrize("rule", ["knorm", "snapkv", "tova", "streaming"])
def test_chunked_replay_equals_token_by_token_decoding(model, rule):
    """Feeding the tokens between compactions as one chunk is exact: the same log-probabilities as
    kvp_vllm.serving.replay.hf_replay, which feeds one token at a time and applies the same kept
    positions (per layer and head) at the same lengths."""
    prompt, forced = _ids(120, 1), _ids(90, 2)
    rep = LG.replay(model, prompt, forced, [make_scorer(rule)], 40, interval=12, block_size=8, window=8,
                    record=True)
    assert rep.compactions == len(rep.history) >= 4
    record = [(L, kept[:, 0]) for L, kept in rep.history]
    tokens, logprobs, _ = hf_replay(model, prompt, len(forced), record, forced=forced)
    assert tokens == forced
    torch.testing.assert_close(torch.tensor(rep.logprobs[0]), torch.tensor(logprobs), rtol=0, atol=2e-5)
    full = LG.replay(model, prompt, forced, [None], None)
    assert max(abs(a - b) for a, b in zip(full.logprobs[0], rep.logprobs[0])) > 1e-3, \
        "eviction changed nothing: the check has no teeth"


def test_batched_rows_equal_single_rows_and_keep_all_equals_full(model):
    prompt, forced = _ids(100, 3), _ids(60, 4)
    rules = ["knorm", "tova", "keydiff"]
    batch = LG.replay(model, prompt, forced, [make_scorer(r) for r in rules], 32, interval=10, block_size=8,
                      window=8, answer_tokens=5)
    for i, r in enumerate(rules):
        one = LG.replay(model, prompt, forced, [make_scorer(r)], 32, interval=10, block_size=8, window=8,
                        answer_tokens=5)
        torch.testing.assert_close(torch.tensor(batch.logprobs[i]), torch.tensor(one.logprobs[0]), rtol=0,
                                   atol=2e-5)
        assert batch.answers[i] == one.answers[0]
    full = LG.replay(model, prompt, forced, [None], None, answer_tokens=5)
    keep_all = LG.replay(model, prompt, forced, [make_scorer("knorm")], 10_000, answer_tokens=5)
    assert keep_all.compactions == 0
    torch.testing.assert_close(torch.tensor(keep_all.logprobs[0]), torch.tensor(full.logprobs[0]), rtol=0,
                               atol=1e-5)
    assert keep_all.answers == full.answers


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvp_vllm.assets import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path(verify=False))


@pytest.fixture(scope="module")
def small_model(tokenizer):
    """A small random Llama with SmolLM2's vocabulary (the real tokenizer and chat template work)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_samples(tokenizer):
    essay = LG.make_long_sample("essay", tokenizer, 300, 100, 0)
    assert len(essay.prompt_ids) == 300 and len(essay.text_continuation) == 100
    recall = LG.make_long_sample("recall", tokenizer, 300, 100, 0)
    assert 250 < len(recall.prompt_ids) <= 300
    text = tokenizer.decode(recall.prompt_ids)
    assert recall.answers[0] in text and "Continue writing" in text
    assert recall.answers[0] not in tokenizer.decode(recall.bridge_ids)
    assert "special magic number" in tokenizer.decode(recall.bridge_ids)
    again = LG.make_long_sample("recall", tokenizer, 300, 100, 0)
    assert again.prompt_ids == recall.prompt_ids
    with pytest.raises(ValueError, match="unknown long-generation kind"):
        LG.make_long_sample("poem", tokenizer, 300, 100, 0)


def test_run_outputs_and_resume(tmp_path, small_model, tokenizer):
    cfg = LG.LongGenConfig(kinds=["essay", "recall"], samples=1, budgets=[48], rules=["knorm", "tova"],
                           prompt_tokens=160, generate=80, interval=16, block_size=8, window=8)
    res = LG.run(cfg, small_model, tokenizer, tmp_path, progress=False)
    rows = LG.read_rows(tmp_path / "rows.jsonl.gz")
    # essay: model + text continuations; recall: model; each with full + 2 rules
    assert len(rows) == 3 * 3
    cells = {(a["kind"], a["target"], a["rule"], a["budget"]): a for a in res["aggregate"]}
    assert cells[("essay", "text", "full", "full")]["delta_logprob_per_token"] == 0
    assert "accuracy" in cells[("recall", "model", "knorm", "48")]
    assert all(r["compactions"] >= 3 for r in rows if r["rule"] != "full")
    assert all(r["tokens"] == 80 for r in rows)
    for name in ("results.json", "summary.md", "per_sample.csv.gz", "longgen_essay_text.png"):
        assert (tmp_path / name).exists(), name
    assert "b=48" in (tmp_path / "summary.md").read_text()
    # resume: nothing recomputed; a new rule adds only its own rows
    again = LG.run(cfg, small_model, tokenizer, tmp_path, progress=False)
    assert again["measured"]["this_invocation"]["samples_computed"] == 0
    cfg.rules = ["knorm", "tova", "streaming"]
    LG.run(cfg, small_model, tokenizer, tmp_path, progress=False)
    assert len(LG.read_rows(tmp_path / "rows.jsonl.gz")) == 3 * 4
    cfg.interval = 32
    with pytest.raises(SystemExit, match="other settings"):
        LG.run(cfg, small_model, tokenizer, tmp_path, progress=False)
    json.loads((tmp_path / "results.json").read_text())


@pytest.mark.parametrize("argv,message", [
    (["--kinds", "poem"], "unknown kind"),
    (["--budgets", "0.25"], "token counts"),
    (["--rules", "oracle"], "unservable rule"),
    (["--budgets", "8"], "budget"),
    (["--interval", "0"], "--interval must be positive"),
])
def test_cli_bad_arguments(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        LG.main(argv + ["--out", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_each_rule_reads_its_own_query_window_beside_expected_attention(model):
    """With Expected Attention in the batch every query is captured (window = ALL_QUERIES): it runs with
    the model's RoPE (hf_rope; without it the rule refuses) on the replayed cache, and SnapKV's row is
    the one it gets when only its own query_window rows are captured (as the worker's window_queries)."""
    from kvp_vllm.capture import hf_rope
    from kvp_vllm.scorers.base import ALL_QUERIES

    assert hf_rope(model) is not None
    prompt, forced = _ids(150, 5), _ids(60, 6)
    snap = make_scorer("snapkv")
    assert 0 < snap.query_window < len(prompt)
    both = LG.replay(model, prompt, forced, [snap, make_scorer("expected_attention")], 48, interval=10,
                     block_size=8, window=ALL_QUERIES, answer_tokens=4)
    alone = LG.replay(model, prompt, forced, [make_scorer("snapkv")], 48, interval=10, block_size=8,
                      window=snap.query_window, answer_tokens=4)
    torch.testing.assert_close(torch.tensor(both.logprobs[0]), torch.tensor(alone.logprobs[0]), rtol=0, atol=2e-5)
    assert both.compactions >= 4
    full = LG.replay(model, prompt, forced, [None], None)
    assert max(abs(a - b) for a, b in zip(full.logprobs[0], both.logprobs[1])) > 1e-3
    assert all(math.isfinite(x) for x in both.logprobs[1])
