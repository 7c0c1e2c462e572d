"""The stacked KVP policy: batched scoring equals a per-head loop; checkpoints round-trip and refuse
a model of another shape or a corrupt file with a clear error."""

import json

import pytest
import torch
import torch.nn.functional as F

from kvp_vllm.policy import CheckpointError, KVPPolicy, ModelShape, PolicyConfig, position_features

SHAPE = ModelShape(num_layers=3, num_kv_heads=2, head_dim=16, model_name="tiny")


def one_head(policy, g, keys, values, positions, length):
    """A plain per-head MLP with the g-th slice of every stacked weight."""
    def lin(m, x):
        return x @ m.weight[g] + m.bias[g]

    def ln(m, x):
        return F.layer_norm(x, x.shape[-1:]) * m.weight[g] + m.bias[g]

    pos = position_features(positions, length, policy.config.pos_frequencies)
    x = torch.cat([ln(policy.key_norm, lin(policy.key_proj, keys)),
                   ln(policy.value_norm, lin(policy.value_proj, values)),
                   ln(policy.pos_norm, lin(policy.pos_proj, pos))], -1)
    for lin_m, ln_m in zip(policy.hidden, policy.hidden_norm):
        x = F.silu(ln(ln_m, lin(lin_m, x)))
    return lin(policy.out, x).squeeze(-1)


@pytest.mark.parametrize("reference", [False, True])
def test_batched_equals_per_head_loop(reference):
    policy = KVPPolicy.random_init(SHAPE, seed=2, reference=reference)
    t = 37
    keys, values = torch.randn(3, 2, t, 16), torch.randn(3, 2, t, 16)
    pos = torch.arange(t)
    with torch.no_grad():
        batched = policy.score_all(keys, values, pos)
        for layer in range(3):
            per_layer = policy.score_layer(layer, keys[layer], values[layer], pos)
            assert torch.allclose(per_layer, batched[layer], atol=1e-5)
            for h in range(2):
                ref = one_head(policy, layer * 2 + h, keys[layer, h], values[layer, h], pos, t)
                assert torch.allclose(batched[layer, h], ref, atol=1e-5)


def test_per_head_positions_equal_shared_positions():
    """After a compaction each head keeps different tokens: positions may be [heads, T]."""
    policy = KVPPolicy.random_init(SHAPE, seed=3)
    keys, values = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    per_head = torch.stack([torch.arange(0, 18, 2), torch.arange(1, 19, 2)])
    with torch.no_grad():
        both = policy.score_layer(1, keys, values, per_head, length=40)
        for h in range(2):
            one = policy.forward(keys[h:h + 1], values[h:h + 1], per_head[h], 40, slice(2 + h, 3 + h))
            assert torch.allclose(both[h], one[0], atol=1e-5)


def test_reference_architecture_is_paper_sized():
    cfg = PolicyConfig.reference(ModelShape(28, 4, 128))
    assert (cfg.key_dim, cfg.value_dim, cfg.pos_dim, cfg.hidden_dim, cfg.depth) == (256, 256, 32, 256, 2)
    small = KVPPolicy.random_init(ModelShape(30, 3, 64))
    assert small.num_parameters_per_head() < 20_000


def test_position_features_separate_far_positions():
    """The clamped 6000-row table maps every position past 6000 to one row; ours keeps them apart."""
    pos = torch.tensor([6000, 20000, 100000, 127999])
    feats = position_features(pos, 128000, 8)
    assert torch.cdist(feats, feats).fill_diagonal_(1.0).min() > 1e-3
    assert torch.isfinite(feats).all()


def test_checkpoint_round_trip(tmp_path):
    policy = KVPPolicy.random_init(SHAPE, seed=5)
    policy.save(tmp_path / "ckpt", extra={"note": "test"})
    loaded = KVPPolicy.load(tmp_path / "ckpt", expect=SHAPE)
    assert loaded.config == policy.config
    for (n, a), (_, b) in zip(policy.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["extra"] == {"note": "test"}
    assert not list((tmp_path / "ckpt").glob(".*tmp")), "no temporary files left behind"


def test_checkpoint_for_another_model_is_refused(tmp_path):
    KVPPolicy.random_init(SHAPE).save(tmp_path)
    other = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, model_name="SmolLM2")
    with pytest.raises(CheckpointError, match=r"num_layers: checkpoint 3 vs model 30.*num_kv_heads.*head_dim"):
        KVPPolicy.load(tmp_path, expect=other)


