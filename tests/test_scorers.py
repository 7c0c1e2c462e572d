"""Every scoring rule through the one interface, plus each baseline's formula on a hand-made case."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvp_vllm.policy import KVPPolicy, ModelShape
from kvp_vllm.scorers import SCORERS, LayerKV, Rope, make_scorer
from kvp_vllm.selection import select_topb


def build(name, kv_heads, head_dim, layers=2):
    if name == "kvp":
        return make_scorer("kvp", policy=KVPPolicy.random_init(ModelShape(layers, kv_heads, head_dim), seed=1))
    return make_scorer(name)


def default_rope(d, theta=10000.0):
    return Rope(1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def random_kv(kv_heads, group, t, d, dtype, seed=0, layer=1, window=64):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return LayerKV(keys=rnd(kv_heads, t, d), values=rnd(kv_heads, t, d), positions=torch.arange(t),
                   queries=rnd(kv_heads * group, min(window, t), d),
                   future_importance=torch.rand(kv_heads, t, generator=g), layer=layer,
                   rope=default_rope(d), reconstruction=torch.rand(kv_heads, t, generator=g))


def test_registry_has_every_rule():
    assert set(SCORERS) == {"kvp", "streaming", "tova", "snapkv", "lagkv", "keydiff", "knorm", "random", "oracle",
                            "expected_attention", "kvzip"}
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
    for budget in (1, 7, t - 1):  # --protect none: the rule's own top-b
        kept = select_topb(scores, budget, n_sink=0, n_recent=0)
        assert kept.shape == (kv_heads, min(budget, t)) and (kept[:, 1:] > kept[:, :-1]).all()
        top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :budget]
        assert torch.equal(kept, top.sort(dim=1).values)


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


# --- kvpress 0.5 (NVIDIA/kvpress v0.5.4, kvpress/presses/*_press.py), transcribed line by line on
# [batch, heads, tokens, dim] tensors: the expected results of the faithful baselines.


def _kvpress_repeat_kv(x, n_rep):  # transformers' repeat_kv
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _kvpress_window_attention(query_states, keys, window_size):  # SnapKVPress.compute_window_attention
    k_len, head_dim = keys.shape[2], query_states.shape[-1]
    key_states = _kvpress_repeat_kv(keys, query_states.shape[1] // keys.shape[1])
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attention_mask = torch.ones_like(attn_weights) * float("-inf")
    attention_mask = torch.triu(attention_mask, diagonal=k_len - window_size + 1)
    attn_weights += attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)
    return attn_weights[..., :-window_size]


def kvpress_tova(keys, queries):  # TOVAPress.score
    attn_weights = _kvpress_window_attention(queries[:, :, -1:], keys, 1)
    scores = attn_weights.mean(1)
    scores = scores.repeat(1, keys.shape[1], 1)
    return F.pad(scores, (0, 1), value=scores.max().item() + 1)


def kvpress_snapkv(keys, queries, window_size=64, kernel_size=5):  # SnapKVPress.score
    bsz, num_key_value_heads, k_len, _ = keys.shape
    groups = queries.shape[1] // num_key_value_heads
    attn_weights = _kvpress_window_attention(queries[:, :, -window_size:], keys, window_size)
    scores = attn_weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(bsz, num_key_value_heads, groups, k_len - window_size).mean(2)
    return F.pad(scores, (0, window_size), value=scores.max().item() + 1)


def kvpress_lagkv(keys, values, n_sink=4, lag_size=128, cross_scoring=False):  # LagKVPress.score
    bsz, num_key_value_heads, q_len, d = keys.shape
    if q_len < n_sink + 2 * lag_size:
        score = torch.ones((bsz, num_key_value_heads, q_len), dtype=keys.dtype)
        if q_len > n_sink:
            score[:, :, n_sink:] = (torch.arange(q_len - n_sink) / (q_len - n_sink)).to(keys.dtype)
        return score
    end_idx = n_sink + ((q_len - n_sink) // lag_size) * lag_size
    tail_len = lag_size + q_len - end_idx

    def states_score(target_v):  # LagKVPress._get_states_score
        ref, v = target_v[:, :, 1:, :, :], target_v[:, :, :-1, :, :]
        min_r = ref.min(dim=-2).values.unsqueeze(-2).expand(-1, -1, -1, lag_size, -1)
        max_r = ref.max(dim=-2).values.unsqueeze(-2).expand(-1, -1, -1, lag_size, -1)
        return ((v - min_r) / (max_r - min_r)).std(dim=-1).softmax(dim=-1)

    key_score = states_score(keys[:, :, n_sink:end_idx].view(bsz, num_key_value_heads, -1, lag_size, d))
    value_score = states_score(values[:, :, n_sink:end_idx].view(bsz, num_key_value_heads, -1, lag_size, d))
    score = (key_score + value_score) / 2
    if not cross_scoring:
        score = score.argsort(dim=-1).argsort(dim=-1) / lag_size
    sink_score = torch.ones((bsz, num_key_value_heads, n_sink), dtype=score.dtype)
    tail_score = torch.ones((bsz, num_key_value_heads, tail_len), dtype=score.dtype)
    return torch.cat((sink_score, score.reshape(bsz, num_key_value_heads, -1), tail_score), dim=-1)


def kvpress_kept(scores, n_kept):  # ScorerPress.compress: scores.topk(n_kept); as sorted indices
    return scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values


def _keep(scores, budget):  # --protect none: the rule's own choice
    return select_topb(scores, budget, n_sink=0, n_recent=0)


def test_tova_averages_all_query_heads_like_kvpress():
    """Two KV heads, one query head each. Head 0's last query looks hard at token 1, head 1's mildly at
    token 2. kvpress averages all query heads: both KV heads keep token 1 (and the query's own token
    4); the v1 option (per KV group) lets head 1 keep token 2."""
    keys = [[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]] * 2
    queries = [[[9.0, 9.0], [6.0, 0.0]], [[9.0, 9.0], [0.0, 1.0]]]  # only the last row counts
    kv = hand_kv(keys, queries=queries)
    ref = kvpress_tova(kv.keys[None], kv.queries[None])[0]
    got = make_scorer("tova").score(kv)
    assert torch.allclose(got, ref, atol=1e-6)
    assert torch.equal(got[0], got[1]), "one set for every KV head"
    assert _keep(got, 2).tolist() == kvpress_kept(ref, 2).tolist() == [[1, 4], [1, 4]]
    assert _keep(make_scorer("tova", per_kv_group=True).score(kv), 2).tolist() == [[1, 4], [2, 4]]


def test_tova_per_kv_group_option_is_v1():
    """per_kv_group=True: each KV head averages its own GQA group (the definition before v2)."""
    keys = [[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]
    queries = [[[9.0, 9.0], [2.0, 0.0]], [[9.0, 9.0], [0.0, 2.0]]]
    got = make_scorer("tova", per_kv_group=True).score(hand_kv(keys, queries=queries))[0]
    s = 2 / math.sqrt(2)
    head0 = torch.softmax(torch.tensor([s, 0.0, 0.0]), 0)
    head1 = torch.softmax(torch.tensor([0.0, s, 0.0]), 0)
    expected = (head0 + head1) / 2
    assert torch.allclose(got[:2], expected[:2], atol=1e-6)
    assert got[2] == expected[:2].max() + 1, "the query's own token is lifted (kvpress)"


# the window (3 tokens) attends strongly to itself; a needle at token 4 with a few distinct neighbours
SNAP_BOUNDARY = [[[x, 0.0] for x in (0.3, 0.1, 0.2, 0.4, 2.0, 1.0, 0.5, 0.05, 0.15)] + [[3.0, 0.0]] * 3]
# token 0 draws the window's attention (a sink); no window self-attention
SNAP_EDGE = [[[x, 0.0] for x in (3.0, 0.1, 0.2, 0.4, 0.3, 0.5, 0.25, 0.05, 0.15)] + [[0.0, 0.0]] * 3]


@pytest.mark.parametrize("keys, kvpress_choice, option, option_choice", [
    # pooling across the boundary pulls the window's votes into token 8, next to it
    (SNAP_BOUNDARY, 4, {"pool_across_window": True}, 8),
    # leaving the zero padding out of the average lifts the first tokens (token 0: 3 terms / 3, not / 5)
    (SNAP_EDGE, 2, {"count_include_pad": False}, 0),
])
def test_snapkv_pools_the_prefix_only_padding_counted_like_kvpress(keys, kvpress_choice, option, option_choice):
    w = 3
    kv = hand_kv(keys, queries=[[[3.0, 0.0]] * w])
    ref = kvpress_snapkv(kv.keys[None], kv.queries[None], window_size=w)[0]
    got = make_scorer("snapkv", window=w).score(kv)
    assert torch.allclose(got, ref, atol=1e-6)
    kept = kvpress_kept(ref, w + 1)
    assert _keep(got, w + 1).tolist() == kept.tolist() == [[kvpress_choice, 9, 10, 11]]
    assert _keep(make_scorer("snapkv", window=w, **option).score(kv), w + 1).tolist() == \
        [[option_choice, 9, 10, 11]]
    v1 = make_scorer("snapkv", window=w, pool_across_window=True, count_include_pad=False)
    assert _keep(v1.score(kv), w + 1).tolist() == [[option_choice, 9, 10, 11]]


def test_snapkv_v1_options_pool_every_token_without_padding():
    """pool_across_window=True, count_include_pad=False: the definition before v2, by hand."""
    t, w = 12, 3
    torch.manual_seed(0)
    keys = torch.randn(1, t, 4)
    queries = torch.randn(2, w, 4)
    kv = LayerKV(keys=keys, values=keys, positions=torch.arange(t), queries=queries)
    got = make_scorer("snapkv", window=w, kernel_size=3, pool_across_window=True,
                      count_include_pad=False).score(kv)[0]
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
    assert torch.allclose(got[t - w:], 2.0 + expected[t - w:], atol=1e-6), "window ranked by its votes"


@pytest.mark.parametrize("t, window", [(40, 5), (40, 1), (9, 64)])
def test_snapkv_matches_kvpress_on_random_gqa_inputs(t, window):
    g = torch.Generator().manual_seed(t + window)
    keys, queries = torch.randn(2, t, 8, generator=g), torch.randn(6, min(window, t), 8, generator=g)
    kv = LayerKV(keys=keys, values=keys, positions=torch.arange(t), queries=queries)
    got = make_scorer("snapkv", window=window).score(kv)
    if t <= window:  # kvpress refuses (its assert); the whole cache is the window: everything ties
        assert torch.equal(got, torch.ones(2, t))
        return
    assert torch.allclose(got, kvpress_snapkv(keys[None], queries[None], window)[0], atol=1e-6)
    assert torch.allclose(make_scorer("tova").score(kv), kvpress_tova(keys[None], queries[None])[0], atol=1e-6)


# lag 4, 1 sink; partition 0 (tokens 1-4) mildly spread; partition 1 (5-8) two widely spread tokens;
# partition 2 (9-12, the reference of partition 1) spans [0, 1] per channel
LAG_KEYS = [[[0.0, 0.0, 0.0, 0.0],
             [0.4, 0.5, 0.6, 0.5], [0.5, 0.6, 0.5, 0.4], [0.6, 0.5, 0.4, 0.5], [0.5, 0.4, 0.5, 0.6],
             [1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.9], [0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.6],
             [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.2, 0.8, 0.3, 0.7], [0.9, 0.1, 0.6, 0.4]]]


def test_lagkv_ranks_within_each_partition_like_kvpress():
    """kvpress's default keeps the best token of each partition; cross_scoring=True (v1) keeps the two
    spread tokens of partition 1."""
    kv = hand_kv(LAG_KEYS)
    ref = kvpress_lagkv(kv.keys[None], kv.values[None], n_sink=1, lag_size=4)[0]
    got = make_scorer("lagkv", lag=4, sinks=1).score(kv)
    assert torch.allclose(got, ref, atol=1e-6)
    sinks_and_tail = [0, 9, 10, 11, 12]
    assert _keep(got, 7).tolist() == kvpress_kept(ref, 7).tolist() == [sorted(sinks_and_tail + [4, 5])]
    cross = make_scorer("lagkv", lag=4, sinks=1, cross_scoring=True).score(kv)
    ref_cross = kvpress_lagkv(kv.keys[None], kv.values[None], n_sink=1, lag_size=4, cross_scoring=True)[0]
    assert torch.allclose(cross, ref_cross, atol=1e-6)
    assert _keep(cross, 7).tolist() == [sorted(sinks_and_tail + [5, 6])]


def test_lagkv_cross_scoring_normalises_each_chunk_by_the_next():
    lag, sinks, d = 4, 2, 3
    torch.manual_seed(0)
    t = sinks + 3 * lag + 1  # two scored chunks, a reference-only chunk, one tail token
    keys, values = torch.randn(1, t, d), torch.randn(1, t, d)
    kv = LayerKV(keys=keys, values=values, positions=torch.arange(t))
    got = make_scorer("lagkv", lag=lag, sinks=sinks, cross_scoring=True).score(kv)[0]

    def part(x, c):
        cur = x[0, sinks + c * lag: sinks + (c + 1) * lag]
        ref = x[0, sinks + (c + 1) * lag: sinks + (c + 2) * lag]
        lo, hi = ref.min(0).values, ref.max(0).values
        return torch.softmax(((cur - lo) / (hi - lo)).std(-1), 0)

    for c in range(2):
        expected = (part(keys, c) + part(values, c)) / 2
        assert torch.allclose(got[sinks + c * lag: sinks + (c + 1) * lag], expected, atol=1e-5)
    kept_always = torch.cat([got[:sinks], got[sinks + 2 * lag:]])
    assert (kept_always == 1.0).all(), "sinks, the reference-only chunk and the tail are always kept"
    assert (got[sinks:sinks + 2 * lag] < 1.0).all()


@pytest.mark.parametrize("t", [3, 10, 40, 41, 47, 300])
def test_lagkv_matches_kvpress_on_random_inputs(t):
    g = torch.Generator().manual_seed(t)
    keys, values = torch.randn(2, t, 8, generator=g), torch.randn(2, t, 8, generator=g)
    kv = LayerKV(keys=keys, values=values, positions=torch.arange(t))
    for cross in (False, True):
        ref = kvpress_lagkv(keys[None], values[None], n_sink=4, lag_size=8, cross_scoring=cross)[0]
        got = make_scorer("lagkv", lag=8, sinks=4, cross_scoring=cross).score(kv)
        assert torch.allclose(got, ref, atol=1e-6), (t, cross)


def test_lagkv_short_cache_keeps_sinks_then_recent():
    """Shorter than sinks + 2 lags: no partition has a reference; kvpress keeps sinks, then recency."""
    kv = hand_kv([[[float(i % 3), 1.0] for i in range(19)]])  # 19 < 4 + 2 * 8
    got = make_scorer("lagkv", lag=8, sinks=4).score(kv)
    assert _keep(got, 10).tolist() == [[0, 1, 2, 3, 13, 14, 15, 16, 17, 18]]


def test_definitions_are_versioned():
    """Rows record `definition`: bumped for the rules made faithful to kvpress, with options named."""
    v2 = {"tova", "snapkv", "lagkv"}
    for name, cls in SCORERS.items():
        assert cls.default_definition() == ("v2" if name in v2 else "v1"), name
    assert make_scorer("tova").definition == "v2"
    assert make_scorer("tova", per_kv_group=True).definition == "v2,per_kv_group=True"
    assert make_scorer("snapkv", pool_across_window=True, count_include_pad=False).definition == \
        "v2,pool_across_window=True,count_include_pad=False"
    assert make_scorer("lagkv", cross_scoring=True).definition == "v2,cross_scoring=True"
    assert make_scorer("random", seed=7).definition == "v1", "the per-sample seed is not an option"
    assert build("kvp", 2, 8).definition == "v1", "the weights are identified by their sha256"


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


# --- Expected Attention: kvpress 0.5 ExpectedAttentionPress (v0.5.4,
# kvpress/presses/expected_attention_press.py; get_prerope_query_states from kvpress/utils.py), transcribed
# line by line. `module` is a Llama attention stand-in: config, head_dim, q_proj and the model's
# rotary_emb (kvpress sets `layer.self_attn.rotary_emb = model.model.rotary_emb`).

def kvpress_expected_attention(module, hidden_states, keys, values, n_future_positions=512, n_sink=4,
                               use_covariance=True, use_vnorm=True, epsilon=0.0):
    # ExpectedAttentionPress.score
    assert keys.size(2) > n_sink
    keys = keys[:, :, n_sink:]
    values = values[:, :, n_sink:]
    # get_query_statistics
    q_len = hidden_states.shape[1]
    h = hidden_states[:, n_sink:]
    bsz, hq_len, _ = h.shape  # get_prerope_query_states (Llama-like)
    query_states = module.q_proj(h).view(bsz, hq_len, module.config.num_attention_heads,
                                         module.head_dim).transpose(1, 2)
    mu = query_states.mean(dim=2, keepdim=True)
    cov = None
    if use_covariance:
        centered_states = query_states - mu
        cov = torch.einsum("bnsi,bnsj->bnij", centered_states, centered_states) / h.shape[1]
    mu = mu.squeeze(2)
    # apply_avg_rope
    position_ids = torch.arange(q_len, q_len + n_future_positions).unsqueeze(0)
    head_dim = module.head_dim
    cos, sin = module.rotary_emb(mu, position_ids)
    cos, sin = cos[0], sin[0]
    Id = torch.eye(head_dim, dtype=cos.dtype)
    P = torch.zeros((head_dim, head_dim), dtype=cos.dtype)
    P[head_dim // 2:, : head_dim // 2], P[: head_dim // 2, head_dim // 2:] = torch.eye(head_dim // 2), -torch.eye(
        head_dim // 2)
    R = cos.unsqueeze(1) * Id + sin.unsqueeze(1) * P
    R = R.mean(dim=0)
    mean_query = torch.matmul(mu, R.T)
    cov_query = torch.matmul(R, torch.matmul(cov, R.T)) if cov is not None else None
    # score (continued)
    bsz, num_key_value_heads, q_len, d = keys.shape
    num_key_value_groups = module.config.num_attention_heads // num_key_value_heads
    keys = _kvpress_repeat_kv(keys, num_key_value_groups).transpose(2, 3)
    scores = torch.matmul(mean_query.unsqueeze(2), keys).squeeze(2) / math.sqrt(d)
    if use_covariance:
        scores += torch.einsum("bhin, bhij, bhjn->bhn", keys, cov_query, keys) / d / 2
    scores = F.softmax(scores, dim=-1)
    scores = scores.view(bsz, num_key_value_heads, num_key_value_groups, q_len)
    scores = scores.mean(dim=2)
    if use_vnorm:
        scores = (scores + epsilon) * values.norm(dim=-1)
    scores = F.pad(scores, (n_sink, 0), value=scores.max().item() + 1)
    return scores


def _ea_case(t, kv_heads=2, group=3, d=16, rope_parameters=None, seed=0):
    """A random Llama attention stand-in, hidden states and cache; our LayerKV holds the post-RoPE
    queries of every token (transformers' own rotary embedding and apply_rotary_pos_emb)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from kvp_vllm.capture import _rope_of

    hq = kv_heads * group
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=kv_heads, head_dim=d,
                      max_position_embeddings=4096,
                      rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(seed)
    module = SimpleNamespace(config=cfg, head_dim=d, rotary_emb=LlamaRotaryEmbedding(cfg),
                             q_proj=torch.nn.Linear(hq * d, hq * d, bias=False))
    with torch.no_grad():
        module.q_proj.weight.copy_(torch.randn(hq * d, hq * d, generator=g) / (hq * d) ** 0.5)
        hidden = torch.randn(1, t, hq * d, generator=g)
        keys, values = torch.randn(1, kv_heads, t, d, generator=g), torch.randn(1, kv_heads, t, d, generator=g)
        q = module.q_proj(hidden).view(1, t, hq, d).transpose(1, 2)
        cos, sin = module.rotary_emb(q, torch.arange(t)[None])
        q_post, _ = apply_rotary_pos_emb(q, q, cos, sin)
    kv = LayerKV(keys=keys[0], values=values[0], positions=torch.arange(t), queries=q_post[0],
                 rope=_rope_of(module.rotary_emb, d))
    return module, hidden, keys, values, kv


@pytest.mark.parametrize("t", [5, 40, 300])
@pytest.mark.parametrize("options", [{}, {"use_covariance": False}, {"use_vnorm": False},
                                     {"n_future_positions": 16, "n_sink": 0, "epsilon": 0.01}])
def test_expected_attention_matches_kvpress(t, options):
    module, hidden, keys, values, kv = _ea_case(t)
    with torch.no_grad():
        ref = kvpress_expected_attention(module, hidden, keys, values, **options)[0]
    got = make_scorer("expected_attention", **options).score(kv)
    assert got.shape == ref.shape == (2, t)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-7), (got - ref).abs().max()
    sinks = options.get("n_sink", 4)  # they tie at max + 1: kvpress's topk breaks the tie its own way
    for n in (t // 3, t // 2, t - 1):
        if n >= max(sinks, 1):
            assert torch.equal(_keep(got, n), kvpress_kept(ref, n)), n


def test_expected_attention_with_a_scaled_rope_matches_kvpress():
    """YaRN: transformers scales cos/sin by attention_scaling != 1; un-rotating divides it out and the
    mean rotation keeps it, as kvpress's `module.rotary_emb` output does."""
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
    module, hidden, keys, values, kv = _ea_case(60, rope_parameters=params, seed=3)
    assert kv.rope.attention_scaling != 1.0
    with torch.no_grad():
        ref = kvpress_expected_attention(module, hidden, keys, values)[0]
    got = make_scorer("expected_attention").score(kv)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-7), (got - ref).abs().max()


