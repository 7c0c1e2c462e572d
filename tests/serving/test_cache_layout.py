"""The start-up check that vLLM's CPU attention writes K/V where `kvp_vllm.kernels` ("cpu" layout)
reads and writes them: vLLM's own cache writer, no server needed."""

from __future__ import annotations

import pytest
import torch

from kvp_vllm.serving.cache_layout import verify_cpu_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_vllm_cpu_attention_layout_is_the_kernels_cpu_layout(dtype, block_size):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, 64)
    assert verify_cpu_layout(3, block_size, 64, dtype, isa) == "cpu"


def test_a_layout_we_cannot_read_is_refused(monkeypatch):
    """A cache writer that stores keys untransposed (as a different ISA path might) is refused."""
    from vllm import _custom_ops as ops

    def untransposed(key, value, key_cache, value_cache, slots, isa, **kw):
        bs = key_cache.shape[2]  # key_cache / value_cache: [num_blocks, H, block_size, d] halves
        for i, s in enumerate(slots.tolist()):
            key_cache[s // bs, :, s % bs] = key[i]  # keys row-major, not transposed
            value_cache[s // bs, :, s % bs] = value[i]

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", untransposed)
    with pytest.raises(RuntimeError, match="cannot read this CPU KV cache layout"):
        verify_cpu_layout(2, 16, 64, torch.float32, "fake")