def test_truncated_weights_are_refused(tmp_path):
    KVPPolicy.random_init(SHAPE).save(tmp_path)
    weights = tmp_path / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        KVPPolicy.load(tmp_path)


def test_flipped_byte_is_refused(tmp_path):
    KVPPolicy.random_init(SHAPE).save(tmp_path)
    weights = tmp_path / "policy.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        KVPPolicy.load(tmp_path)


def test_missing_and_garbage_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        KVPPolicy.load(tmp_path)
    KVPPolicy.random_init(SHAPE).save(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid KVP policy config"):
        KVPPolicy.load(tmp_path)


def test_score_layer_checks_shapes():
    policy = KVPPolicy.random_init(SHAPE)
    with pytest.raises(ValueError, match="out of range"):
        policy.score_layer(3, torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), torch.arange(4))
    with pytest.raises(ValueError, match="policy expects"):
        policy.score_layer(0, torch.zeros(3, 4, 16), torch.zeros(3, 4, 16), torch.arange(4))


def test_distance_only_policy_ignores_absolute_positions_and_the_kernel_path_agrees(tmp_path):
    """position_inputs="distance": the scores depend on the distance from the newest token only (the
    same cache shifted by 6,000 positions scores the same), the absolute features' weights stay zero
    through training steps, so the fused kernels' torch reference (which computes every feature) gives
    the policy's scores, and the setting round-trips through a checkpoint."""
    from kvp_vllm.kernels import pack_layer
    from kvp_vllm.kernels.score_select_ref import mlp_ref
    from kvp_vllm.policy import absolute_position_features

    policy = KVPPolicy.random_init(SHAPE, seed=3, position_inputs="distance")
    keys, values = torch.randn(2, 50, 16), torch.randn(2, 50, 16)
    pos = torch.arange(50)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    policy.train()
    for _ in range(3):
        opt.zero_grad()
        policy.score_layer(1, keys, values, pos * 7).square().mean().backward()
        opt.step()
    policy.eval()
    rows = policy.pos_proj.weight[:, absolute_position_features(policy.config.pos_frequencies)]
    assert rows.abs().max() == 0
    with torch.no_grad():
        near = policy.score_layer(1, keys, values, pos, 50)
        far = policy.score_layer(1, keys, values, pos + 6000, 6050)
        torch.testing.assert_close(near, far)
        both = KVPPolicy.random_init(SHAPE, seed=3)
        assert not torch.allclose(both.score_layer(1, keys, values, pos, 50),
                                  both.score_layer(1, keys, values, pos + 6000, 6050))
        got = mlp_ref(pack_layer(policy, 1), keys, values,
                      position_features(pos[None] + 6000, 6050, policy.config.pos_frequencies))
    torch.testing.assert_close(got, far, rtol=1e-4, atol=1e-4)
    policy.save(tmp_path)
    again = KVPPolicy.load(tmp_path)
    assert again.config.position_inputs == "distance"
    with pytest.raises(ValueError, match="position_inputs"):
        PolicyConfig(num_layers=1, num_kv_heads=1, head_dim=8, position_inputs="absolute")


def test_fine_tuning_can_switch_a_policy_to_distance_only():
    from kvp_vllm.training.trainer import with_config

    both = KVPPolicy.random_init(SHAPE, seed=4)
    dist = with_config(both, {"position_inputs": "distance"})
    assert dist.config.position_inputs == "distance"
    torch.testing.assert_close(dist.key_proj.weight, both.key_proj.weight)
    keys, values = torch.randn(2, 20, 16), torch.randn(2, 20, 16)
    with torch.no_grad():
        torch.testing.assert_close(dist.score_layer(0, keys, values, torch.arange(20)),
                                   dist.score_layer(0, keys, values, torch.arange(20) + 999))
    with pytest.raises(ValueError, match="shape"):
        with_config(both, {"hidden_dim": 8})
