"""Selection semantics: top-b per head, protected tokens, ties, block-aligned b'."""

import pytest
import torch

from kvp_vllm.selection import (PROTECT_MODES, BudgetError, block_aligned_budget, check_budget, gather_kept,
                                min_budget, protect_mode, protected_counts, rank_tokens, select_topb)


def test_topb_per_head_sorted_and_protected():
    scores = torch.tensor([[0.0] * 4 + [5.0, 1.0, 9.0, 3.0] + [0.0] * 16,
                           [0.0] * 4 + [1.0, 8.0, 2.0, 7.0] + [0.0] * 16])
    kept = select_topb(scores, 22)
    assert kept[0].tolist() == [0, 1, 2, 3, 4, 6] + list(range(8, 24))
    assert kept[1].tolist() == [0, 1, 2, 3, 5, 7] + list(range(8, 24))


def test_ties_prefer_lower_index():
    scores = torch.zeros(1, 40)
    kept = select_topb(scores, 23)
    assert kept[0].tolist() == [0, 1, 2, 3, 4, 5, 6] + list(range(24, 40))


def test_budget_at_least_length_keeps_everything():
    scores = torch.randn(3, 30)
    assert torch.equal(select_topb(scores, 30), torch.arange(30).expand(3, 30))
    assert torch.equal(select_topb(scores, 1000), torch.arange(30).expand(3, 30))


def test_short_sequences_are_all_protected():
    scores = torch.randn(2, 7)
    assert select_topb(scores, 20).shape == (2, 7)


@pytest.mark.parametrize("bad", [-1, 0, 19, 1.5, "64", True, None])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(BudgetError, match="budget"):
        check_budget(bad)


def test_protect_modes():
    """--protect paper = 4 sinks + 16 recent (the KVP paper's protocol), none = nothing protected."""
    assert PROTECT_MODES == {"paper": (4, 16), "none": (0, 0)}
    assert protected_counts() == protected_counts("paper") == (4, 16)
    assert protected_counts("none") == (0, 0)
    assert protect_mode(4, 16) == "paper" and protect_mode(0, 0) == "none" and protect_mode(2, 2) is None
    with pytest.raises(ValueError, match="unknown protect mode 'all'"):
        protected_counts("all")
    assert min_budget(*protected_counts("paper")) == 20 and min_budget(*protected_counts("none")) == 1


def test_budget_validator_follows_the_protect_mode():
    assert check_budget(1, 0, 0) == 1
    with pytest.raises(BudgetError, match="at least 1 tokens; got 0"):
        check_budget(0, 0, 0)
    with pytest.raises(BudgetError, match="at least 20 tokens \\(the 4 sink and 16 recent"):
        check_budget(19)
    with pytest.raises(BudgetError, match="kv_budget must be 0/\"none\" \\(no eviction\\) or at least 20"):
        check_budget(5, what="kv_budget", allow_off=True)
    with pytest.raises(BudgetError, match="exceeds the model's maximum length 100"):
        check_budget(101, maximum=100)


def test_protect_none_is_the_rules_own_choice():
    scores = torch.tensor([[9.0, 0.0, 5.0, 1.0, 7.0, 0.5]])
    assert select_topb(scores, 2, n_sink=0, n_recent=0).tolist() == [[0, 4]]
    assert select_topb(scores, 1, n_sink=0, n_recent=0).tolist() == [[0]]
    assert select_topb(scores, 3, n_sink=1, n_recent=1).tolist() == [[0, 4, 5]]


def test_non_finite_scores_fail_loudly():
    scores = torch.zeros(1, 40)
    scores[0, 10] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        select_topb(scores, 25)


def test_ranking_puts_protected_first():
    ranking = rank_tokens(torch.randn(2, 50))
    for h in range(2):
        assert set(ranking[h, :20].tolist()) == set(range(4)) | set(range(34, 50))


@pytest.mark.parametrize("length,budget,bs", [(399, 100, 32), (100, 100, 32), (50, 100, 16),
                                              (1000, 64, 128), (129, 1, 128), (4096, 1024, 16)])
def test_block_aligned_budget(length, budget, bs):
    b = block_aligned_budget(length, budget, bs)
    if budget >= length:
        assert b == length
    else:
        assert budget <= b < budget + bs and (length - b) % bs == 0


def test_block_aligned_budget_matches_design_example():
    assert block_aligned_budget(399, 100, 32) == 111


def test_gather_kept():
    x = torch.arange(24.0).reshape(2, 4, 3)
    kept = torch.tensor([[0, 2], [1, 3]])
    assert gather_kept(x, kept).tolist() == [[[0, 1, 2], [6, 7, 8]], [[15, 16, 17], [21, 22, 23]]]


@pytest.mark.parametrize("protect", sorted(PROTECT_MODES))
def test_every_consumer_takes_the_minimum_budget_from_here(protect):
    """The harness CLI, the server (start-up flag and per-request field), the kernels and the harness's
    fractional budgets all accept exactly min_budget(protect) and refuse one token less, through
    check_budget: one rule, one place (issue 16)."""
    from kvp_vllm.eval.cli import parse_budgets
    from kvp_vllm.eval.protocol import resolve_budget
    from kvp_vllm.kernels import aligned_counts
    from kvp_vllm.serving.config import EvictionConfig, request_budget

    n_sink, n_recent = protected_counts(protect)
    low = min_budget(n_sink, n_recent)
    cfg = EvictionConfig(rule="knorm", budget=low, n_sink=n_sink, n_recent=n_recent).validate()
    assert cfg.min_budget == low and request_budget({"kv_budget": low}, cfg) == low
    assert parse_budgets(str(low), protect) == [low]
    assert aligned_counts([500], [low], 32, n_sink, n_recent) == [block_aligned_budget(500, low, 32)]
    assert resolve_budget(0.01, 500, protect) == max(5, low)  # a small fraction is lifted to the minimum
    if low - 1 < 1:
        return  # 0 means "no eviction" (server) or is refused as non-positive (harness)
    what = f"at least {low} tokens"
    with pytest.raises(BudgetError, match=what):
        EvictionConfig(rule="knorm", budget=low - 1, n_sink=n_sink, n_recent=n_recent).validate()
    with pytest.raises(BudgetError, match=what):
        request_budget({"kv_budget": low - 1}, cfg)
    with pytest.raises(BudgetError, match=what):
        parse_budgets(str(low - 1), protect)
    with pytest.raises(BudgetError, match=what):
        aligned_counts([500], [low - 1], 32, n_sink, n_recent)
