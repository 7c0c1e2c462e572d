"""A real `kvp-vllm serve` on SmolLM2, started once per test session (start-up costs a minute),
plus helpers to read its Prometheus metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from serving_helpers import BLOCK, MODEL_NAME, SERVER_BUDGET, SERVER_INTERVAL, SERVER_RULE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvp_checkpoint_for_tests(folder: Path) -> tuple[str, bool]:
    """(checkpoint folder, trained?): the shipped SmolLM2 policy when it exists, else a random one
    (enough to run the kvp rule through the server; not to expect good recall from it)."""
    from kvp_vllm.serving.config import shipped_checkpoint

    shipped = shipped_checkpoint("SmolLM2-135M-Instruct")
    if shipped is not None:
        return str(shipped), True
    from kvp_vllm.policy import KVPPolicy, ModelShape

    KVPPolicy.random_init(ModelShape(30, 3, 64, "SmolLM2-135M-Instruct"), seed=0).save(folder)
    return str(folder), False


@pytest.fixture(scope="session")
def server():
    """Base URL of one shared server (fp32 so greedy comparisons are exact)."""
    from kvp_vllm.assets import smollm2_path

    tmp = Path(tempfile.mkdtemp(prefix="kvp-serving-test-"))
    ckpt, trained = kvp_checkpoint_for_tests(tmp / "policy")
    port = _free_port()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the CLI makes a fresh one
    cmd = [sys.executable, "-m", "kvp_vllm.serving.cli", "serve", str(smollm2_path()),
           "--kv-eviction", SERVER_RULE, "--kv-budget", str(SERVER_BUDGET),
           "--kv-evict-interval", str(SERVER_INTERVAL), "--kvp-checkpoint", ckpt,
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "4096",
           "--block-size", str(BLOCK), "--max-num-seqs", "32", "--port", str(port),
           "--served-model-name", MODEL_NAME, "--disable-uvicorn-access-log"]
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.time() + 420
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n"
                                   + (tmp / "server.log").read_text()[-4000:])
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not start in 420 s:\n"
                                   + (tmp / "server.log").read_text()[-4000:])
            time.sleep(2)
        yield {"url": url, "kvp_trained": trained, "log": tmp / "server.log", "proc": proc}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
