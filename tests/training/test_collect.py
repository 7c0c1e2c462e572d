"""Trace collection: layout, the stored future importance, resume, the content digest, and bad input."""

import json
import shutil

import pytest
import torch

from kvp_vllm.assets import tiny_model
from kvp_vllm.capture import forward_capture
from kvp_vllm.importance import future_importance
from kvp_vllm.training import prompts
from kvp_vllm.training.collect import (MANIFEST, CollectConfig, TraceError, TraceSet, collect, load_model,
                                       resolve_model)



def _assert_importance_of_one_forward(model, ts, tid, context, question=()):
    """The stored importance of trace `tid` equals the one computed from a single forward of its context
    + question (if any) + answer (the future queries are the inputs after the context). Returns that
    forward's capture."""
    meta = ts.meta(tid)
    cap = forward_capture(model, torch.tensor([list(context) + list(question) + meta["answer_ids"]]),
                          query_last=len(question) + meta["n_answer"])
    for layer in range(ts.shape.num_layers):
        c = future_importance(cap.queries[layer], cap.keys[layer], meta["n_prompt"])
        stored = ts.load(tid, layer)["importance"]
        assert torch.allclose(stored, c, atol=2e-4), (layer, (stored - c).abs().max())
    return cap


def _assert_refused_before_writing(tmp_path, settings, cases):
    """Each (override, message) of `cases` on top of `settings` is refused with that message, and
    nothing is written."""
    for bad, why in cases:
        kw = {"model": "tiny-llama", "num_traces": 1, "answer_tokens": 2, **settings, **bad}
        with pytest.raises(TraceError, match=why):
            collect(CollectConfig(**kw), tmp_path / "refused", progress=False)
        assert not (tmp_path / "refused").exists()


def test_layout_and_manifest(tiny_traces):
    ts = TraceSet(tiny_traces)
    m = ts.manifest
    assert (ts.shape.num_layers, ts.shape.num_kv_heads, ts.shape.head_dim) == (3, 2, 16)
    assert m["config"]["lengths"] == [512, 576] and m["config"]["seed"] == prompts.TRAIN_SEED_BASE
    assert len(m["shards"]) == 4 and len(ts.trace_ids) == 16
    assert sorted(p.name for p in tiny_traces.iterdir()) == ["layer_00", "layer_01", "layer_02", MANIFEST]
    assert len(ts.split("test")) == 2 and len(ts.split("val")) == 2 and len(ts.split("train")) == 12
    d = ts.load("t00003", 1)
    n = m["traces"]["t00003"]["n_prompt"]
    assert d["keys"].shape == (2, n, 16) and d["keys"].dtype == torch.bfloat16
    assert d["importance"].shape == (2, n) and d["importance"].dtype == torch.float32
    assert d["window_queries"].shape == (4, 16, 16)
    assert {t["task"] for t in m["traces"].values()} == set(m["config"]["tasks"])
    tasks = set(m["config"]["tasks"])
    assert tasks & set(prompts.CHAT_TASKS) and tasks - set(prompts.CHAT_TASKS)  # harness and chat kinds


def test_prompts_come_from_the_harness_with_disjoint_seeds(tiny_traces):
    """A needle trace's prompt is the harness's own sample (seed >= TRAIN_SEED_BASE), and differs from
    every evaluation sample of the same task and length (seeds < TRAIN_SEED_BASE)."""
    from kvp_vllm.eval.tasks import make_sample

    ts = TraceSet(tiny_traces)
    _, tok, _ = load_model(resolve_model("tiny-llama"))
    tid, meta = next((t, m) for t, m in ts.manifest["traces"].items() if m["task"] == "niah_single_repeat")
    ids = prompts.prompt_ids(tok, meta["task"], meta["target_tokens"], meta["seed"])
    sample = make_sample(meta["task"], tok, meta["target_tokens"], index=0, seed=meta["seed"])
    assert ids == sample.prompt_ids and len(ids) == meta["n_prompt"] <= meta["target_tokens"]
    assert meta["seed"] >= prompts.TRAIN_SEED_BASE
    assert tok.decode(sample.context_ids).count(sample.answers[0]) == 1  # the needle is in the trace
    evals = {tuple(make_sample(meta["task"], tok, meta["target_tokens"], index=i, seed=0).prompt_ids)
             for i in range(8)}
    assert tuple(ids) not in evals


def test_stored_importance_matches_a_full_forward(tiny_traces):
    """c from the step-by-step greedy decode equals c from one forward of prompt + answer."""
    ts = TraceSet(tiny_traces)
    model, tok, _ = load_model(resolve_model("tiny-llama"))
    meta = ts.meta("t00005")
    ids = prompts.prompt_ids(tok, meta["task"], meta["target_tokens"], meta["seed"])
    assert len(ids) == meta["n_prompt"]
    assert len(meta["answer_ids"]) == meta["n_answer"]
    cap = _assert_importance_of_one_forward(model, ts, "t00005", ids)
    for layer in range(3):
        assert torch.allclose(ts.load("t00005", layer)["keys"].float(),
                              cap.keys[layer][:, :meta["n_prompt"]], atol=0.05)


