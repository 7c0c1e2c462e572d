"""Future importance and the budget-integrated eviction cost (PAPER.md), shared by the oracle, the
training objective and the evaluation of rankings.

c_i = sum over answer queries t of max over the KV head's query group of A_q[t, i]  (fp32 softmax)
cost(sigma) = sum_k k * c_{sigma_k}: the attention mass evicted, summed over every budget b = 0..n-1.
An optional budget weighting (training only; the reported held-out costs are the paper's, uniform)
weighs budget b = 1..n-1 by w(b) (b = 0 evicts everything whatever the ranking): "log" (w = 1/b,
log-uniform over budgets) turns the rank weight k into the harmonic number H_k, so the smallest budgets
carry more of the signal.
"""

from __future__ import annotations

import torch


def future_importance(answer_queries: torch.Tensor, keys: torch.Tensor, n_prompt: int,
                      query_positions: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """c for the first n_prompt cached tokens, per KV head.

    answer_queries: [q_heads, F, d] post-RoPE queries of the answer tokens; keys: [kv_heads, T, d] with
    T >= the last query position + 1. query_positions [F] default: n_prompt .. n_prompt + F - 1.
    Each query attends causally over keys[: position + 1]. Returns fp32 [kv_heads, n_prompt].
    """
    q_heads, f, d = answer_queries.shape
    h, t, _ = keys.shape
    if q_heads % h:
        raise ValueError(f"{q_heads} query heads is not a multiple of {h} KV heads")
    if query_positions is None:
        query_positions = torch.arange(n_prompt, n_prompt + f, device=keys.device)
    q = answer_queries.float().reshape(h, q_heads // h, f, d)
    k = keys.float()
    key_pos = torch.arange(t, device=keys.device)
    total = torch.zeros(h, n_prompt, device=keys.device)
    for start in range(0, f, chunk):  # bounded memory: [h, group, chunk, T]
        qp = query_positions[start:start + chunk]
        logits = torch.einsum("hgfd,htd->hgft", q[:, :, start:start + chunk], k) / d ** 0.5
        logits = logits.masked_fill(key_pos[None, :] > qp[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., :n_prompt]
        total += probs.amax(dim=1).sum(dim=1)
    return total


BUDGET_WEIGHTINGS = ("uniform", "log")


def rank_weights(n: int, weighting: str = "uniform", device=None) -> torch.Tensor:
    """Cost weight of rank k (0-based) = sum of w(b) over the budgets 1 <= b <= k that evict it: k for
    "uniform" (w = 1, the paper), H_k = 1 + 1/2 + ... + 1/k for "log" (w = 1/b). Non-decreasing in k, so the oracle
    ranking (c sorted descending) stays optimal for either."""
    check_budget_weighting(weighting)
    ranks = torch.arange(n, device=device, dtype=torch.float32)
    if weighting == "uniform":
        return ranks
    return torch.cat([ranks.new_zeros(1), torch.cumsum(1.0 / (ranks[:-1] + 1.0), 0)])[:n]  # H_k


def check_budget_weighting(weighting: str) -> None:
    if weighting not in BUDGET_WEIGHTINGS:
        raise ValueError(f"budget weighting must be one of {', '.join(BUDGET_WEIGHTINGS)}; got {weighting!r}")


def ranking_cost(ranking: torch.Tensor, importance: torch.Tensor, weighting: str = "uniform") -> torch.Tensor:
    """cost(sigma) = sum_k W(k) * c[sigma_k] (W(k) = k by default); ranking, importance [..., n] -> [...]."""
    w = rank_weights(ranking.shape[-1], weighting, ranking.device)
    return (torch.gather(importance.float(), -1, ranking) * w).sum(-1)


def oracle_cost(importance: torch.Tensor, weighting: str = "uniform") -> torch.Tensor:
    """The minimal cost: c sorted descending (rearrangement inequality)."""
    w = rank_weights(importance.shape[-1], weighting, importance.device)
    return (importance.float().sort(dim=-1, descending=True).values * w).sum(-1)


def normalised_cost(ranking: torch.Tensor, importance: torch.Tensor, weighting: str = "uniform") -> torch.Tensor:
    """cost / cost*: 1.0 = oracle, lower is better (the paper's reward is its negative). ranking [..., n]
    or [K, ..., n] (K sampled rankings of the same importance [..., n])."""
    c = importance.float()
    if ranking.dim() == c.dim() + 1:
        c = c.expand(ranking.shape)
    return ranking_cost(ranking, c, weighting) / oracle_cost(importance, weighting).clamp_min(1e-12)
