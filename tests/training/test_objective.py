"""The training objective against brute-force enumeration on tiny sequences."""

import itertools
import math

import pytest
import torch

from kvp_vllm.importance import oracle_cost, ranking_cost
from kvp_vllm.policy import KVPPolicy, ModelShape
from kvp_vllm.training.objective import (REWARD_FLOOR, greedy_normalised_cost, gumbel_rankings, middle,
                                         plackett_luce_log_prob, rewards, rloo_advantages, rloo_loss)


def _loop_log_prob(s, perm):
    total = 0.0
    for k in range(len(perm)):
        rest = torch.stack([s[j] for j in perm[k:]])
        total += float(s[perm[k]] - torch.logsumexp(rest, 0))
    return total


@pytest.mark.parametrize("n", [1, 2, 4, 5])
def test_pl_log_probs_sum_to_one_over_all_permutations(n):
    torch.manual_seed(n)
    s = torch.randn(n) * 2
    perms = torch.tensor(list(itertools.permutations(range(n))))
    logp = plackett_luce_log_prob(s, perms)
    assert logp.shape == (math.factorial(n),)
    assert torch.exp(logp.double()).sum().item() == pytest.approx(1.0, abs=1e-5)
    for p, lp in zip(perms[:7], logp[:7]):
        assert lp.item() == pytest.approx(_loop_log_prob(s, p.tolist()), abs=1e-5)


def test_pl_batched_shapes_and_sample_dim():
    s = torch.randn(3, 2, 6)
    r = gumbel_rankings(s, 5)
    assert r.shape == (5, 3, 2, 6)
    assert (r.sort(-1).values == torch.arange(6)).all()  # permutations
    assert plackett_luce_log_prob(s, r).shape == (5, 3, 2)


def test_gumbel_sort_samples_the_plackett_luce_distribution():
    s = torch.tensor([1.0, 0.0, -0.5])
    gen = torch.Generator().manual_seed(0)
    r = gumbel_rankings(s, 40000, gen)
    perms = list(itertools.permutations(range(3)))
    exact = torch.exp(plackett_luce_log_prob(s, torch.tensor(perms)))
    for p, e in zip(perms, exact):
        freq = (r == torch.tensor(p)).all(-1).float().mean().item()
        assert freq == pytest.approx(e.item(), abs=0.01)


def test_cost_is_evicted_mass_summed_over_every_budget_and_oracle_is_minimal():
    torch.manual_seed(1)
    c = torch.rand(5)
    best = math.inf
    for p in itertools.permutations(range(5)):
        p = torch.tensor(p)
        # budget b keeps p[:b] and evicts the mass of p[b:]; budgets 1..n-1 (b = 0 evicts everything
        # whatever the ranking, a constant)
        brute = sum(float(c[p[b:]].sum()) for b in range(1, 5))
        assert ranking_cost(p, c).item() == pytest.approx(brute, abs=1e-5)
        best = min(best, ranking_cost(p, c).item())
    assert oracle_cost(c).item() == pytest.approx(best, abs=1e-6)
    assert rewards(c.argsort(descending=True), c).item() == pytest.approx(-1.0)


def test_log_budget_weighting_is_the_weighted_sum_over_budgets_and_keeps_the_oracle_optimal():
    """--budget-weighting log: budget b (1..n-1) weighs 1/b; the oracle order is still the cheapest."""
    torch.manual_seed(2)
    c = torch.rand(5)
    costs = []
    for p in itertools.permutations(range(5)):
        p = torch.tensor(p)
        brute = sum(float(c[p[b:]].sum()) / b for b in range(1, 5))
        assert ranking_cost(p, c, "log").item() == pytest.approx(brute, abs=1e-5)
        costs.append(ranking_cost(p, c, "log").item())
    assert oracle_cost(c, "log").item() == pytest.approx(min(costs), abs=1e-6)
    # a different objective from the paper's: the two weightings order some rankings differently
    perms = [torch.tensor(p) for p in itertools.permutations(range(5))]
    uni = [ranking_cost(p, c).item() for p in perms]
    assert any((uni[i] < uni[j]) != (costs[i] < costs[j]) for i in range(len(perms)) for j in range(i))
    assert rewards(c.argsort(descending=True), c, weighting="log").item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="budget weighting"):
        ranking_cost(perms[0], c, "linear")


def test_reward_is_clamped():
    c = torch.tensor([1.0, 1e-9, 0.0, 0.0])
    worst = torch.tensor([3, 2, 1, 0])
    assert rewards(worst, c).item() == REWARD_FLOOR


def test_rloo_advantages():
    r = torch.tensor([[1.0], [2.0], [3.0], [6.0]])
    raw = rloo_advantages(r, clip=100.0, normalise=False)
    expected = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3])[:, None]
    assert torch.allclose(raw, expected)
    assert abs(raw.sum().item()) < 1e-5
    norm = rloo_advantages(r, clip=100.0)
    assert norm.std(0).item() == pytest.approx(1.0, rel=1e-4)
    assert rloo_advantages(r * 1000, clip=0.5).abs().max().item() <= 0.5
    with pytest.raises(ValueError):
        rloo_advantages(r[:1])


def _expected_reward_grad(s, c):
    """Exact d E[R] / d s by enumeration."""
    s = s.clone().requires_grad_(True)
    perms = torch.tensor(list(itertools.permutations(range(len(c)))))
    p = torch.exp(plackett_luce_log_prob(s, perms))
    (p * rewards(perms, c)).sum().backward()
    return s.grad


def test_gradient_sign_sanity():
    c = torch.tensor([0.05, 0.6, 0.1, 0.25])
    s = torch.zeros(4)
    g = _expected_reward_grad(s, c)
    # ascending E[R] raises the score of the most important token, lowers the least important one
    assert g.argmax().item() == 1 and g.argmin().item() == 0
    # the RLOO loss, averaged over many samples, points the same way (descending loss = ascending R)
    s = torch.zeros(4, requires_grad=True)
    loss, _ = rloo_loss(s.expand(2000, 4), c.expand(2000, 4), samples=8,
                        generator=torch.Generator().manual_seed(0))
    loss.backward()
    est = -s.grad
    assert torch.nn.functional.cosine_similarity(est, g, dim=0).item() > 0.9


def test_rloo_training_learns_a_feature_ranking():
    """A tiny policy learns importance that depends on a key feature (greedy cost drops toward 1)."""
    torch.manual_seed(0)
    shape = ModelShape(1, 2, 8, "synthetic")
    policy = KVPPolicy.random_init(shape, seed=0).train()
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    n = 48

    def batch():
        keys = torch.randn(2, n, 8)
        c = torch.softmax(3 * keys[..., 0], dim=-1)
        return keys, c

    keys, c = batch()
    pos = torch.arange(n)
    with torch.no_grad():
        before = greedy_normalised_cost(policy(keys, keys, pos, n), c).mean().item()
    for _ in range(80):
        k, cc = batch()
        loss, _ = rloo_loss(policy(k, k, pos, n), cc, samples=8, generator=gen)
        opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        after = greedy_normalised_cost(policy(keys, keys, pos, n), c).mean().item()
    assert after < before and after < 1.0 + 0.5 * (before - 1.0), (before, after)


def test_middle_excludes_protected_tokens():
    assert middle(100) == slice(4, 84)
    with pytest.raises(ValueError):
        middle(20)