def test_resume_adds_shards_without_rewriting(tmp_path):
    cfg = CollectConfig(model="tiny-llama", lengths=(48,), num_traces=4, answer_tokens=2, window=8,
                        traces_per_shard=2, tasks=("essay_qa", "conversation"))
    out = collect(cfg, tmp_path / "t", progress=False)
    before = (out / "layer_00" / "shard_00000.safetensors").stat().st_mtime_ns
    first = TraceSet(out).content_sha256
    again = collect(cfg, tmp_path / "again", progress=False)  # same settings, same machine: same bytes
    assert TraceSet(again).content_sha256 == first
    cfg.num_traces = 6
    collect(cfg, out, progress=False)
    ts = TraceSet(out)
    assert len(ts.trace_ids) == 6
    assert ts.content_sha256 != first  # the digest covers every shard
    assert {s["environment"]["cpu_capability"] for s in ts.manifest["shards"]} == \
        {torch.backends.cpu.get_cpu_capability()}
    assert (out / "layer_00" / "shard_00000.safetensors").stat().st_mtime_ns == before
    cfg.answer_tokens = 3  # other settings: refuse to mix
    with pytest.raises(TraceError, match="other settings"):
        collect(cfg, out, progress=False)
    assert not list(out.rglob("*.tmp"))


