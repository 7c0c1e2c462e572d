"""Where each (token, channel) of K and V lives inside one paged-cache block, for vLLM's CPU backend.

The CPU cache of a layer is `[num_blocks, kv_heads, block_size, 2*head_dim]`, but the interior of a
(block, head) slab depends on the ISA kernel (the vec path stores K transposed, AMX tiles it). Rather
than hard-code that, we probe it once: write known ids through vLLM's own
`cpu_attn_reshape_and_cache` into a scratch block and read back where each id landed. The result is
a pair of flat index maps, so reading and rewriting tokens is two gathers/scatters whatever the ISA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    block_size: int
    head_dim: int
    k_index: torch.Tensor  # [block_size * head_dim] flat offsets of K[t, d] within a (block, head) slab
    v_index: torch.Tensor  # same for V

    @property
    def slab(self) -> int:
        return 2 * self.block_size * self.head_dim

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor):
        """K, V [kv_heads, n_blocks * block_size, head_dim] of the given blocks (in order)."""
        nb, h = block_ids.numel(), cache.shape[1]
        raw = cache.view(cache.shape[0], h, self.slab)[block_ids]  # [n, H, slab]
        k = raw[..., self.k_index].view(nb, h, self.block_size, self.head_dim)
        v = raw[..., self.v_index].view(nb, h, self.block_size, self.head_dim)
        return (k.permute(1, 0, 2, 3).reshape(h, nb * self.block_size, self.head_dim),
                v.permute(1, 0, 2, 3).reshape(h, nb * self.block_size, self.head_dim))

    def write_prefix(self, cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        """Write keys/values [H, n, d] into the first n token slots of the given blocks (in order);
        the rest of the last block is left as it was (read-modify-write of whole slabs)."""
        h, n, d = keys.shape
        nb, bs = block_ids.numel(), self.block_size
        flat = cache.view(cache.shape[0], h, self.slab)
        raw = flat[block_ids]  # a copy [nb, H, slab]
        for index, new in ((self.k_index, keys), (self.v_index, values)):
            part = raw[..., index].view(nb, h, bs, d).permute(1, 0, 2, 3).reshape(h, nb * bs, d)
            part[:, :n] = new.to(raw.dtype)
            raw[..., index] = part.view(h, nb, bs, d).permute(1, 0, 2, 3).reshape(nb, h, bs * d)
        flat[block_ids] = raw


def probe_layout(num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str,
                 kv_cache_dtype: str = "auto") -> BlockLayout:
    """Find the K/V element positions inside a slab by writing ids through vLLM's own cache op."""
    from vllm import _custom_ops as ops

    n = block_size * head_dim
    ids = torch.arange(n).view(block_size, head_dim)
    # Small integers are exact in bf16/fp16 (<= 256): write the id in base-64 digits, one per pass.
    digits = []
    base = 64
    rest = ids.clone()
    while True:
        digits.append(rest % base)
        rest = rest // base
        if not bool((rest > 0).any()):
            break
    slot_mapping = torch.arange(block_size, dtype=torch.int64)
    found = []
    for which in ("k", "v"):
        acc = torch.zeros(2 * n, dtype=torch.int64)
        seen = torch.zeros(2 * n, dtype=torch.bool)
        for i, digit in enumerate(digits):
            cache = torch.full((1, num_kv_heads, 2 * block_size, head_dim), -1.0, dtype=dtype)
            key_cache, value_cache = cache.chunk(2, dim=2)
            payload = (digit + 1).to(dtype)[:, None, :].expand(block_size, num_kv_heads, head_dim)
            zeros = torch.zeros_like(payload)
            key, value = (payload, zeros) if which == "k" else (zeros, payload)
            ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                           slot_mapping, isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype=kv_cache_dtype)
            slab = cache[0, 0].reshape(-1).float()  # head 0's slab, flat
            hit = slab >= 1.0
            acc[hit] += ((slab[hit] - 1).round().long()) * base ** i
            seen |= hit
        index = torch.full((n,), -1, dtype=torch.int64)
        # Positions that never held a payload digit >= 1 belong to id 0 of every digit pass? No:
        # every digit is written as digit + 1 >= 1, so every written position is seen.
        pos = seen.nonzero().squeeze(1)
        index[acc[pos]] = pos
        if bool((index < 0).any()) or pos.numel() != n:
            raise RuntimeError(f"could not map the CPU KV cache layout (isa={isa}, dtype={dtype}): "
                               f"{pos.numel()} of {n} {which.upper()} elements located")
        found.append(index)
    layout = BlockLayout(block_size, head_dim, found[0], found[1])
    _self_check(layout, num_kv_heads, dtype, isa, kv_cache_dtype)
    return layout


def _self_check(layout: BlockLayout, h: int, dtype, isa: str, kv_cache_dtype: str) -> None:
    """Round trip random K/V through vLLM's writer and our reader: they must agree exactly."""
    from vllm import _custom_ops as ops

    bs, d = layout.block_size, layout.head_dim
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    v = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    cache = torch.zeros((3, h, 2 * bs, d), dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.cat([torch.arange(bs) + 2 * bs, torch.arange(bs)]).long()  # block 2 then block 0
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    view = cache.view(3, h, bs, 2 * d)
    rk, rv = layout.read(view, torch.tensor([2, 0]))
    if not (torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))):
        raise RuntimeError(f"CPU KV cache layout probe failed its round trip (isa={isa})")
    # And our writer must produce what vLLM's reader expects.
    other = torch.zeros_like(view)
    layout.write_prefix(other, torch.tensor([2, 0]), k.transpose(0, 1), v.transpose(0, 1))
    if not torch.equal(other, view):
        raise RuntimeError(f"CPU KV cache layout probe: writer disagrees with vLLM (isa={isa})")
