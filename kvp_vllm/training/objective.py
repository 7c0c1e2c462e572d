"""The KVP training objective (PAPER.md): budget-integrated eviction cost, oracle-normalised reward,
Plackett-Luce rankings sampled by Gumbel sort, REINFORCE with a leave-one-out (RLOO) baseline.

Shapes: the leading dimensions [...] index independent ranking problems (trace x layer x KV head);
the last dimension indexes the n candidate tokens. Sampled rankings carry a leading sample dim K.

Protected tokens. At serving time the first `n_sink` (4) and last `n_recent` (16) tokens are always
kept, so no ranking decision concerns them. Training and the held-out evaluation therefore rank only the
middle tokens [n_sink, n - n_recent) and compute cost and oracle cost over those tokens alone (their
importance c is taken as collected; the protected tokens' mass is a constant no rule can change).
`middle()` is the one place that decides this.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..importance import normalised_cost
from ..selection import DEFAULT_RECENT, DEFAULT_SINKS

REWARD_FLOOR = -200.0


def middle(n: int, n_sink: int = DEFAULT_SINKS, n_recent: int = DEFAULT_RECENT) -> slice:
    """The rankable (unprotected) token range of an n-token prompt."""
    if n <= n_sink + n_recent:
        raise ValueError(f"a {n}-token prompt has no unprotected tokens ({n_sink} sinks + {n_recent} "
                         f"recent are always kept)")
    return slice(n_sink, n - n_recent)


def gumbel_rankings(scores: torch.Tensor, k: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """K rankings [K, ..., n] sampled from the Plackett-Luce distribution of `scores` (sort of
    scores + Gumbel(0,1) noise, descending): exact PL samples."""
    shape = (k,) + tuple(scores.shape)
    u = torch.rand(shape, generator=generator, device=scores.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
    return torch.argsort(scores.detach().float()[None] + gumbel, dim=-1, descending=True)


def plackett_luce_log_prob(scores: torch.Tensor, rankings: torch.Tensor) -> torch.Tensor:
    """log p(sigma) = sum_k [ s_{sigma_k} - logsumexp_{j >= k} s_{sigma_j} ], vectorised as a reverse
    log-cumsum-exp (no per-step loop). scores [..., n]; rankings [K, ..., n] (or [..., n]) -> [K, ...]."""
    s = scores.float()
    if rankings.dim() == s.dim() + 1:
        s = s.expand(rankings.shape)
    ordered = torch.gather(s, -1, rankings)
    tail_lse = torch.logcumsumexp(ordered.flip(-1), dim=-1).flip(-1)
    return (ordered - tail_lse).sum(-1)


def rewards(rankings: torch.Tensor, importance: torch.Tensor, floor: float = REWARD_FLOOR,
            weighting: str = "uniform") -> torch.Tensor:
    """R = -cost/cost*, clamped at `floor` (-200): oracle = -1."""
    return (-normalised_cost(rankings, importance, weighting)).clamp_min(floor)


def rloo_advantages(r: torch.Tensor, clip: float = 2.0, normalise: bool = True,
                    eps: float = 1e-8) -> torch.Tensor:
    """Leave-one-out advantages over the sample dim 0: A_k = R_k - mean_{j != k} R_j; then (optionally)
    divided by their standard deviation over the K samples of the same problem, and clipped to
    [-clip, clip]. Per-problem normalisation gives every (trace, head) an equal say, whatever the spread
    of its rewards (layers differ by orders of magnitude)."""
    k = r.shape[0]
    if k < 2:
        raise ValueError("RLOO needs at least 2 sampled rankings per problem")
    baseline = (r.sum(0, keepdim=True) - r) / (k - 1)
    adv = r - baseline
    if normalise:
        adv = adv / (adv.std(0, keepdim=True) + eps)
    return adv.clamp(-clip, clip)


def rloo_loss(scores: torch.Tensor, importance: torch.Tensor, samples: int = 8, clip: float = 2.0,
              generator: Optional[torch.Generator] = None,
              mask: Optional[torch.Tensor] = None,
              weighting: str = "uniform") -> Tuple[torch.Tensor, Dict[str, float]]:
    """REINFORCE-RLOO loss for scores, importance [..., n] (already restricted to the rankable tokens).

    loss = -mean over samples and problems of A * log p(sigma) / n (the 1/n keeps the loss scale
    independent of the prompt length; Adam is insensitive to it). `mask` [...] (bool) drops problems.
    `weighting`: the cost's budget weighting (`kvp_vllm.importance.rank_weights`).
    Returns the loss and detached statistics (mean sampled normalised cost, greedy normalised cost)."""
    rankings = gumbel_rankings(scores, samples, generator)
    with torch.no_grad():
        r = rewards(rankings, importance, weighting=weighting)
        adv = rloo_advantages(r, clip=clip)
    logp = plackett_luce_log_prob(scores, rankings) / scores.shape[-1]
    per = -(adv * logp)  # [K, ...]
    if mask is not None:
        m = mask.to(per.dtype).expand(per.shape)
        loss = (per * m).sum() / m.sum().clamp_min(1.0)
    else:
        loss = per.mean()
    with torch.no_grad():
        greedy = torch.argsort(scores.detach().float(), dim=-1, descending=True, stable=True)
        stats = {"sampled_cost": float(-r.mean()), "greedy_cost": float(normalised_cost(greedy, importance, weighting).mean())}
    return loss, stats


def greedy_normalised_cost(scores: torch.Tensor, importance: torch.Tensor, weighting: str = "uniform") -> torch.Tensor:
    """cost/cost* of the deterministic ranking (stable descending sort, lower index first on ties, as
    `kvp_vllm.selection.rank_tokens` does) -> [...]."""
    order = torch.argsort(scores.float(), dim=-1, descending=True, stable=True)
    return normalised_cost(order, importance, weighting)
