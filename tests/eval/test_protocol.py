"""Protocol: keep-all reproduces the full cache token for token; compaction keeps exactly b entries per
head; positions of later tokens unchanged; the teacher-forced shortcut equals plain greedy decoding."""

import pytest
import torch

from kvp_vllm.assets import tiny_model
from kvp_vllm.eval import protocol as P
from kvp_vllm.scorers import make_scorer

EOS = {-1}  # never produced: decode the full max_new


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama", seed=0)


def _prompt(n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


def _hf_greedy(model, ids, max_new):
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, min_new_tokens=max_new)
    return out[0, len(ids):].tolist()


def test_full_answer_matches_hf_generate(model):
    ids = _prompt()
    pre = P.prefill(model, ids, n_context=60, window=8)
    assert pre.cache_len("query_aware") == 79 and pre.cache_len("query_agnostic") == 60
    answer = P.full_answer(model, pre, 12, EOS)
    assert answer == _hf_greedy(model, ids, 12)


@pytest.mark.parametrize("protocol", P.PROTOCOLS)
def test_keep_all_reproduces_full(model, protocol):
    ids = _prompt(seed=1)
    pre = P.prefill(model, ids, n_context=50, window=8)
    answer = P.full_answer(model, pre, 10, EOS)
    t = pre.cache_len(protocol)
    scores = P.rule_scores(make_scorer("knorm"), pre, protocol)
    for budget in (t, t + 100, 1.0):
        b = P.resolve_budget(budget, t)
        kept = P.kept_indices(scores, b)
        assert all(k.shape == (2, t) for k in kept)
        layers = P.compacted_layers(pre, protocol, kept)
        out = P.evaluate_caches(model, pre, protocol, [layers], answer, answer, 10, EOS)[0]
        assert out.tokens == answer and out.agree == len(answer)


@pytest.mark.parametrize("rule", ["knorm", "snapkv", "random", "streaming"])
def test_compaction_keeps_b_per_head(model, rule):
    ids = _prompt(seed=2)
    pre = P.prefill(model, ids, n_context=60, window=8)
    for protocol in P.PROTOCOLS:
        scores = P.rule_scores(make_scorer(rule), pre, protocol)
        kept = P.kept_indices(scores, 24)
        layers = P.compacted_layers(pre, protocol, kept)
        for (k, v), idx, full_k in zip(layers, kept, pre.keys):
            assert k.shape == (1, 2, 24, 16) and v.shape == k.shape
            for h in range(2):
                assert len(set(idx[h].tolist())) == 24
                assert torch.equal(k[0, h], full_k[h, idx[h]])  # a physical gather, per head
        # a fraction of the context resolves against that protocol's cache length
        assert P.resolve_budget(0.5, pre.cache_len(protocol)) == round(0.5 * pre.cache_len(protocol))