def test_expected_attention_window_and_later_positions():
    """window=W uses the last W queries only; future positions start after the newest cached token
    (a compacted cache keeps logical positions)."""
    module, hidden, keys, values, kv = _ea_case(50, seed=5)
    w = 20
    with torch.no_grad():  # kvpress on the last W tokens' statistics = sinks dropped from nothing
        ref_stats = make_scorer("expected_attention", window=w).query_statistics(kv)
        q = module.q_proj(hidden[0, -w:]).view(w, 6, 16).transpose(0, 1)
    mu = q.mean(1)
    future = kv.rope.mean_rotation(torch.arange(50, 50 + 512))
    assert torch.allclose(ref_stats[0], mu @ future.T, atol=1e-5)
    # a compacted cache: positions 0..3 then 30..49; the statistics rotate to positions 50..561 still
    keep = torch.cat([torch.arange(4), torch.arange(30, 50)])
    small = LayerKV(keys=kv.keys[:, keep], values=kv.values[:, keep], positions=keep,
                    queries=kv.queries[:, 30:], rope=kv.rope)
    mu_small = make_scorer("expected_attention").query_statistics(small)[0]
    q20 = module.q_proj(hidden[0, 30:]).view(20, 6, 16).transpose(0, 1).detach()
    assert torch.allclose(mu_small, q20.mean(1) @ future.T, atol=1e-5)


