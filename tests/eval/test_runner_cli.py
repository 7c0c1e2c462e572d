"""Runner (outputs, resume, adding a rule later), CLI argument errors, and a sanity check on the real
model (full cache solves an easy needle; the oracle beats random eviction)."""

import gzip
import json

import pytest
import torch

from kvp_vllm.eval import cli
from kvp_vllm.eval.runner import EvalConfig, read_rows, row_key, run, task_average
from kvp_vllm.eval.store import _scan, append_rows, read_bytes, read_csv


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


def test_run_outputs_and_resume(tmp_path, small_model, tokenizer):
    def cfg(samples, rules):
        return EvalConfig(tasks=["niah_single_repeat", "ppl_essay"], lengths=[256], samples=samples,
                          budgets=[32, 0.5, 4096], rules=rules, protocols=["query_aware", "query_agnostic"])

    res = run(cfg(1, ["random", "oracle"]), small_model, tokenizer, tmp_path, progress=False)
    assert res["measured"]["this_invocation"]["samples_computed"] == 2
    assert res["measured"]["samples_per_task_all_rules"] == {"niah_single_repeat/256": 1, "ppl_essay/256": 1}
    rows = read_rows(tmp_path / "rows.jsonl")  # finds rows.jsonl.gz
    # niah: 2 protocols x (full + 2 rules x 3 budgets); ppl: 1 protocol (no question) x 7
    assert len(rows) == 14 + 7
    assert len({row_key(r) for r in rows}) == len(rows)
    # the raw files are compressed; the store was rewritten as one gzip member when the run ended
    assert not (tmp_path / "rows.jsonl").exists() and not (tmp_path / "per_sample.csv").exists()
    assert _scan((tmp_path / "rows.jsonl.gz").read_bytes()).members == 1
    assert len(read_csv(tmp_path / "per_sample.csv.gz")) == len(rows)
    assert len(read_bytes(tmp_path / "progress.log.gz").splitlines()) == 2
    for name in ["results.json", "per_sample.csv.gz", "aggregate.csv", "eval_accuracy_query_aware_256.png",
                 "eval_task_average_256.png",
                 "eval_perplexity_ppl_essay_256.png", "eval_loglik_query_agnostic_256.png"]:
        assert (tmp_path / name).exists(), name
    # budget >= the context reproduces the full cache
    big = [r for r in rows if r["budget"] == "4096"]
    assert big and all(r["same_as_full"] and r["kept"] == r["cache_len"] for r in big)
    small = [r for r in rows if r["budget"] == "32"]
    assert all(r["kept"] == 32 for r in small)

    # rerun: nothing to do; more samples: only the new ones; a new rule: only that rule
    assert run(cfg(1, ["random", "oracle"]), small_model, tokenizer, tmp_path,
               progress=False, plots=False)["measured"]["this_invocation"]["samples_computed"] == 0
    assert run(cfg(2, ["random", "oracle"]), small_model, tokenizer, tmp_path,
               progress=False, plots=False)["measured"]["this_invocation"]["samples_computed"] == 2
    before = {row_key(r): r for r in read_rows(tmp_path / "rows.jsonl")}
    res = run(cfg(2, ["random", "oracle", "knorm"]), small_model, tokenizer, tmp_path, progress=False,
              plots=False)
    assert res["measured"]["this_invocation"]["samples_computed"] == 4
    after = read_rows(tmp_path / "rows.jsonl")
    assert len({row_key(r) for r in after}) == len(after) == len(before) + 2 * 2 * 3 + 2 * 3
    assert {r["rule"] for r in after} - {r["rule"] for r in before.values()} == {"knorm"}
    assert json.loads((tmp_path / "results.json").read_text())["aggregate"] == "aggregate.csv"
    agg = read_csv(tmp_path / "aggregate.csv")
    assert any(a["rule"] == "knorm" and a["n"] == "2" for a in agg)
    assert any(a["rule"] == "knorm" and a["n"] == 2 for a in res["aggregate"])


def _one_task_cfg(samples):
    return EvalConfig(tasks=["niah_single_repeat"], lengths=[256], samples=samples, budgets=[32],
                      rules=["random"], protocols=["query_aware"])


def test_resume_from_a_cut_gz_store(tmp_path, small_model, tokenizer):
    """A run killed mid-write leaves a cut gzip member: the rows before it are kept, the cut sample is
    recomputed, and the store reads whole again."""
    run(_one_task_cfg(2), small_model, tokenizer, tmp_path, progress=False, plots=False)
    store = tmp_path / "rows.jsonl.gz"
    whole = read_rows(store)
    assert len(whole) == 4  # 2 samples x (full, random)
    two_samples = store.read_bytes()
    run(_one_task_cfg(3), small_model, tokenizer, tmp_path, progress=False, plots=False)
    third = [r for r in read_rows(store) if r["index"] == 2]
    store.write_bytes(two_samples)  # as if the third sample's append had been cut short:
    append_rows(store, third)
    store.write_bytes(store.read_bytes()[:-15])
    assert read_rows(store)[:4] == whole
    res = run(_one_task_cfg(3), small_model, tokenizer, tmp_path, progress=False, plots=False)
    assert res["measured"]["rows"] == 6
    assert res["measured"]["samples_per_task_all_rules"] == {"niah_single_repeat/256": 3}
    assert len({row_key(r) for r in read_rows(store)}) == 6
    assert _scan(store.read_bytes()).damage is None


