"""What attention sees of a compacted request, one code path for vLLM's CPU and GPU V1 runners.

Tail-pack keeps everything logical: token positions (and so RoPE), the token gather and the slot
mapping of new tokens are unchanged; a request that freed its first k blocks simply has null blocks
there. Only the attention *view* of such a row changes: its sequence length drops by k*block_size and
its block-table row starts at block k. Both are done in vLLM's own persistent buffers, in place, so a
CUDA graph captured before any eviction reads the right values on replay:

* ``runner.seq_lens`` (device) and ``runner.optimistic_seq_lens_cpu`` (host; it feeds ``max_seq_len``
  and ``seq_lens_cpu_upper_bound``) are recomputed by vLLM every step inside ``_prepare_inputs``, so
  subtracting the offsets right after it never accumulates.
* ``BlockTable.get_device_tensor`` is only read by the attention-metadata build (the slot mapping
  reads ``block_table.gpu`` directly and stays logical). It is redirected to a persistent shadow
  table, filled at each call with the rows shifted left by each row's k (a plain copy when nothing is
  shifted, and in dummy / capture runs). The graph captures the shadow's address, never a new tensor.

No host synchronisation: the per-row shift goes to the device through a pinned buffer from PyTorch's
caching host allocator (safe to reuse once the copy has run) with a non-blocking copy.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def _pinned(array: np.ndarray, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(array)
    return t.pin_memory() if pin else t


class AttentionView:
    """The shadow block table and the per-row offsets of one model runner (KV cache group 0)."""

    def __init__(self, runner, block_size: int):
        from vllm.utils.platform_utils import is_pin_memory_available

        self.runner = runner
        self.block_size = block_size
        self.block_table = runner.input_batch.block_table[0]
        logical = self.block_table.block_table.gpu
        self.device = logical.device
        self.pin = is_pin_memory_available() and self.device.type == "cuda"
        self.shadow = torch.zeros_like(logical)               # persistent, same shape as vLLM's
        self.width = logical.shape[1]
        self.columns = torch.arange(self.width, device=self.device, dtype=torch.int64)
        self.shift = torch.zeros(logical.shape[0], device=self.device, dtype=torch.int64)
        self.shifted = False   # some row of this step starts past block 0
        self.pending = False   # a real step's metadata build has not read the view yet
        self.block_table._kvp_view = self  # found by the get_device_tensor hook

    def apply(self, shift_blocks: np.ndarray, num_reqs: int) -> None:
        """Called right after ``_prepare_inputs``: shift_blocks[row] = freed leading blocks of each
        batch row. Lowers the row's sequence lengths in place and stages the block-table shift."""
        self.pending = True
        self.shifted = bool(shift_blocks[:num_reqs].any())
        if not self.shifted:
            return
        full = np.zeros(self.shift.shape[0], dtype=np.int64)
        full[:num_reqs] = shift_blocks[:num_reqs]
        host = _pinned(full, self.pin)
        self.shift.copy_(host, non_blocking=True)
        offsets = torch.from_numpy(full[:num_reqs] * self.block_size)
        runner = self.runner
        seq_lens = runner.seq_lens
        seq_lens[:num_reqs] -= self.shift[:num_reqs].to(seq_lens.dtype) * self.block_size
        upper = runner.optimistic_seq_lens_cpu
        upper[:num_reqs] -= offsets.to(upper.dtype)

    def device_tensor(self, num_reqs: int) -> torch.Tensor:
        """Replacement of ``BlockTable.get_device_tensor``: the shadow table's first rows."""
        logical = self.block_table.block_table.gpu[:num_reqs]
        out = self.shadow[:num_reqs]
        if self.pending and self.shifted:
            index = (self.columns[None, :] + self.shift[:num_reqs, None]).clamp_(max=self.width - 1)
            torch.gather(logical, 1, index, out=out)
        else:
            out.copy_(logical)
        self.pending = False
        return out

    def row_shift(self) -> Optional[torch.Tensor]:
        """The staged per-row block shift (device), or None when no row of this step is shifted."""
        return self.shift if self.shifted else None
