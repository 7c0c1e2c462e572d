"""Every scoring rule through the one interface, plus each baseline's formula on a hand-made case."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvp_vllm.policy import KVPPolicy, ModelShape
from kvp_vllm.scorers import SCORERS, LayerKV, make_scorer
from kvp_vllm.selection import select_topb


def build(name, kv_heads, head_dim, layers=2):
    if name == "kvp":
        return make_scorer("kvp", policy=KVPPolicy.random_init(ModelShape(layers, kv_heads, head_dim), seed=1))
    return make_scorer(name)


def random_kv(kv_heads, group, t, d, dtype, seed=0, layer=1, window=64):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return LayerKV(keys=rnd(kv_heads, t, d), values=rnd(kv_heads, t, d), positions=torch.arange(t),
                   queries=rnd(kv_heads * group, min(window, t), d),
                   future_importance=torch.rand(kv_heads, t, generator=g), layer=layer)


def test_registry_has_every_rule():
    assert set(SCORERS) == {"kvp", "streaming", "tova", "snapkv", "lagkv", "keydiff", "knorm", "random", "oracle"}
    with pytest.raises(ValueError, match="unknown eviction rule 'h2o'"):
        make_scorer("h2o")


@pytest.mark.parametrize("name", sorted(SCORERS))
@pytest.mark.parametrize("kv_heads,group,t,d", [(1, 1, 23, 16), (2, 4, 300, 64), (4, 7, 517, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rule_matrix(name, kv_heads, group, t, d, dtype):
    scorer = build(name, kv_heads, d)
    kv = random_kv(kv_heads, group, t, d, dtype)
    scores = scorer.score(kv)
    assert scores.shape == (kv_heads, t)
    assert scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    assert torch.equal(scores, scorer.score(kv)), "scores must be deterministic"
    for budget in (20, 57, t - 1, t + 5):
        kept = select_topb(scores, budget)
        b = min(budget, t)
        assert kept.shape == (kv_heads, b), "exactly b tokens per head"
        assert (kept[:, 1:] > kept[:, :-1]).all(), "ascending, no duplicates"
        for h in range(kv_heads):
            s = set(kept[h].tolist())
            assert set(range(min(4, t))) <= s and set(range(max(t - 16, 0), t)) <= s


def hand_kv(keys, values=None, queries=None, importance=None):
    keys = torch.tensor(keys, dtype=torch.float32)
    values = keys.clone() if values is None else torch.tensor(values, dtype=torch.float32)
    return LayerKV(keys=keys, values=values, positions=torch.arange(keys.shape[1]),
                   queries=None if queries is None else torch.tensor(queries, dtype=torch.float32),
                   future_importance=importance)


def test_knorm_keeps_low_norm_keys():
    kv = hand_kv([[[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [1.0, 0.0]]])
    assert torch.allclose(make_scorer("knorm").score(kv), torch.tensor([[-5.0, -1.0, -10.0, -1.0]]))


def test_streaming_keeps_sinks_then_most_recent():
    kv = hand_kv([[[1.0]] * 40])
    kept = select_topb(make_scorer("streaming").score(kv), 25, n_sink=0, n_recent=0)
    assert kept[0].tolist() == [0, 1, 2, 3] + list(range(19, 40))


def test_keydiff_is_negative_cosine_to_mean_direction():
    keys = [[[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]]]
    anchor = torch.tensor([(1 + 1 + 0) / 3, (0 + 0 + 1) / 3])
    expected = [-F.cosine_similarity(torch.tensor(k), anchor, dim=0).item() for k in keys[0]]
    got = make_scorer("keydiff").score(hand_kv(keys))[0]
    assert torch.allclose(got, torch.tensor(expected))
    assert got[2] > got[0], "the key unlike the others scores higher"


def test_tova_uses_last_query_averaged_over_group():
    keys = [[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]
    # two query heads in the group; the first query row is ignored (only the last one counts)
    queries = [[[9.0, 9.0], [2.0, 0.0]], [[9.0, 9.0], [0.0, 2.0]]]
    got = make_scorer("tova").score(hand_kv(keys, queries=queries))[0]
    s = 2 / math.sqrt(2)
    head0 = torch.softmax(torch.tensor([s, 0.0, 0.0]), 0)
    head1 = torch.softmax(torch.tensor([0.0, s, 0.0]), 0)
    assert torch.allclose(got, (head0 + head1) / 2, atol=1e-6)


def test_snapkv_pools_window_votes_and_keeps_window():
    t, w = 12, 3
    torch.manual_seed(0)
    keys = torch.randn(1, t, 4)
    queries = torch.randn(2, w, 4)
    kv = LayerKV(keys=keys, values=keys, positions=torch.arange(t), queries=queries)
    got = make_scorer("snapkv", window=w, kernel_size=3).score(kv)[0]
    # by hand: causal softmax of each window query over the keys, mean over the window, pool, mean over group
    votes = []
    for head in range(2):
        rows = []
        for i in range(w):
            pos = t - w + i
            logits = keys[0] @ queries[head, i] / 2.0
            logits[pos + 1:] = float("-inf")
            rows.append(torch.softmax(logits, 0))
        v = torch.stack(rows).mean(0)
        pooled = torch.stack([v[max(j - 1, 0):j + 2].mean() for j in range(t)])
        votes.append(pooled)
    expected = torch.stack(votes).mean(0)
    assert torch.allclose(got[: t - w], expected[: t - w], atol=1e-6)
    assert (got[t - w:] > got[: t - w].max()).all(), "the observation window is always kept"


def test_lagkv_normalises_each_chunk_by_the_next():
    lag, sinks, d = 4, 2, 3
    torch.manual_seed(0)
    t = sinks + 3 * lag + 1  # two scored chunks, a reference-only chunk, one tail token
    keys, values = torch.randn(1, t, d), torch.randn(1, t, d)
    kv = LayerKV(keys=keys, values=values, positions=torch.arange(t))
    got = make_scorer("lagkv", lag=lag, sinks=sinks).score(kv)[0]

    def part(x, c):
        cur = x[0, sinks + c * lag: sinks + (c + 1) * lag]
        ref = x[0, sinks + (c + 1) * lag: sinks + (c + 2) * lag]
        lo, hi = ref.min(0).values, ref.max(0).values
        return torch.softmax(((cur - lo) / (hi - lo)).std(-1), 0)

    for c in range(2):
        expected = part(keys, c) + part(values, c)
        assert torch.allclose(got[sinks + c * lag: sinks + (c + 1) * lag], expected, atol=1e-5)
    kept_always = torch.cat([got[:sinks], got[sinks + 2 * lag:]])
    assert (kept_always > 2.0).all(), "sinks, the reference-only chunk and the tail are always kept"


def test_random_is_seeded():
    kv = random_kv(2, 1, 50, 8, torch.float32)
    a, b = make_scorer("random", seed=3).score(kv), make_scorer("random", seed=4).score(kv)
    assert torch.equal(a, make_scorer("random", seed=3).score(kv)) and not torch.equal(a, b)


def test_oracle_is_the_future_importance_and_needs_it():
    kv = random_kv(2, 1, 30, 8, torch.float32)
    assert torch.equal(make_scorer("oracle").score(kv), kv.future_importance)
    kv.future_importance = None
    with pytest.raises(ValueError, match="future_importance"):
        make_scorer("oracle").score(kv)


def test_query_aware_rules_refuse_missing_queries():
    kv = random_kv(2, 1, 30, 8, torch.float32)
    kv.queries = None
    for name in ("tova", "snapkv"):
        with pytest.raises(ValueError, match="needs the last queries"):
            make_scorer(name).score(kv)


def test_layerkv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="kv_heads, T, head_dim"):
        LayerKV(keys=torch.zeros(2, 5, 4), values=torch.zeros(2, 6, 4), positions=torch.arange(5))
    with pytest.raises(ValueError, match="not a multiple"):
        LayerKV(keys=torch.zeros(2, 5, 4), values=torch.zeros(2, 5, 4), positions=torch.arange(5),
                queries=torch.zeros(3, 2, 4))
