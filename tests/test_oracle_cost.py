"""The oracle's ranking has the minimal budget-integrated cost among all rules on the same traces,
and the cost helpers agree with brute force on a small case."""

import itertools

import pytest
import torch

from kvp_vllm.assets import tiny_model
from kvp_vllm.capture import forward_capture
from kvp_vllm.importance import future_importance, normalised_cost, oracle_cost, ranking_cost
from kvp_vllm.policy import KVPPolicy, ModelShape
from kvp_vllm.scorers import SCORERS, make_scorer
from kvp_vllm.selection import rank_tokens


def test_oracle_cost_is_brute_force_minimum():
    c = torch.tensor([0.3, 0.05, 0.5, 0.1, 0.05])
    best = min(ranking_cost(torch.tensor(p), c).item() for p in itertools.permutations(range(5)))
    assert oracle_cost(c).item() == pytest.approx(best)
    assert ranking_cost(torch.tensor([2, 0, 3, 1, 4]), c).item() == pytest.approx(best)


def test_future_importance_matches_explicit_attention():
    torch.manual_seed(0)
    keys, queries = torch.randn(2, 10, 8), torch.randn(4, 3, 8)  # 2 KV heads, group 2, 3 answer queries
    c = future_importance(queries, keys, n_prompt=7)
    expected = torch.zeros(2, 7)
    for h in range(2):
        for t in range(3):
            pos = 7 + t
            per_q = [torch.softmax(keys[h, : pos + 1] @ queries[2 * h + g, t] / 8 ** 0.5, 0)[:7] for g in range(2)]
            expected[h] += torch.stack(per_q).amax(0)
    assert torch.allclose(c, expected, atol=1e-6)


def traces(model, n_prompt=90, n_answer=12, samples=3):
    """(prompt capture, importance per layer, prompt ids) from the model's own continuation of random
    prompts."""
    out = []
    for s in range(samples):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, model.config.vocab_size, (1, n_prompt), generator=g)
        answer = torch.randint(0, model.config.vocab_size, (1, n_answer), generator=g)
        full = forward_capture(model, torch.cat([ids, answer], 1), query_last=n_answer)
        prompt = forward_capture(model, ids, query_last=64)
        imp = [future_importance(full.queries[l], full.keys[l], n_prompt) for l in range(len(full.keys))]
        out.append((prompt, imp, ids[0].tolist()))
    return out


def test_oracle_has_minimal_cost_among_all_rules():
    from kvp_vllm.eval.protocol import KVzipPrompts, kvzip_reconstruction

    model = tiny_model("tiny-llama")
    policy = KVPPolicy.random_init(ModelShape.from_hf_config(model.config), seed=0)
    prompts = KVzipPrompts(prefix_length=0, suffix_ids=[7], first_ids=[11, 12, 13], next_ids=[21, 22])
    for prompt, imp, ids in traces(model):
        # KVzip's reconstruction pass (no chat template: the whole prompt is reconstructed)
        recon, _ = kvzip_reconstruction(model, prompt.keys, prompt.values, ids, prompts)
        for layer in range(len(imp)):
            kv = prompt.layer_kv(layer, future_importance=imp[layer])
            kv.reconstruction = recon[layer]
            costs = {}
            for name in SCORERS:
                scorer = make_scorer(name, policy=policy) if name == "kvp" else make_scorer(name)
                costs[name] = normalised_cost(rank_tokens(scorer.score(kv)), imp[layer]).mean().item()
            assert all(costs["oracle"] <= v + 1e-6 for v in costs.values()), costs
            assert costs["oracle"] >= 1.0 - 1e-6