def test_a_plain_rows_jsonl_folder_keeps_its_store(tmp_path, small_model, tokenizer):
    """A folder from before compression: resuming appends to its plain rows.jsonl (no second store);
    per_sample.csv is rewritten compressed; a folder with both stores is refused."""
    run(_one_task_cfg(1), small_model, tokenizer, tmp_path, progress=False, plots=False)
    (tmp_path / "rows.jsonl").write_bytes(read_bytes(tmp_path / "rows.jsonl.gz"))  # as an old run left it
    (tmp_path / "progress.log").write_bytes(read_bytes(tmp_path / "progress.log.gz"))
    (tmp_path / "per_sample.csv").write_bytes(read_bytes(tmp_path / "per_sample.csv.gz"))
    for name in ("rows.jsonl.gz", "progress.log.gz", "per_sample.csv.gz"):
        (tmp_path / name).unlink()
    res = run(_one_task_cfg(2), small_model, tokenizer, tmp_path, progress=False, plots=False)
    assert res["measured"]["this_invocation"]["samples_computed"] == 1
    assert len(read_rows(tmp_path / "rows.jsonl")) == 4
    assert not (tmp_path / "rows.jsonl.gz").exists() and not (tmp_path / "progress.log.gz").exists()
    assert len((tmp_path / "progress.log").read_text().splitlines()) == 2
    assert len(read_csv(tmp_path / "per_sample.csv.gz")) == 4 and not (tmp_path / "per_sample.csv").exists()
    (tmp_path / "rows.jsonl.gz").write_bytes(b"")
    with pytest.raises(SystemExit, match="both rows.jsonl and rows.jsonl.gz"):
        run(_one_task_cfg(2), small_model, tokenizer, tmp_path, progress=False, plots=False)


def test_a_folder_moved_to_xz_resumes_in_xz(tmp_path, small_model, tokenizer):
    """kvp-eval --compress-store xz on a finished folder: a later run appends to rows.jsonl.xz and
    progress.log.xz (one store of each name, compacted at the end) and reports every row."""
    run(_one_task_cfg(1), small_model, tokenizer, tmp_path, progress=False, plots=False)
    before = read_rows(tmp_path / "rows.jsonl.gz")
    assert cli.main(["--compress-store", "xz", "--out", str(tmp_path)]) == 0
    assert read_rows(tmp_path / "rows.jsonl.xz") == before and not (tmp_path / "rows.jsonl.gz").exists()
    res = run(_one_task_cfg(2), small_model, tokenizer, tmp_path, progress=False, plots=False)
    assert res["measured"]["this_invocation"]["samples_computed"] == 1
    assert res["measured"]["samples_per_task_all_rules"] == {"niah_single_repeat/256": 2}
    rows = read_rows(tmp_path / "rows.jsonl.xz")
    assert rows[:2] == before and len(rows) == 4
    assert _scan((tmp_path / "rows.jsonl.xz").read_bytes(), c=".xz").members == 1  # compacted
    assert not (tmp_path / "rows.jsonl.gz").exists() and not (tmp_path / "progress.log.gz").exists()
    assert len(read_bytes(tmp_path / "progress.log.xz").decode().splitlines()) == 2


def test_parallel_runs_on_disjoint_tasks_share_one_folder(tmp_path, small_model, tokenizer):
    """Two runs with disjoint --tasks write one folder at the same time; nothing is lost and the
    results of whichever finishes last report both."""
    import copy
    import threading

    def cfg(task):
        return EvalConfig(tasks=[task], lengths=[256], samples=2, budgets=[32], rules=["random"],
                          protocols=["query_aware"])

    out = {}
    # a model each: capture hooks are registered on the model's modules, so two threads sharing one
    # model would record each other's queries (separate processes, as in real use, share nothing)
    threads = [threading.Thread(target=lambda t=t: out.__setitem__(t, run(
        cfg(t), copy.deepcopy(small_model), tokenizer, tmp_path, progress=False, plots=False)))
        for t in ("niah_single_repeat", "niah_single_words")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {"niah_single_repeat", "niah_single_words"}, "a run raised"
    rows = read_rows(tmp_path / "rows.jsonl")
    assert len(rows) == len({row_key(r) for r in rows}) == 2 * 2 * 2  # 2 tasks x 2 samples x (full, random)
    final = json.loads((tmp_path / "results.json").read_text())
    assert final["measured"]["rows"] == len(rows)
    assert final["measured"]["samples_per_task_all_rules"] == {"niah_single_repeat/256": 2,
                                                               "niah_single_words/256": 2}


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "nope"], "unknown task"),
    (["--rules", "nope"], "unknown rule"),
    (["--budgets", "0"], "positive"),
    (["--budgets", "-5"], "positive"),
    (["--budgets", "8"], "at least 20"),
    (["--samples", "0"], "--samples must be positive"),
    (["--rules", "kvp", "--checkpoint", ""], "needs a trained policy"),
    (["--lengths", "16K"], "above the model's context of 8192"),
    (["--seed", "1000000"], "larger seeds draw the training traces"),
    (["--protect", "some"], "unknown protect mode 'some'"),
    (["--protect", "paper,paper"], "names a mode twice"),
    (["--protect", "paper,none"], "needs 2 different --out folders"),
    (["--shard", "2/2"], "0 <= K < N"),
    (["--shard", "half"], "a shard is K/N"),
])
def test_cli_bad_arguments(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_budget_parsing():
    assert cli.parse_budgets("64,128,0.25") == [64, 128, 0.25]
    assert cli.parse_budgets("1.0") == [1.0]


@pytest.mark.real_model
def test_real_model_sanity(tokenizer):
    """SmolLM2-135M: the full cache finds a needle in repetitive filler; the oracle keeps it at a small
    budget and beats random eviction on the gold answer's log-likelihood."""
    from transformers import AutoModelForCausalLM

    from kvp_vllm.assets import smollm2_path
    from kvp_vllm.eval.runner import evaluate_sample
    from kvp_vllm.eval.tasks import make_sample

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(verify=False), dtype=torch.float32).eval()
    for i in range(2):
        s = make_sample("niah_single_repeat", tokenizer, 512, i)
        rows = evaluate_sample(model, tokenizer, s, ["oracle", "random"], [48], ["query_aware"])
        by = {r["rule"]: r for r in rows}
        assert by["full"]["correct"], by["full"]["output"]
        assert by["oracle"]["correct"], by["oracle"]["output"]
        assert by["oracle"]["gold_logprob"] >= by["random"]["gold_logprob"]


