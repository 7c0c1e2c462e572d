"""A real `kvp-vllm serve` on SmolLM2 with the shipped KVP policy, started once per test session
(start-up costs a minute)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from serving_helpers import BLOCK, MODEL_NAME, SERVER_BUDGET, SERVER_INTERVAL, SERVER_RULE


def shipped_smollm2_policy() -> str:
    from kvp_vllm.serving.config import shipped_checkpoint

    shipped = shipped_checkpoint("SmolLM2-135M-Instruct")
    assert shipped is not None, "the SmolLM2 KVP policy must ship in kvp_vllm/checkpoints/"
    return str(shipped)


@pytest.fixture(scope="session")
def server():
    """Base URL of one shared server (fp32 so greedy comparisons are exact)."""
    from kvp_vllm.assets import smollm2_path
    from kvp_vllm.serving.launch import ServerProcess

    tmp = Path(tempfile.mkdtemp(prefix="kvp-serving-test-"))
    ckpt = shipped_smollm2_policy()
    proc = ServerProcess(
        smollm2_path(),
        ["--kv-eviction", SERVER_RULE, "--kv-budget", str(SERVER_BUDGET),
         "--kv-evict-interval", str(SERVER_INTERVAL), "--kvp-checkpoint", ckpt,
         "--enforce-eager", "--dtype", "float32", "--max-model-len", "4096",
         "--block-size", str(BLOCK), "--max-num-seqs", "32",
         "--served-model-name", MODEL_NAME, "--disable-uvicorn-access-log"],
        log=tmp / "server.log", env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"})
    with proc as url:
        yield {"url": url, "log": proc.log, "proc": proc.proc}
