"""benchmarks/stronger_variants.py: KVP beside the better of each baseline's two --protect variants."""

import importlib.util
from pathlib import Path

import pytest
import torch

from kvp_vllm.eval.runner import EvalConfig, run
from kvp_vllm.eval.store import read_bytes

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("stronger_variants", ROOT / "benchmarks" / "stronger_variants.py")
SV = importlib.util.module_from_spec(spec)
spec.loader.exec_module(SV)


def _cell(rule, budget, value, metric="accuracy"):
    return {"length": 2048, "protocol": "query_aware", "rule": rule, "budget": budget, metric: value}


def test_each_baseline_is_its_stronger_variant_and_kvp_stays_as_served():
    cells = [_cell("kvp", "128", 0.40), _cell("kvp[protect=none]", "128", 0.45),
             _cell("knorm", "128", 0.10), _cell("knorm[protect=none]", "128", 0.30),
             _cell("streaming", "128", 0.20), _cell("streaming[protect=none]", "128", 0.05),
             _cell("full", "full", 0.5)]
    got = {c["rule"]: c for c in SV.stronger_cells(cells, "accuracy")}
    assert (got["knorm"]["accuracy"], got["knorm"]["variant"]) == (0.30, "none")
    assert (got["streaming"]["accuracy"], got["streaming"]["variant"]) == (0.20, "paper")
    assert (got["kvp"]["accuracy"], got["kvp"]["variant"]) == (0.40, "paper")
    assert "kvp[protect=none]" not in got
    ppl = [_cell("tova", "128", 20.0, "perplexity"), _cell("tova[protect=none]", "128", 25.0, "perplexity")]
    (t,) = SV.stronger_cells(ppl, "perplexity", higher_is_better=False)
    assert (t["perplexity"], t["variant"]) == (20.0, "paper")
    table = SV.stronger_table(SV.stronger_cells(cells, "accuracy"), "accuracy", 2048, "query_aware")
    assert "| knorm | 0.300ᴺ | 0.500 |" in table and "| streaming | 0.200 | 0.500 |" in table


def test_kvp_rows_of_the_none_folder_stay_out_of_the_comparison():
    """KVP is compared as served: a none folder whose KVP rows are missing (or another policy's) keeps
    every sample, and no kvp[protect=none] rule appears."""
    def row(rule, i, correct, budget="128"):
        return {"task": "niah_single_repeat", "length": 2048, "index": i, "protocol": "query_aware", "rule": rule,
                "budget": budget, "prompt_tokens": 2000, "output": " 1", "correct": correct, "gold_logprob": -1.0,
                "gold_tokens": 2}

    paper = [row(r, i, True, "full" if r == "full" else "128") for i in range(2) for r in ("full", "kvp", "knorm")]
    none = [row("full", i, True, "full") for i in range(2)] + [row("knorm", i, i == 0) for i in range(2)] + \
           [row("kvp", 0, False)]  # KVP without protection: one sample only
    rows = SV.merged_rows(paper, none)
    assert {r["rule"] for r in rows} == {"full", "kvp", "knorm", "knorm[protect=none]"}
    assert {r["index"] for r in rows if r["rule"] == "kvp"} == {0, 1}


def test_paired_perplexity_difference_is_against_the_stronger_variant():
    """Per sample, KVP's log-likelihood per token minus the baseline's stronger variant's: mean and
    standard error over the samples (positive: KVP better)."""
    def row(rule, i, logprob):
        return {"length": 8192, "task": "ppl_essay", "protocol": "query_aware", "rule": rule, "budget": "128",
                "index": i, "gold_logprob": logprob * 64, "gold_tokens": 64}

    kvp, snap, snap_none = [-3.0, -3.2, -2.9], [-3.1, -3.1, -3.0], [-3.5, -3.6, -3.4]
    rows = ([row("kvp", i, v) for i, v in enumerate(kvp)] + [row("snapkv", i, v) for i, v in enumerate(snap)]
            + [row("snapkv[protect=none]", i, v) for i, v in enumerate(snap_none)])
    strong = [{**_cell("kvp", "128", 20.0, "perplexity"), "length": 8192, "task": "ppl_essay", "variant": "paper"},
              {**_cell("snapkv", "128", 21.0, "perplexity"), "length": 8192, "task": "ppl_essay", "variant": "paper"}]
    (d,) = SV.paired_differences(rows, strong)
    diffs = [a - b for a, b in zip(kvp, snap)]  # the paper variant was the stronger: never snap_none
    assert d["rule"] == "snapkv" and d["samples"] == 3
    assert d["mean"] == pytest.approx(sum(diffs) / 3)
    assert d["stderr"] == pytest.approx(torch.tensor(diffs).std().item() / 3 ** 0.5)
    assert "| snapkv | +0.033 ± 0.067 |" in SV.paired_table([d], 8192, "ppl_essay")


