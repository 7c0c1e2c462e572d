"""Turn per-head scores into the kept token indices: top-b per KV head, with protected sinks and a
protected recent window, exactly the same count for every head (so the paged layout stays
rectangular), indices returned in ascending position order.

Tie-breaking is deterministic and shared with the Triton kernel: among equal scores the token with
the lower index ranks first.
"""

from __future__ import annotations

import torch

DEFAULT_SINKS = 4
DEFAULT_RECENT = 16


def protected_count(length: int, n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> int:
    """How many of `length` tokens the protected sinks and recent window cover."""
    return min(length, n_sink + n_recent)


def check_budget(budget: int, n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> int:
    """Validate a budget (tokens kept per KV head) and return it as an int."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"the budget must be an integer number of tokens; got {budget!r}")
    if budget < n_sink + n_recent:
        raise ValueError(
            f"the budget must be at least {n_sink + n_recent} tokens (the {n_sink} sink and "
            f"{n_recent} recent tokens are always kept); got {budget}"
        )
    return budget


def protect(scores: torch.Tensor, n_sink: int = DEFAULT_SINKS,
            n_recent: int = DEFAULT_RECENT) -> torch.Tensor:
    """fp32 copy of scores [H, T] with the sinks and the recent window lifted to +inf.

    Non-finite scores elsewhere are a bug in the scoring rule: fail loudly instead of evicting
    arbitrary tokens.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [kv_heads, T]; got {tuple(scores.shape)}")
    s = scores.float().clone()
    t = s.shape[1]
    idx = torch.arange(t, device=s.device)
    is_protected = (idx < n_sink) | (idx >= t - n_recent)
    bad = ~torch.isfinite(s) & ~is_protected
    if bool(bad.any()):
        raise ValueError(f"scoring rule produced {int(bad.sum())} non-finite scores")
    s[:, is_protected] = float("inf")
    return s


def rank_tokens(scores: torch.Tensor, n_sink: int = DEFAULT_SINKS,
                n_recent: int = DEFAULT_RECENT) -> torch.Tensor:
    """Full ranking [H, T]: token indices per head, most worth keeping first (protected first)."""
    s = protect(scores, n_sink, n_recent)
    return torch.sort(s, dim=1, descending=True, stable=True).indices


def select_topb(scores: torch.Tensor, budget: int, n_sink: int = DEFAULT_SINKS,
                n_recent: int = DEFAULT_RECENT) -> torch.Tensor:
    """Kept indices [H, min(budget, T)] in ascending order; budget >= T keeps everything."""
    check_budget(budget, n_sink, n_recent)
    h, t = scores.shape
    if budget >= t:
        return torch.arange(t, device=scores.device).expand(h, t).clone()
    kept = rank_tokens(scores, n_sink, n_recent)[:, :budget]
    return kept.sort(dim=1).values


def block_aligned_budget(length: int, budget: int, block_size: int) -> int:
    """The count b' the paged server keeps: whole blocks are freed from the front, so it keeps
    b' = length - k*block_size with k = floor((length - budget) / block_size), i.e.
    budget <= b' < budget + block_size (or everything when budget >= length)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive; got {block_size}")
    if budget >= length:
        return length
    freed_blocks = (length - budget) // block_size
    return length - freed_blocks * block_size


def gather_kept(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Gather per-head kept entries: x [H, T, d] (or [H, T]) with kept [H, b] -> [H, b, d]."""
    if x.dim() == 2:
        return torch.gather(x, 1, kept)
    return torch.gather(x, 1, kept[..., None].expand(-1, -1, x.shape[-1]))
