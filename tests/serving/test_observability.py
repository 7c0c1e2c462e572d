"""Observability against the live test server: a real Prometheus (Debian's `prometheus`, installed
by the bootstrap) scrapes it and its HTTP API returns the eviction series our requests produced;
every PromQL expression of the Grafana dashboard reads a metric the server really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import openai
import pytest
import requests

from kvp_vllm.serving.launch import free_port
from serving_helpers import MODEL_NAME, SERVER_RULE, metric

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Tell me about the weather. " + "The grass is green. The sky is blue. " * 40


def _evict_once(server) -> None:
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="x", timeout=300, max_retries=0)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)


def _exported_names(url: str) -> set:
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            names.add(s.name)
            names.add(re.sub(r"_(bucket|sum|count|created)$", "", s.name))
    return names


def test_dashboard_expressions_read_exported_metrics(server):
    _evict_once(server)
    exported = _exported_names(server["url"])
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvp-vllm.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"\b((?:kvp_|vllm:)[a-zA-Z0-9_:]+)", t["expr"])}
    assert used, "the dashboard reads no metric"
    missing = sorted(m for m in used if m not in exported)
    assert not missing, f"dashboard reads metrics the server does not export: {missing}"


def _prom_query(base: str, expr: str) -> list:
    r = requests.get(base + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def test_prometheus_scrapes_eviction_series(server):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is not installed: run scripts/bootstrap.sh"
    _evict_once(server)
    evicted = metric(server["url"], "kvp_tokens_evicted_total", rule=SERVER_RULE)
    selections = metric(server["url"], "kvp_selection_latency_seconds_count", rule=SERVER_RULE)
    assert evicted > 0 and selections > 0

    work = Path(tempfile.mkdtemp(prefix="kvp-prom-"))
    target = server["url"].removeprefix("http://")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: kvp-vllm\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(work / "prom.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        got_evicted = got_count = None
        while time.time() < deadline:
            try:
                ev = _prom_query(base, f'sum(kvp_tokens_evicted_total{{rule="{SERVER_RULE}"}})')
                cnt = _prom_query(base, f'sum(kvp_selection_latency_seconds_count{{rule="{SERVER_RULE}"}})')
                if ev and cnt:
                    got_evicted, got_count = float(ev[0]["value"][1]), float(cnt[0]["value"][1])
                    if got_evicted >= evicted and got_count >= selections:
                        break
            except requests.RequestException:
                pass  # Prometheus still starting
            time.sleep(1)
        assert got_evicted is not None, "Prometheus never returned the kvp series:\n" + (work / "prom.log").read_text()[-2000:]
        assert got_evicted >= evicted and got_count >= selections
        # The scrape target is healthy and vLLM's own series arrive too.
        up = _prom_query(base, 'up{job="kvp-vllm"}')
        assert up and up[0]["value"][1] == "1"
        assert _prom_query(base, "vllm:num_requests_running")
        p99 = _prom_query(base, "histogram_quantile(0.99, sum by (le) "
                                "(kvp_selection_latency_seconds_bucket))")
        assert p99 and float(p99[0]["value"][1]) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