def test_task_average_compares_rules_on_the_same_samples():
    from kvp_vllm.eval.runner import task_average, task_average_table

    def row(task, index, rule, budget, correct):
        return dict(task=task, length=256, index=index, protocol="query_aware", rule=rule, budget=budget,
                    correct=correct, kind="qa")

    rows = [row("a", 0, "full", "full", True), row("a", 0, "x", "64", True), row("a", 0, "y", "64", False),
            row("a", 1, "full", "full", True), row("a", 1, "x", "64", False), row("a", 1, "y", "64", True),
            row("b", 0, "full", "full", False), row("b", 0, "x", "64", True), row("b", 0, "y", "64", True),
            # sample 1 of task b lacks rule y: left out for every rule
            row("b", 1, "full", "full", True), row("b", 1, "x", "64", True),
            dict(row("p", 0, "x", "64", None), kind="ppl")]
    avg = {(a["rule"], a["budget"]): a for a in task_average(rows)}
    assert avg[("x", "64")]["accuracy"] == pytest.approx((0.5 + 1.0) / 2)  # task a: 1/2, task b: 1/1
    assert avg[("y", "64")]["accuracy"] == pytest.approx((0.5 + 1.0) / 2)
    assert avg[("full", "full")]["accuracy"] == pytest.approx((1.0 + 0.0) / 2)
    assert avg[("x", "64")]["tasks"] == 2 and avg[("x", "64")]["samples"] == 3
    from kvp_vllm.eval.runner import complete_rows
    kept = complete_rows([r for r in rows if r["kind"] == "qa"])
    assert len(kept) == 9 and not any(r["task"] == "b" and r["index"] == 1 for r in kept)
    table = task_average_table(task_average(rows), "query_aware", 256)
    assert "| x | 0.750 | 0.500 |" in table and "3 samples" in table


def test_needle_table_counts_correct_and_cut_short_answers():
    from kvp_vllm.eval.runner import needle_table

    def row(task, index, rule, budget, output, correct):
        return dict(task=task, length=256, index=index, protocol="query_aware", rule=rule, budget=budget,
                    output=output, correct=correct, kind="qa")

    rows = [row("niah_single_repeat", 0, "full", "full", " 1234567.", True),
            row("niah_single_repeat", 0, "x", "64", " 123.", False),       # cut short
            row("niah_single_repeat", 0, "y", "64", " 1234567.", True),
            row("niah_single_repeat", 1, "full", "full", " 7654321.", True),
            row("niah_single_repeat", 1, "x", "64", " 7654329.", False),   # wrong, not a prefix
            row("niah_single_repeat", 1, "y", "64", " 76543210.", False),  # longer: not cut short
            row("niah_multikey", 0, "full", "full", " 42.", True),
            row("niah_multikey", 0, "x", "64", " 4.", False),  # multi-needle tasks: only counted
            row("niah_multikey", 0, "y", "64", " 42.", True),
            row("vt", 0, "full", "full", " A", True), row("vt", 0, "x", "64", " A", True)]
    table = needle_table(rows, 256)
    assert "3 samples (full cache correct: query_aware 3)" in table
    assert "| y | 2 (0) |" in table and "| x | 0 (1) |" in table
    assert needle_table(rows, 512) == ""


