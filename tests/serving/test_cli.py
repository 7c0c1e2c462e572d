"""`kvp-vllm serve` refuses bad start-up settings with a clear message, before starting vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def _serve(*args: str, model: str | None = None):
    from kvp_vllm.assets import smollm2_path

    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    cmd = [sys.executable, "-m", "kvp_vllm.serving.cli", "serve", model or str(smollm2_path()),
           "--enforce-eager", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def test_unknown_rule_is_refused():
    r = _serve("--kv-eviction", "bogus", "--kv-budget", "64")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr and "bogus" in r.stderr


def test_oracle_is_refused():
    r = _serve("--kv-eviction", "oracle", "--kv-budget", "64")
    assert r.returncode == 2 and "oracle" in r.stderr


def test_budget_below_the_protected_tokens_is_refused():
    r = _serve("--kv-eviction", "knorm", "--kv-budget", "8")
    assert r.returncode == 2 and "at least 20" in r.stderr


def test_checkpoint_for_another_model_is_refused(tmp_path):
    from kvp_vllm.policy import KVPPolicy, ModelShape

    KVPPolicy.random_init(ModelShape(2, 2, 32, "tiny-llama")).save(tmp_path / "tiny")
    r = _serve("--kv-eviction", "kvp", "--kv-budget", "64", "--kvp-checkpoint", str(tmp_path / "tiny"))
    assert r.returncode == 2
    assert "does not fit" in r.stderr and "num_layers" in r.stderr


def test_kvp_without_a_shipped_policy_says_so():
    """No policy ships for the tiny test model: kvp without --kvp-checkpoint must say so."""
    from kvp_vllm.assets import tiny_model_path

    r = _serve("--kv-eviction", "kvp", "--kv-budget", "64", model=str(tiny_model_path("tiny-llama")))
    assert r.returncode == 2 and "needs a trained policy" in r.stderr


def test_unsupported_model_family_is_refused(tmp_path):
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 512,
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "vocab_size": 256}))
    r = _serve("--kv-eviction", "knorm", "--kv-budget", "64", model=str(model))
    assert r.returncode == 2 and "not support" in r.stderr