def test_bad_inputs(tiny_traces, tmp_path):
    with pytest.raises(TraceError, match="unknown model"):
        collect(CollectConfig(model=str(tmp_path / "nope")), tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()  # nothing half-written
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(TraceError, match="not empty"):
        collect(CollectConfig(model="tiny-llama", lengths=(48,), num_traces=1, answer_tokens=1,
                              tasks=("essay_qa",)), tmp_path / "busy", progress=False)
    # a harness task that cannot fit the length, an unknown task: clear errors, nothing written
    with pytest.raises(TraceError, match="cannot build the niah_multikey prompt at 48 tokens"):
        collect(CollectConfig(model="tiny-llama", lengths=(48,), num_traces=4, answer_tokens=1,
                              tasks=("essay_qa", "niah_multikey")), tmp_path / "short", progress=False)
    with pytest.raises(TraceError, match="unknown prompt task 'needle'"):
        collect(CollectConfig(model="tiny-llama", lengths=(48,), num_traces=1, answer_tokens=1,
                              tasks=("needle",)), tmp_path / "short", progress=False)
    with pytest.raises(TraceError, match="seed must be at least 1000000"):
        collect(CollectConfig(model="tiny-llama", lengths=(48,), num_traces=1, answer_tokens=1,
                              tasks=("essay_qa",), seed=5), tmp_path / "short", progress=False)
    assert not (tmp_path / "short").exists()
    with pytest.raises(TraceError, match="not a trace folder"):
        TraceSet(tmp_path)
    # traces from another model
    with pytest.raises(TraceError, match="other settings|holds traces"):
        collect(CollectConfig(model="tiny-qwen2", lengths=(512, 576), num_traces=16, answer_tokens=6,
                              window=16, traces_per_shard=4, tasks=tuple(TraceSet(tiny_traces).manifest[
                                  "config"]["tasks"])), tiny_traces, progress=False)
    from kvp_vllm.policy import ModelShape
    with pytest.raises(TraceError, match="come from"):
        TraceSet(tiny_traces).check_model(ModelShape(30, 3, 64, "SmolLM2"))
    # corrupt and empty shards
    bad = tmp_path / "bad"
    shutil.copytree(tiny_traces, bad)
    shard = bad / "layer_01" / "shard_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="corrupt"):
        TraceSet(bad).load("t00000", 1)
    shard.write_bytes(b"")
    with pytest.raises(TraceError, match="empty or truncated"):
        TraceSet(bad).load("t00000", 1)
    (bad / MANIFEST).write_text("{not json")
    with pytest.raises(TraceError, match="not a valid trace manifest"):
        TraceSet(bad)


def test_real_model_collection_smoke(tmp_path):
    """One short SmolLM2 trace on the real model."""
    torch.set_num_threads(1)
    out = collect(CollectConfig(model="smollm2", lengths=(192,), num_traces=1, answer_tokens=2, window=8,
                                tasks=("niah_single_repeat",)), tmp_path / "s", progress=False)
    ts = TraceSet(out)
    assert (ts.shape.num_layers, ts.shape.num_kv_heads, ts.shape.head_dim) == (30, 3, 64)
    assert ts.shape.model_name == "SmolLM2-135M-Instruct"
    d = ts.load("t00000", 29)
    n = ts.meta("t00000")["n_prompt"]
    assert d["keys"].shape == (3, n, 64) and torch.isfinite(d["importance"]).all()
    # each answer query adds at most 1 per query head of the group (max over 3 heads): <= 3 x 2 queries
    assert 0 < float(d["importance"].sum(1).max()) <= 3 * 2 + 1e-3


def test_decode_tokens_store_the_cache_mid_generation(tmp_path):
    """--decode-tokens G: the trace's context is the prompt plus the model's own G greedy tokens (EOS
    banned), and the importance is that of the answer written after them, as one forward computes it."""
    from kvp_vllm.eval.longgen import greedy_continuation

    cfg = CollectConfig(model="tiny-llama", lengths=(64,), num_traces=2, answer_tokens=4, window=8,
                        traces_per_shard=2, tasks=("essay_qa",), decode_tokens=24)
    out = collect(cfg, tmp_path / "gen", progress=False)
    ts = TraceSet(out)
    model, tok, _ = load_model(resolve_model("tiny-llama"))
    for tid in ts.trace_ids:
        meta = ts.meta(tid)
        prompt = prompts.prompt_ids(tok, meta["task"], meta["target_tokens"], meta["seed"])
        own = greedy_continuation(model, prompt, 24)
        assert meta["generated_ids"] == own and meta["n_prompt"] == len(prompt) + 24
        _assert_importance_of_one_forward(model, ts, tid, prompt + own)
        for layer in range(3):
            assert ts.load(tid, layer)["keys"].shape[1] == meta["n_prompt"]
    cfg.decode_tokens = 0  # another setting: no silent mix of mid-generation and prompt-only traces
    with pytest.raises(TraceError, match="other settings"):
        collect(cfg, out, progress=False)
    cfg.decode_tokens = -1
    with pytest.raises(TraceError, match="decode_tokens >= 0"):
        collect(cfg, tmp_path / "neg", progress=False)


def test_future_reference_teacher_forces_the_reference_continuation(tmp_path):
    """--future reference: the answer is the harness task's reference continuation (the held-out essay
    text of ppl_essay), teacher-forced, not the model's greedy answer, and the importance is that of
    its queries, as one forward of prompt + reference computes it."""
    cfg = CollectConfig(model="tiny-llama", lengths=(160,), num_traces=2, answer_tokens=6, window=8,
                        traces_per_shard=2, tasks=("ppl_essay",), future="reference")
    out = collect(cfg, tmp_path / "ref", progress=False)
    ts = TraceSet(out)
    from kvp_vllm.eval.longgen import greedy_continuation

    model, tok, _ = load_model(resolve_model("tiny-llama"))
    for tid in ts.trace_ids:
        meta = ts.meta(tid)
        prompt = prompts.prompt_ids(tok, meta["task"], meta["target_tokens"], meta["seed"])
        reference = prompts.reference_ids(tok, meta["task"], meta["target_tokens"], meta["seed"])
        assert len(reference) == 64 and meta["answer_ids"] == reference[:6] and meta["n_prompt"] == len(prompt)
        assert greedy_continuation(model, prompt, 6) != reference[:6]  # the greedy answer is another one
        _assert_importance_of_one_forward(model, ts, tid, prompt)
    cfg.future = "greedy"  # another setting: no silent mix of targets in one folder
    with pytest.raises(TraceError, match="other settings"):
        collect(cfg, out, progress=False)
    # refused before anything is written: chat tasks (no reference), mid-generation caches, unknown names
    _assert_refused_before_writing(tmp_path, {"lengths": (160,), "tasks": ("ppl_essay",), "future": "reference"},
                                   (({"tasks": ("ppl_essay", "conversation")}, "conversation has no reference"),
                                    ({"decode_tokens": 8}, "needs --decode-tokens 0"),
                                    ({"future": "oracle"}, "unknown future 'oracle'")))


def test_compress_at_context_stores_the_query_agnostic_cache(tmp_path):
    """--compress-at context: the trace's cache is the harness task's context alone, the question is
    fed after it, and the importance sums the queries of question and answer, as one forward of
    context + question + answer computes it (the harness's query-agnostic oracle)."""
    from kvp_vllm.eval.tasks import make_sample

    cfg = CollectConfig(model="tiny-llama", lengths=(512,), num_traces=2, answer_tokens=4, window=8,
                        traces_per_shard=2, tasks=("niah_single_repeat",), compress_at="context")
    out = collect(cfg, tmp_path / "ctx", progress=False)
    ts = TraceSet(out)
    model, tok, _ = load_model(resolve_model("tiny-llama"))
    for tid in ts.trace_ids:
        meta = ts.meta(tid)
        sample = make_sample(meta["task"], tok, meta["target_tokens"], index=0, seed=meta["seed"])
        assert meta["n_prompt"] == len(sample.context_ids) and meta["question_ids"] == sample.question_ids
        _assert_importance_of_one_forward(model, ts, tid, sample.context_ids, sample.question_ids)
    cfg.compress_at = "prompt"  # another setting: no silent mix of query-aware and -agnostic caches
    with pytest.raises(TraceError, match="other settings"):
        collect(cfg, out, progress=False)
    _assert_refused_before_writing(
        tmp_path, {"lengths": (512,), "tasks": ("niah_single_repeat",), "compress_at": "context"},
        (({"tasks": ("niah_single_repeat", "essay_qa")}, "essay_qa has no context/question"),
         ({"decode_tokens": 8}, "needs --decode-tokens 0"),
         ({"compress_at": "question"}, "unknown compress_at 'question'")))
