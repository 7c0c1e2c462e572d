"""Constants of the shared test server and a /metrics reader (imported by conftest and tests)."""

from __future__ import annotations

SERVER_BUDGET = 64
SERVER_INTERVAL = 32
BLOCK = 32
SERVER_RULE = "snapkv"  # the server default; every other rule is picked per request (kv_rule)
MODEL_NAME = "smol"


def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