def test_loglik_tasks_compare_the_gold_answer_likelihood_not_accuracy():
    """A task the full cache does not answer (--loglik-tasks) leaves the accuracy average and is compared
    per protocol by the gold answer's log-likelihood per token against the full cache, each baseline by
    its stronger variant, with the paired per-sample difference KVP minus that variant."""
    def row(task, rule, protocol, i, logprob, correct=False):
        return {"task": task, "kind": "qa", "length": 2048, "index": i, "protocol": protocol, "rule": rule,
                "budget": "full" if rule == "full" else "128", "kept": 128, "cache_len": 128, "correct": correct,
                "recall": float(correct), "same_as_full": False, "gold_logprob": logprob * 4, "gold_tokens": 4}

    # per-token log-likelihoods; vt: nobody answers; niah: accuracy as usual
    ll = {"full": [-1.0, -1.2, -1.1], "kvp": [-1.5, -1.4, -1.9], "knorm": [-2.0, -2.5, -2.4],
          "knorm[protect=none]": [-1.8, -1.6, -2.0]}
    rows = []
    for protocol, shift in (("query_aware", 0.0), ("query_agnostic", -0.5)):
        for rule, vals in ll.items():
            rows += [row("vt", rule, protocol, i, v + (shift if rule == "knorm[protect=none]" else 0.0))
                     for i, v in enumerate(vals)]
            rows += [row("niah_single_repeat", rule, protocol, i, -1.0, correct=rule != "knorm") for i in range(3)]
    text, data = SV.report(rows, ["vt"])
    assert {(a["tasks"], a["samples"]) for a in data["task_average"]} == {(1, 3)}  # vt left out of the average
    strong = {(c["protocol"], c["rule"]): c for c in data["stronger_loglik"]}
    full = ll["full"]
    aware_none = sum(a - f for a, f in zip(ll["knorm[protect=none]"], full)) / 3
    assert strong["query_aware", "knorm"]["variant"] == "none"
    assert strong["query_aware", "knorm"]["delta_logprob_per_token"] == pytest.approx(aware_none)
    assert strong["query_agnostic", "knorm"]["variant"] == "paper"  # the none variant lost 0.5 nats there
    d = {(x["protocol"], x["rule"]): x for x in data["paired_loglik"]}
    kvp_minus_none = [a - b for a, b in zip(ll["kvp"], ll["knorm[protect=none]"])]
    assert d["query_aware", "knorm"]["mean"] == pytest.approx(sum(kvp_minus_none) / 3)
    assert d["query_agnostic", "knorm"]["mean"] == pytest.approx(sum(a - b for a, b in zip(ll["kvp"], ll["knorm"])) / 3)
    assert "## vt, query_aware, 2048 tokens: gold-answer log-likelihood" in text
    assert f"| knorm | {aware_none:.3f}ᴺ | 0.000 |" in text


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvp_vllm.assets import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path(verify=False))


@pytest.fixture(scope="module")
def small_model(tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_two_folders_end_to_end(tmp_path, small_model, tokenizer, capsys):
    def cfg(protect, seed=0):
        return EvalConfig(tasks=["niah_single_repeat", "ppl_essay"], lengths=[256], samples=1, budgets=[32, 64],
                          rules=["knorm", "streaming"], protocols=["query_aware"], protect=protect, seed=seed)

    run(cfg("paper"), small_model, tokenizer, tmp_path / "paper", progress=False, plots=False)
    run(cfg("none"), small_model, tokenizer, tmp_path / "none", progress=False, plots=False)
    SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "stronger.md").read_text()
    assert "stronger variant" in md and "knorm[protect=none]" in md and "ppl_essay perplexity" in md
    assert "| b=32 | b=64 |" in md
    SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path / "b32"),
             "--budgets", "32"])
    md32 = (tmp_path / "b32" / "stronger.md").read_text()
    assert "--budgets 32`" in md32 and "| b=32 | full |" in md32 and "b=64" not in md32
    with pytest.raises(SystemExit, match="no rows of budget 128"):
        SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path),
                 "--budgets", "32,128"])
    assert "ppl_essay, 256 tokens: paired difference" not in md  # one sample: no standard error, no table
    assert read_bytes(tmp_path / "out" / "stronger.json.gz").startswith(b'{"paper": ')  # gzip, read back
    with pytest.raises(SystemExit, match="not a --protect none folder"):
        SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "paper"), "--out", str(tmp_path)])
    SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path / "needle"),
             "--tasks", "niah_single_repeat"])
    md = (tmp_path / "needle" / "stronger.md").read_text()
    assert "--tasks niah_single_repeat`" in md and "1 tasks" in md and "ppl_essay" not in md
    SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path / "ll"),
             "--loglik-tasks", "niah_single_repeat"])
    md = (tmp_path / "ll" / "stronger.md").read_text()
    assert "--loglik-tasks niah_single_repeat`" in md and "task-averaged accuracy" not in md
    assert "## niah_single_repeat, query_aware, 256 tokens: gold-answer log-likelihood" in md
    with pytest.raises(SystemExit, match="must also be in --tasks"):
        SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path),
                 "--tasks", "ppl_essay", "--loglik-tasks", "niah_single_repeat"])
    with pytest.raises(SystemExit, match="no question rows of ppl_essay"):
        SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path),
                 "--loglik-tasks", "ppl_essay"])
    with pytest.raises(SystemExit, match="no rows of vt"):
        SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "none"), "--out", str(tmp_path),
                 "--tasks", "niah_single_repeat,vt"])
    run(cfg("none", seed=1), small_model, tokenizer, tmp_path / "other", progress=False, plots=False)
    with pytest.raises(SystemExit, match="no sample|different prompts"):
        SV.main(["--paper", str(tmp_path / "paper"), "--none", str(tmp_path / "other"), "--out", str(tmp_path)])