def test_expected_attention_needs_rope_and_queries():
    kv = random_kv(2, 2, 30, 8, torch.float32)
    kv.rope = None
    with pytest.raises(ValueError, match="rotary embedding"):
        make_scorer("expected_attention").score(kv)
    kv = random_kv(2, 2, 30, 8, torch.float32)
    kv.queries = None
    with pytest.raises(ValueError, match="needs the last queries"):
        make_scorer("expected_attention").score(kv)
    assert torch.equal(make_scorer("expected_attention").score(random_kv(1, 1, 4, 8, torch.float32)),
                       torch.ones(1, 4)), "a cache of n_sink tokens is kept whole"
    from kvp_vllm.scorers import ALL_QUERIES
    assert make_scorer("expected_attention").query_window == ALL_QUERIES
    assert make_scorer("expected_attention", window=32).query_window == 32


def test_rope_unrotate_inverts_rotate():
    rope = Rope(default_rope(16).inv_freq, attention_scaling=1.3)
    x, pos = torch.randn(3, 7, 16), torch.tensor([0, 5, 9, 100, 4000, 8191, 2])
    assert torch.allclose(rope.unrotate(rope.rotate(x, pos), pos), x, atol=1e-5)
    r = rope.mean_rotation(pos[1:2])
    assert torch.allclose(x[:, 1] @ r.T, rope.rotate(x[:, 1:2], pos[1:2])[:, 0], atol=1e-5)


def test_kvzip_ranks_by_the_reconstruction_attention_and_needs_it():
    kv = random_kv(2, 1, 30, 8, torch.float32)
    assert torch.equal(make_scorer("kvzip").score(kv), kv.reconstruction)
    kv.reconstruction = None
    with pytest.raises(ValueError, match="reconstruction"):
        make_scorer("kvzip").score(kv)
    from kvp_vllm.scorers import BASELINE_RULES, SERVABLE_RULES
    assert "kvzip" not in SERVABLE_RULES and "expected_attention" in BASELINE_RULES
