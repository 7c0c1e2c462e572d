"""Per-request budget / rule validation and the shipped-checkpoint lookup (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvp_vllm.serving.config import (BudgetError, EvictionConfig, request_budget, request_rule,
                                     resolve_checkpoint, shipped_checkpoint)

CFG = EvictionConfig(rule="snapkv", budget=64)


@pytest.mark.parametrize("xargs, want", [
    (None, 64), ({}, 64), ({"other": 1}, 64),
    ({"kv_budget": 0}, None), ({"kv_budget": "none"}, None), ({"kv_budget": "None"}, None),
    ({"kv_budget": 20}, 20), ({"kv_budget": 4096}, 4096),
])
def test_request_budget_accepts(xargs, want):
    assert request_budget(xargs, CFG, max_model_len=4096) == want


@pytest.mark.parametrize("value", [-1, 1.5, 100.0, "abc", "64", True, False, 19, 4097, [64], None])
def test_request_budget_refuses(value):
    with pytest.raises(BudgetError):
        request_budget({"kv_budget": value}, CFG, max_model_len=4096)


def test_no_eviction_server_refuses_a_budget_but_accepts_none():
    off = EvictionConfig()
    assert request_budget(None, off) is None
    assert request_budget({"kv_budget": 0}, off) is None
    with pytest.raises(BudgetError, match="without KV eviction"):
        request_budget({"kv_budget": 64}, off)


def test_request_rule():
    assert request_rule(None, CFG) == "snapkv"
    assert request_rule({"kv_rule": "tova"}, CFG) == "tova"
    for bad in ("oracle", "kvp", "none", 3, "bogus"):  # kvp needs a checkpoint on the server
        with pytest.raises(BudgetError, match="kv_rule"):
            request_rule({"kv_rule": bad}, CFG)
    assert request_rule({"kv_rule": "kvp"}, EvictionConfig(rule="snapkv", checkpoint="/x")) == "kvp"


def test_server_config_validation():
    with pytest.raises(ValueError, match="unknown"):
        EvictionConfig(rule="oracle").validate()
    with pytest.raises(ValueError, match="at least 20"):
        EvictionConfig(rule="knorm", budget=8).validate()
    with pytest.raises(ValueError, match="interval"):
        EvictionConfig(rule="knorm", budget=64, interval=0).validate()
    assert EvictionConfig.from_env({"KVP_VLLM_CONFIG": CFG.to_env()}) == CFG


def test_shipped_checkpoint_lookup(tmp_path):
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    assert shipped_checkpoint("/models/SmolLM2-135M-Instruct-bf16", tmp_path) is None
    (folder / "config.json").write_text("{}")
    (folder / "policy.safetensors").write_bytes(b"")
    assert shipped_checkpoint("/models/SmolLM2-135M-Instruct-bf16", tmp_path) == folder
    assert shipped_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == folder
    with pytest.raises(FileNotFoundError, match="needs a trained policy"):
        resolve_checkpoint("other/Model-1B", None, tmp_path)


def test_protect_modes_set_the_protected_counts_and_the_minimum_budget():
    """--protect none: nothing protected, any budget >= 1; paper (default): 4 + 16, budgets >= 20."""
    none = EvictionConfig(rule="knorm", budget=1, n_sink=0, n_recent=0).validate()
    assert none.min_budget == 1 and none.protect == "none" and CFG.protect == "paper"
    assert request_budget({"kv_budget": 1}, none) == 1
    with pytest.raises(BudgetError, match="at least 1 tokens"):
        request_budget({"kv_budget": -3}, none)
    assert EvictionConfig.from_env({"KVP_VLLM_CONFIG": none.to_env()}) == none
    with pytest.raises(ValueError, match="n_sink must be a non-negative integer"):
        EvictionConfig(rule="knorm", budget=64, n_sink=-1).validate()


def test_serve_cli_protect_flag(monkeypatch):
    import argparse

    from kvp_vllm.serving import cli

    monkeypatch.setattr(cli, "_hf_config", lambda model: None)  # no model folder needed

    def config(*flags):
        parser = argparse.ArgumentParser()
        cli.add_eviction_args(parser)
        args = parser.parse_args(["--kv-eviction", "knorm", *flags])
        args.model, args.model_tag = "m", None
        return cli.build_config(args)

    assert (config("--kv-budget", "64").n_sink, config("--kv-budget", "64").n_recent) == (4, 16)
    cfg = config("--kv-budget", "8", "--protect", "none")
    assert (cfg.n_sink, cfg.n_recent, cfg.budget) == (0, 0, 8)
    with pytest.raises(cli.CLIError, match="at least 20"):
        config("--kv-budget", "8", "--protect", "paper")
    with pytest.raises(SystemExit):
        config("--protect", "some")
    assert "--protect {paper,none}" in cli.USAGE


def test_server_rules_come_from_the_scorer_registry():
    from kvp_vllm.scorers import SERVABLE_RULES
    from kvp_vllm.serving.config import CLI_RULES

    assert CLI_RULES[0] == "none" and set(CLI_RULES[1:]) == set(SERVABLE_RULES) and "oracle" not in CLI_RULES