def test_positions_preserved_against_masked_reference(model):
    """After eviction, later tokens keep their logical positions: the compacted cache gives the same
    logits as the uncompressed sequence with the evicted entries masked out for those tokens."""
    ids = _prompt(n=70, seed=3)
    n_ctx, cont = 50, 20
    pre = P.prefill(model, ids[:n_ctx + 1], n_context=n_ctx, window=8)
    scores = P.rule_scores(make_scorer("streaming"), pre, "query_agnostic")  # same set for every head
    kept = P.kept_indices(scores, 24)
    assert all(torch.equal(k[0], k[1]) for k in kept)
    layers = P.compacted_layers(pre, "query_agnostic", kept)
    x = torch.tensor([ids[n_ctx:]])
    with torch.no_grad():
        got = model(input_ids=x, past_key_values=P._cache(layers),
                    position_ids=torch.arange(n_ctx, 70)[None]).logits[0]
        wrong = model(input_ids=x, past_key_values=P._cache(layers),
                      position_ids=torch.arange(24, 24 + cont)[None]).logits[0]
        allowed = torch.ones(70, 70, dtype=torch.bool).tril()
        evicted = torch.ones(n_ctx, dtype=torch.bool)
        evicted[kept[0][0]] = False
        allowed[n_ctx:, :n_ctx] &= ~evicted
        mask = torch.zeros(70, 70).masked_fill(~allowed, torch.finfo(torch.float32).min)
        ref = model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None]).logits[0, n_ctx:]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    # the check has teeth: shifted positions change the logits far beyond the tolerance
    assert (wrong - ref).abs().max() > 1e-3 > 10 * (got - ref).abs().max()


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("protocol", P.PROTOCOLS)
def test_batched_equals_plain_greedy(model, protocol, pad):
    """All rules and budgets in one padded batch give exactly the output of plain greedy decoding
    on each compacted cache alone, and the gold log-likelihood of teacher forcing on it alone."""
    ids = _prompt(n=90, seed=4)
    pre = P.prefill(model, ids, n_context=70, window=8)
    answer = P.full_answer(model, pre, 10, EOS)
    gold = _prompt(n=6, seed=5)
    start = pre.cache_len(protocol)
    rest = pre.rest_ids(protocol)
    layers = [P.compacted_layers(pre, protocol, P.kept_indices(
        P.rule_scores(make_scorer(r), pre, protocol), b))
        for r in ("knorm", "random", "streaming", "snapkv") for b in (20, 33, 47)]
    outs = P.evaluate_caches(model, pre, protocol, layers, answer, gold, 10, EOS, max_batch=7, pad=pad)
    for lay, out in zip(layers, outs):
        plain = P.greedy(model, P._cache(lay), rest[None], start, 10, EOS)
        assert out.tokens == plain
        assert out.agree == next((i for i, (a, b) in enumerate(zip(plain, answer)) if a != b), len(plain))
        with torch.no_grad():
            x = torch.cat([rest, torch.tensor(gold[:-1])])[None]
            lg = model(input_ids=x, past_key_values=P._cache(lay),
                       position_ids=torch.arange(start, start + x.shape[1])[None]).logits[0]
            lp = torch.log_softmax(lg[-len(gold):], -1)[torch.arange(len(gold)), torch.tensor(gold)]
        assert abs(float(lp.sum()) - out.gold_logprob) < 1e-3


def test_oracle_importance_shapes(model):
    ids = _prompt(seed=6)
    pre = P.prefill(model, ids, n_context=60, window=8)
    answer = P.full_answer(model, pre, 5, EOS)
    fut = P.oracle_importance(model, pre, answer)
    assert fut["query_agnostic"][0].shape == (2, 60)
    assert fut["query_aware"][0].shape == (2, 79)
    # each future query spreads one unit of attention (max over the group >= mean): mass is positive
    assert all(float(c.sum()) > 0 for c in fut["query_aware"])
    s = P.rule_scores(make_scorer("oracle"), pre, "query_aware", fut["query_aware"])
    assert torch.equal(s[0], fut["query_aware"][0])


def test_bad_budget():
    with pytest.raises(ValueError):
        P.resolve_budget(0, 100)
    with pytest.raises(ValueError):
        P.resolve_budget(1.5, 100)


def test_two_chunk_prefill_equals_one_pass(model):
    """The shared prefill (context, then the question) leaves the same keys, values and last-window
    queries as one forward over prompt[:-1] - for both protocols' views."""
    from kvp_vllm.capture import forward_capture

    ids = _prompt(n=70, seed=7)
    pre = P.prefill(model, ids, n_context=60, window=16)
    one = forward_capture(model, torch.tensor([ids[:-1]]), query_last=16)
    ctx = forward_capture(model, torch.tensor([ids[:60]]), query_last=16)
    for l in range(len(pre.keys)):
        assert torch.allclose(pre.keys[l], one.keys[l], atol=1e-5)
        assert torch.allclose(pre.values[l], one.values[l], atol=1e-5)
        assert pre.q_aware[l].shape == one.queries[l].shape == (4, 16, 16)
        assert torch.allclose(pre.q_aware[l], one.queries[l], atol=1e-5)
        assert torch.allclose(pre.q_context[l], ctx.queries[l], atol=1e-5)


def test_protect_modes_in_the_harness():
    """--protect paper keeps 4 sinks + 16 recent tokens whatever the rule says; none keeps the rule's
    own top-b, and the minimum budget falls from 20 to 1."""
    scores = [torch.arange(40, dtype=torch.float32).flip(0).expand(2, 40)]  # prefers the oldest tokens
    assert P.kept_indices(scores, 24)[0][0].tolist() == list(range(8)) + list(range(24, 40))
    assert P.kept_indices(scores, 24, "paper")[0][0].tolist() == list(range(8)) + list(range(24, 40))
    assert P.kept_indices(scores, 8, "none")[0][0].tolist() == list(range(8))
    assert P.resolve_budget(5, 100) == 20 and P.resolve_budget(5, 100, "none") == 5
    with pytest.raises(ValueError, match="unknown protect mode"):
        P.kept_indices(scores, 8, "some")
