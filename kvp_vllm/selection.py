"""Turn per-head scores into the kept token indices: top-b per KV head, with protected sinks and a
protected recent window, exactly the same count for every head (so the paged layout stays
rectangular), indices returned in ascending position order.

Tie-breaking is deterministic and shared with the Triton kernel: among equal scores the token with
the lower index ranks first.

Which tokens are protected is the `--protect` mode (`PROTECT_MODES`, the one table the evaluation
harness, the server and their CLIs read): `paper` keeps the first 4 (sinks) and last 16 tokens whatever
the rule says (the KVP paper's protocol), `none` protects nothing (the rule's own choice, as kvpress
runs the baselines). The minimum budget (`min_budget`) and the budget validator (`check_budget`) live
here too, for every consumer.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

DEFAULT_SINKS = 4
DEFAULT_RECENT = 16

#: --protect modes -> (n_sink, n_recent): the tokens kept whatever the rule's scores.
PROTECT_MODES: Dict[str, Tuple[int, int]] = {"paper": (DEFAULT_SINKS, DEFAULT_RECENT), "none": (0, 0)}
DEFAULT_PROTECT = "paper"


class BudgetError(ValueError):
    """A budget that cannot be used (the server's API answers HTTP 400 with the message)."""


def protected_counts(mode: str = DEFAULT_PROTECT) -> Tuple[int, int]:
    """(n_sink, n_recent) of a --protect mode."""
    if mode not in PROTECT_MODES:
        raise ValueError(f"unknown protect mode {mode!r}; choose one of {', '.join(PROTECT_MODES)}")
    return PROTECT_MODES[mode]


def protect_mode(n_sink: int, n_recent: int) -> Optional[str]:
    """The --protect mode of these counts (None when they are no named mode)."""
    return next((m for m, c in PROTECT_MODES.items() if c == (n_sink, n_recent)), None)


def protected_count(length: int, n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> int:
    """How many of `length` tokens the protected sinks and recent window cover."""
    return min(length, n_sink + n_recent)


def min_budget(n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> int:
    """The smallest budget: every protected token, and at least one token."""
    return max(1, n_sink + n_recent)


def check_budget(budget: int, n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT, *,
                 maximum: Optional[int] = None, what: str = "the budget", allow_off: bool = False) -> int:
    """Validate a budget (tokens kept per KV head) and return it: an int (bools, floats and strings
    are refused) in [min_budget(n_sink, n_recent), maximum]. The one validator of the harness, the
    server (`what` names the flag or field; `allow_off` mentions its 0/"none" = no eviction) and the
    kernels. Raises BudgetError."""
    off = " 0/\"none\" (no eviction) or" if allow_off else ""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise BudgetError(f"{what} must be{off} an integer number of tokens; got {budget!r}")
    low = min_budget(n_sink, n_recent)
    if budget < low:
        why = (f" (the {n_sink} sink and {n_recent} recent tokens are always kept)"
               if n_sink + n_recent else "")
        raise BudgetError(f"{what} must be{off} at least {low} tokens{why}; got {budget}")
    if maximum is not None and budget > maximum:
        raise BudgetError(f"{what} {budget} exceeds the model's maximum length {maximum}")
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
