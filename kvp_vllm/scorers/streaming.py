"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keep the first `sinks` tokens and the most recent ones: the score is the token's position, with the
sinks lifted above everything else. Same ranking for every head.
"""

from dataclasses import dataclass

import torch

from .base import LayerKV, Scorer, register


@register("streaming")
@dataclass
class StreamingScorer(Scorer):
    sinks: int = 4

    def score(self, kv: LayerKV) -> torch.Tensor:
        pos = kv.positions.to(torch.float32)
        # Sinks rank above the most recent token: lift them past the largest position.
        lifted = torch.where(torch.arange(kv.length, device=pos.device) < self.sinks,
                             pos + 2.0 * (pos.max() + 1.0), pos)
        return lifted.expand(kv.num_kv_heads, kv.length).clone()
