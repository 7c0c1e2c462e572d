"""The serving benchmark in its reduced mode: two real servers on the same small block pool, eviction
off and KVP on, the same few requests; the result file is well-formed and eviction really freed
blocks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1800)
ROOT = Path(__file__).resolve().parents[2]


def test_serving_benchmark_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1750)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "serving_quick.json").read_text())
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
    assert ev["selection_seconds"] > 0 and ev["selection_share_of_prefill"] is not None
    for key in ("peak_running", "output_tokens_per_s", "ttft_p50"):
        expected = ev[key] / base[key] if base[key] else None
        assert report["ratios"][key] == (pytest.approx(expected) if expected is not None else None)
    assert "selection overhead" in proc.stdout and "peak_running" in proc.stdout