def test_kvp_rows_are_recomputed_when_the_policy_changes(tmp_path, small_model, tokenizer):
    """A folder never mixes two KVP policies: rows carry the weights' sha256; after the checkpoint
    changes they count as missing, are recomputed, and only the new ones are reported."""
    from kvp_vllm.policy import KVPPolicy, ModelShape

    shape = ModelShape(2, 2, 8, "tiny")
    KVPPolicy.random_init(shape, seed=1).save(tmp_path / "p1")
    KVPPolicy.random_init(shape, seed=2).save(tmp_path / "p2")

    def cfg(ck):
        return EvalConfig(tasks=["niah_single_repeat"], lengths=[256], samples=1, budgets=[32],
                          rules=["kvp", "random"], protocols=["query_aware"], checkpoint=str(tmp_path / ck))

    out = tmp_path / "run"
    run(cfg("p1"), small_model, tokenizer, out, progress=False, plots=False)
    sha = {ck: json.loads((tmp_path / ck / "config.json").read_text())["weights_sha256"] for ck in ("p1", "p2")}
    first = read_rows(out / "rows.jsonl")
    assert {r.get("checkpoint_sha256") for r in first if r["rule"] == "kvp"} == {sha["p1"]}
    assert run(cfg("p1"), small_model, tokenizer, out, progress=False,
               plots=False)["measured"]["this_invocation"]["samples_computed"] == 0
    res = run(cfg("p2"), small_model, tokenizer, out, progress=False, plots=False)
    assert res["measured"]["this_invocation"]["samples_computed"] == 1
    added = read_rows(out / "rows.jsonl")[len(first):]
    assert [r["rule"] for r in added] == ["kvp"]  # only KVP was recomputed (full, random reused)
    assert added[0]["checkpoint_sha256"] == sha["p2"]
    assert res["measured"]["rows"] == len(first)  # the stale KVP row is not reported


def test_merge_policy_rows_puts_a_second_policy_beside_the_baselines():
    from kvp_vllm.eval.runner import RowMismatch, merge_policy_rows

    def row(rule, budget, index, correct, output=" 123", sha=None):
        r = {"task": "niah_single_repeat", "length": 4096, "index": index, "prompt_tokens": 4000,
             "kind": "qa", "protocol": "query_aware", "rule": rule, "budget": budget, "kept": 128,
             "cache_len": 4000, "output": output, "correct": correct, "recall": float(correct),
             "same_as_full": correct, "gold_logprob": -1.0, "gold_tokens": 3}
        return {**r, "checkpoint_sha256": sha} if sha else r

    base = [row("full", "full", i, True) for i in range(3)] + \
           [row("kvp", "128", i, True, sha="new") for i in range(3)] + \
           [row("tova", "128", i, False) for i in range(3)]
    other = [row("full", "full", i, True) for i in range(2)] + [row("kvp", "128", 0, False, sha="old"),
                                                                row("kvp", "128", 1, True, sha="old")]
    merged = merge_policy_rows(base, other, "kvp_old")
    avg = {a["rule"]: a for a in task_average(merged)}
    # only the two samples both folders have count, for every rule
    assert avg["kvp_old"]["samples"] == 2 and avg["kvp_old"]["accuracy"] == 0.5
    assert avg["kvp"]["accuracy"] == 1.0 and avg["tova"]["accuracy"] == 0.0
    with pytest.raises(ValueError, match="already a rule"):
        merge_policy_rows(base, other, "tova")
    with pytest.raises(RowMismatch, match="different prompts"):
        merge_policy_rows(base, [row("full", "full", 0, True, output=" 999")], "kvp_old")
    with pytest.raises(RowMismatch, match="different prompts"):
        merge_policy_rows(base, [{**row("full", "full", 0, True), "gold_logprob": -1.01}], "kvp_old")
    # fp32 noise in the full cache's gold log-likelihood is not a different prompt
    assert merge_policy_rows(base, [{**row("full", "full", 0, True), "gold_logprob": -1.00001}], "x")
    with pytest.raises(RowMismatch, match="share no sample"):
        merge_policy_rows(base, [{**row("full", "full", 0, True), "length": 8192}], "kvp_old")


def test_compare_policies_script_writes_tables_and_plots(tmp_path):
    """benchmarks/compare_policies.py on two synthetic folders: the other policy's row appears."""
    import subprocess

    from kvp_vllm.scorers import rule_definition
    import sys
    from pathlib import Path

    def folder(name, sha, rules, kvp_loglik):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({"settings": {"checkpoint_weights_sha256": sha}}))
        rows = []
        for i in range(2):
            for rule in ["full"] + rules:
                rows.append({"task": "niah_single_repeat", "length": 512, "index": i, "prompt_tokens": 500,
                             "kind": "qa", "protocol": "query_aware", "rule": rule,
                             "budget": "full" if rule == "full" else "64", "kept": 64, "cache_len": 500,
                             "output": " 1", "correct": rule != "tova", "recall": 1.0, "same_as_full": True,
                             "gold_logprob": -1.0, "gold_tokens": 2,
                             **({"checkpoint_sha256": sha} if rule == "kvp" else {}),
                             **({"rule_def": rule_definition(rule)} if rule != "full" else {})})
                # an essay: per token, the full cache -1.5, KVP as given, every other rule -3.0
                rows.append({"task": "ppl_essay", "length": 512, "index": i, "prompt_tokens": 448, "kind": "ppl",
                             "protocol": "query_aware", "rule": rule, "budget": "full" if rule == "full" else "64",
                             "kept": 64, "cache_len": 447, "output": "", "correct": None, "recall": None,
                             "same_as_full": True, "gold_tokens": 64,
                             "gold_logprob": 64 * {"full": -1.5, "kvp": kvp_loglik[i]}.get(rule, -3.0),
                             **({"checkpoint_sha256": sha} if rule == "kvp" else {}),
                             **({"rule_def": rule_definition(rule)} if rule != "full" else {})})
        (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    base, other = folder("base", "aaa", ["kvp", "tova"], [-2.0, -2.2]), folder("other", "bbb", ["kvp"], [-1.9, -2.0])
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_policies.py"
    proc = subprocess.run([sys.executable, str(script), "--base", str(base), "--other", str(other),
                           "--label", "kvp_old", "--out", str(tmp_path / "cmp")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| kvp_old | 1.000 |" in md and "| tova | 0.000 |" in md
    # per essay the other policy is 0.1 and 0.2 nats per token better: mean 0.15, standard error 0.05
    assert "kvp_old minus kvp" in md and "| kvp | +0.150 ± 0.050 |" in md
    assert "| 512 | query_aware | 2 | +0 / -0 (p = 1.00) |" in md  # both policies answer both prompts
    assert (tmp_path / "cmp" / "eval_task_average_512.png").exists()
    report = json.loads(gzip.decompress((tmp_path / "cmp" / "compare.json.gz").read_bytes()))
    assert {a["rule"] for a in report["aggregate"]} >= {"kvp_old", "kvp", "tova"}
    proc = subprocess.run([sys.executable, str(script), "--base", str(base), "--other", str(other),
                           "--label", "tova", "--out", str(tmp_path / "cmp2")], capture_output=True, text=True)
    assert proc.returncode != 0 and "already a rule" in proc.stderr


def test_paired_answers_counts_discordant_prompts_and_sign_test():
    """Won / lost count the prompts only one policy answered (per task and sample, one budget and
    protocol); the p-value is the exact two-sided binomial test on those."""
    from kvp_vllm.eval.runner import paired_answers

    new = [True] * 7 + [False] * 3 + [True]  # index 10 at another budget: not counted
    old = [False] * 6 + [True] * 2 + [False] * 2 + [False]
    rows = [_synthetic("kvp_new", i, c, budget="128" if i == 10 else "64") for i, c in enumerate(new)] + \
           [_synthetic("kvp", i, c, budget="128" if i == 10 else "64") for i, c in enumerate(old)] + \
           [{**_synthetic("kvp_new", 0, True), "task": "ppl_essay", "correct": None}]
    d = paired_answers(rows, 256, "query_aware", "64", "kvp_new", "kvp")
    assert (d["prompts"], d["won"], d["lost"]) == (10, 6, 1)
    assert d["p_value"] == pytest.approx(2 * (1 + 7) / 2 ** 7)  # P(X <= 1 | n = 7), both tails
    swapped = paired_answers(rows, 256, "query_aware", "64", "kvp", "kvp_new")
    assert (swapped["won"], swapped["lost"], swapped["p_value"]) == (1, 6, d["p_value"])
    assert paired_answers(rows, 256, "query_agnostic", "64", "kvp_new", "kvp") is None
    tie = paired_answers(rows, 256, "query_aware", "128", "kvp_new", "kvp")
    assert (tie["won"], tie["lost"], tie["p_value"]) == (1, 0, 1.0)


def _synthetic(rule, index, correct, budget="64", **fields):
    return {"task": "niah_single_repeat", "length": 256, "index": index, "prompt_tokens": 250, "kind": "qa",
            "protocol": "query_aware", "rule": rule, "budget": "full" if rule == "full" else budget,
            "kept": 64, "cache_len": 250, "output": " 1", "correct": correct, "recall": float(correct),
            "same_as_full": correct, "gold_logprob": -1.0, "gold_tokens": 2, **fields}


def test_rows_of_another_definition_or_protect_mode_are_never_mixed():
    """Legacy rows (no rule_def / protect) are v1 / paper: current for unchanged rules (knorm), stale
    for the rules made faithful to kvpress (tova v2). A rule with only stale rows is reported under its
    variant's label; once current rows exist, the stale ones are left out."""
    from kvp_vllm.eval.runner import current_rows, is_current, variant_label

    legacy = [_synthetic("full", i, True) for i in range(2)] + \
             [_synthetic("knorm", i, True) for i in range(2)] + [_synthetic("tova", i, False) for i in range(2)]
    assert is_current(legacy[2], None) and not is_current(legacy[4], None)
    assert not is_current(legacy[2], None, protect="none") and is_current(legacy[0], None, protect="none")
    assert variant_label("tova", "v1", "paper") == "tova@v1"
    assert variant_label("knorm", "v1", "paper", current_protect="none") == "knorm[protect=paper]"
    rep = current_rows(legacy, None)
    assert sorted({r["rule"] for r in rep}) == ["full", "knorm", "tova@v1"]
    avg = {a["rule"]: a["accuracy"] for a in task_average(rep)}
    assert avg == {"full": 1.0, "knorm": 1.0, "tova@v1": 0.0}
    # sample 1 recomputed with the current definition: v1 and v2 are never averaged together, and
    # only the sample that has every rule counts
    fresh = _synthetic("tova", 1, True, rule_def="v2", protect="paper")
    rep = current_rows(legacy + [fresh], None)
    assert sorted((r["rule"], r["index"]) for r in rep if "tova" in r["rule"]) == [("tova", 1)]
    avg = {a["rule"]: a for a in task_average(rep)}
    assert avg["tova"]["accuracy"] == 1.0 and avg["tova"]["samples"] == 1
    # read under --protect none, the paper rows are another variant
    assert sorted({r["rule"] for r in current_rows(legacy, None, protect="none")}) == \
        ["full", "knorm[protect=paper]", "tova@v1[protect=paper]"]


def test_kvp_rows_of_a_later_policy_do_not_hide_the_reported_policys():
    """A store holds policy A's KVP rows, then policy B's for the same prompts (a one-pass run with
    --checkpoint B): reported under A, A's rows are still there; under B, B's."""
    from kvp_vllm.eval.runner import current_rows

    rows = [_synthetic("full", i, True) for i in range(2)] + \
           [_synthetic("kvp", i, True, checkpoint_sha256="A") for i in range(2)] + \
           [_synthetic("kvp", i, False, checkpoint_sha256="B") for i in range(2)]
    for sha, correct in (("A", True), ("B", False)):
        rep = [r for r in current_rows(rows, sha) if r["rule"] == "kvp"]
        assert sorted(r["index"] for r in rep) == [0, 1] and {r["correct"] for r in rep} == {correct}, sha
    # a recomputed row of the same policy still replaces the older one
    redo = _synthetic("kvp", 0, False, checkpoint_sha256="A")
    rep = {r["index"]: r["correct"] for r in current_rows(rows + [redo], "A") if r["rule"] == "kvp"}
    assert rep == {0: False, 1: True}


def test_stale_definitions_are_recomputed_on_resume(tmp_path, small_model, tokenizer):
    """A folder from before definitions were versioned: its TOVA rows (v1) are recomputed with v2,
    its K-Norm rows (unchanged, v1) are kept; every new row records rule_def and protect."""
    cfg = EvalConfig(tasks=["niah_single_repeat"], lengths=[256], samples=1, budgets=[32, 4096],
                     rules=["tova", "knorm"], protocols=["query_aware"])
    run(cfg, small_model, tokenizer, tmp_path, progress=False, plots=False)
    rows = read_rows(tmp_path / "rows.jsonl")
    assert {(r["rule"], r.get("rule_def"), r.get("protect")) for r in rows} == \
        {("full", None, None), ("tova", "v2", "paper"), ("knorm", "v1", "paper")}
    # make it a legacy folder: rows without the fields, run.json without protect
    legacy = [{k: v for k, v in r.items() if k not in ("rule_def", "protect")} for r in rows]
    (tmp_path / "rows.jsonl.gz").unlink()
    append_rows(tmp_path / "rows.jsonl.gz", legacy)
    meta = json.loads((tmp_path / "run.json").read_text())
    meta["identity"].pop("protect")
    (tmp_path / "run.json").write_text(json.dumps(meta))
    res = run(cfg, small_model, tokenizer, tmp_path, progress=False, plots=False)
    assert res["measured"]["this_invocation"]["samples_computed"] == 1
    added = read_rows(tmp_path / "rows.jsonl")[len(legacy):]
    assert sorted({(r["rule"], r["rule_def"]) for r in added}) == [("tova", "v2")]
    assert len(added) == 2  # both budgets (4096 keeps everything: a copy of the full row, stamped)
    assert res["measured"]["rows"] == len(rows) and "stale_variants_reported" not in res["measured"]
    assert res["settings"]["protect"] == "paper" and res["settings"]["rule_definitions"] == \
        {"tova": "v2", "knorm": "v1"}
    # a folder keeps its protect mode
    with pytest.raises(SystemExit, match="other settings"):
        run(EvalConfig(**{**cfg.__dict__, "protect": "none"}), small_model, tokenizer, tmp_path,
            progress=False, plots=False)


def test_protect_none_keeps_the_rules_own_choice(tmp_path, small_model, tokenizer):
    """--protect none: budgets below 20 are allowed, each row records the mode."""
    cfg = EvalConfig(tasks=["niah_single_repeat"], lengths=[256], samples=1, budgets=[8],
                     rules=["streaming", "snapkv"], protocols=["query_aware"], protect="none")
    res = run(cfg, small_model, tokenizer, tmp_path, progress=False, plots=False)
    rows = [r for r in read_rows(tmp_path / "rows.jsonl") if r["rule"] != "full"]
    assert {(r["rule"], r["protect"], r["kept"]) for r in rows} == {("streaming", "none", 8), ("snapkv", "none", 8)}
    assert json.loads((tmp_path / "run.json").read_text())["identity"]["protect"] == "none"
    assert res["settings"]["protect"] == "none"
    with pytest.raises(ValueError, match="unknown protect mode"):
        EvalConfig(tasks=[], lengths=[], samples=1, budgets=[], rules=[], protocols=[], protect="some")


def test_report_only_labels_a_legacy_folder_by_its_old_definitions(tmp_path, capsys):
    """kvp-eval --report-only on a folder made before versioning (like the committed results): the
    changed rules' tables say which definition they measured."""
    rows = [_synthetic("full", i, True) for i in range(2)] + [_synthetic("knorm", i, True) for i in range(2)] + \
           [_synthetic("snapkv", i, i == 0) for i in range(2)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text(json.dumps({"identity": {"model": "smollm2", "seed": 0, "window": 64}}))
    assert cli.main(["--report-only", "--lengths", "256", "--tasks", "niah_single_repeat", "--budgets", "64",
                     "--rules", "knorm,snapkv", "--checkpoint", "", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| snapkv@v1 | 0.500 |" in out and "| knorm | 1.000 |" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["measured"]["samples_per_task_all_rules"] == {"niah_single_repeat/256": 2}
    assert res["measured"]["stale_variants_reported"] == ["snapkv@v1"]
    assert res["settings"]["protect"] == "paper"


def test_report_only_reports_the_given_budgets_while_a_new_budget_is_partial(tmp_path, capsys):
    """A budget being added to a finished folder has rows for some samples only: reported, it would cut
    every table to those samples (a sample counts only with every rule and budget); --report-only
    with the finished budgets keeps reporting all of them."""
    rows = [_synthetic("full", i, True) for i in range(3)] + \
           [_synthetic("knorm", i, i < 2, budget="128") for i in range(3)] + \
           [_synthetic("knorm", 0, False, budget="64")]  # budget 64: sample 0 only, so far
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text(json.dumps({"identity": {"model": "smollm2", "seed": 0, "window": 64}}))
    args = ["--report-only", "--lengths", "256", "--tasks", "niah_single_repeat", "--rules", "knorm",
            "--checkpoint", "", "--out", str(tmp_path)]

    def reported(budgets):
        assert cli.main(args + ["--budgets", budgets]) == 0
        capsys.readouterr()
        return {a["budget"]: (int(a["n"]), round(float(a["accuracy"]), 3))
                for a in read_csv(tmp_path / "aggregate.csv") if a["rule"] == "knorm"}

    assert reported("64,128") == {"64": (1, 0.0), "128": (1, 1.0)}  # every budget: sample 0 alone
    assert reported("128") == {"128": (3, 0.667)}  # the finished budget: all three samples
    with pytest.raises(SystemExit):
        cli.main(args + ["--budgets", "256"])
    assert "no stored rows of budgets 256" in capsys.readouterr().err


def test_one_pass_fills_a_folder_per_protect_mode(tmp_path, small_model, tokenizer, capsys):
    """--protect paper,none in one pass, split over two shards side by side: each folder gets exactly
    the rows a separate run with its mode makes, and KVzip's reconstruction is computed once for both."""
    import copy
    import threading

    def cfg(protect):
        return EvalConfig(tasks=["niah_single_repeat", "ppl_essay"], lengths=[256], samples=2,
                          budgets=[32, 4096], rules=["knorm", "snapkv", "kvzip"],
                          protocols=["query_aware", "query_agnostic"], protect=protect)

    for mode in ("paper", "none"):
        run(cfg(mode), small_model, tokenizer, tmp_path / f"alone_{mode}", progress=False, plots=False)
    both = {"paper": tmp_path / "both_paper", "none": tmp_path / "both_none"}
    errors = []

    def shard(k):
        try:
            run(cfg("paper"), copy.deepcopy(small_model), tokenizer, both["paper"], progress=False, plots=False,
                also={"none": both["none"]}, shard=(k, 2))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=shard, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    def content(folder):  # every row but its timing, by key
        return {row_key(r): {k: v for k, v in r.items() if k != "extra_prefill_seconds"}
                for r in read_rows(folder / "rows.jsonl")}
    for mode in ("paper", "none"):
        alone, together = content(tmp_path / f"alone_{mode}"), content(both[mode])
        assert len(alone) == 2 * (2 * (1 + 3 * 2) + (1 + 3 * 2))  # 2 samples x (niah: 2 protocols; ppl: 1)
        assert together == alone, mode
        assert {r["protect"] for r in together.values() if r["rule"] != "full"} == {mode}
        res = json.loads((both[mode] / "results.json").read_text())
        assert res["settings"]["protect"] == mode
        assert res["measured"]["samples_per_task_all_rules"] == {"niah_single_repeat/256": 2, "ppl_essay/256": 2}
        log = read_bytes(both[mode] / "progress.log.gz").decode()
        assert log.count("protect=paper,none") == 4  # 2 tasks x 2 samples, one line each
    seconds = [{row_key(r): r["extra_prefill_seconds"] for r in read_rows(both[m] / "rows.jsonl")
                if r["rule"] == "kvzip"} for m in ("paper", "none")]
    assert seconds[0] == seconds[1]  # one reconstruction (and its timing) shared by both modes

    assert cli.main(["--report-only", "--lengths", "256", "--tasks", "niah_single_repeat,ppl_essay", "--samples",
                     "2", "--budgets", "32,4096", "--rules", "knorm,snapkv,kvzip", "--checkpoint", "",
                     "--protect", "paper,none", "--out", f"{both['paper']},{both['none']}"]) == 0
    out = capsys.readouterr().out
    assert f"## {both['paper']} (protect paper)" in out and f"## {both['none']} (protect none)" in out
    with pytest.raises(SystemExit):
        cli.main(["--out", f"{both['paper']},{both['none']}"])
    assert "several --out folders need one --protect mode each" in capsys.readouterr().err


def test_a_budget_added_later_computes_only_that_budget(tmp_path, small_model, tokenizer, monkeypatch):
    """Resuming with one more budget runs only the new budget's compressed caches, and its rows equal
    those of a folder made with both budgets at once."""
    from kvp_vllm.eval import runner

    def cfg(budgets):
        return EvalConfig(tasks=["niah_single_repeat"], lengths=[256], samples=1, budgets=budgets,
                          rules=["knorm", "snapkv"], protocols=["query_aware"])

    run(cfg([32]), small_model, tokenizer, tmp_path / "later", progress=False, plots=False)
    sizes = []
    real = runner.P.evaluate_caches

    def spy(model, pre, protocol, layers_per_rule, *args, **kwargs):
        sizes.extend(layers[0][0].shape[2] for layers in layers_per_rule)
        return real(model, pre, protocol, layers_per_rule, *args, **kwargs)
    monkeypatch.setattr(runner.P, "evaluate_caches", spy)
    run(cfg([32, 64]), small_model, tokenizer, tmp_path / "later", progress=False, plots=False)
    assert sizes.count(64) == 2 and 32 not in sizes  # knorm and snapkv at 64 (beside the full cache)
    monkeypatch.undo()
    run(cfg([32, 64]), small_model, tokenizer, tmp_path / "at_once", progress=False, plots=False)
    assert ({row_key(r): r for r in read_rows(tmp_path / "later" / "rows.jsonl")}
            == {row_key(r): r for r in read_rows(tmp_path / "at_once" / "rows.jsonl")})


def test_budget_parsing_follows_the_protect_mode():
    assert cli.parse_budgets("8,2", "none") == [8, 2]
    with pytest.raises(ValueError, match="at least 20"):
        cli.parse_budgets("8", "paper")


def _benchmark_script(name):
    """benchmarks/<name>.py loaded as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_import_policy_rows_appends_once_and_only_on_the_same_prompts(tmp_path):
    """benchmarks/import_policy_rows.py: the source policy's KVP rows are appended to a folder on the
    same prompts and then reported there; a second run appends nothing; other prompts are refused."""
    from kvp_vllm.eval.runner import RowMismatch, current_rows, read_rows

    mod = _benchmark_script("import_policy_rows")

    def folder(name, sha, rules, prompt_tokens=250):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({"settings": {"checkpoint_weights_sha256": sha}}))
        (d / "run.json").write_text(json.dumps({"identity": {"model": "m", "seed": 0, "window": 64,
                                                             "protect": "paper"}}))
        rows = [_synthetic(r, i, True, prompt_tokens=prompt_tokens, protect="paper",
                           **({"checkpoint_sha256": sha, "rule_def": "v1"} if r == "kvp" else {}))
                for i in range(2) for r in ["full"] + rules]
        (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    into, source = folder("into", "old", ["kvp"]), folder("source", "new", ["kvp"])
    assert mod.main(["--source", str(source), "--into", str(into)]) == 0
    (into / "results.json").write_text(json.dumps({"settings": {"checkpoint_weights_sha256": "new"}}))
    reported = [r for r in current_rows(read_rows(into / "rows.jsonl"), "new") if r["rule"] == "kvp"]
    assert sorted(r["index"] for r in reported) == [0, 1] and {r["checkpoint_sha256"] for r in reported} == {"new"}
    assert mod.rows_to_import(source, into) == []
    other = folder("other", "new2", ["kvp"], prompt_tokens=251)
    with pytest.raises(RowMismatch):
        mod.rows_to_import(other, into)
    assert mod.main(["--source", str(other), "--into", str(into)]) == 2


def test_drop_policy_rows_removes_only_superseded_kvp_rows(tmp_path):
    """benchmarks/drop_policy_rows.py: a superseded policy's KVP rows leave the .gz store; the reported
    policy's rows, the baselines and the full cache stay; the reported policy and an unknown prefix are
    refused without touching the store."""
    import gzip

    from kvp_vllm.eval.runner import read_rows

    mod = _benchmark_script("drop_policy_rows")

    new, old = "ab" * 32, "cd" * 32
    (tmp_path / "results.json").write_text(json.dumps({"settings": {"checkpoint_weights_sha256": new}}))
    rows = [_synthetic("full", i, True) for i in range(2)] + [_synthetic("knorm", i, True) for i in range(2)] + \
           [_synthetic("kvp", i, True, checkpoint_sha256=sha) for i in range(2) for sha in (new, old)]
    store = tmp_path / "rows.jsonl.gz"
    store.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    before = store.read_bytes()
    assert mod.main(["--folder", str(tmp_path), "--sha256", new[:8]]) == 2
    assert mod.main(["--folder", str(tmp_path), "--sha256", "ef" * 4]) == 2
    assert mod.main(["--folder", str(tmp_path), "--sha256", old[:6]]) == 2
    assert store.read_bytes() == before
    assert mod.main(["--folder", str(tmp_path), "--sha256", old[:8]]) == 0
    left = read_rows(store)
    assert left == [r for r in rows if r.get("checkpoint_sha256") != old]
