"""End-to-end tests of `kvp-vllm serve` on the real SmolLM2 (CPU, fp32): one server for the whole
session (see conftest.py), the `openai` client, short generations.

Server: default rule snapkv, budget 64, re-compaction interval 32, block size 32; other rules are
chosen per request with vllm_xargs={"kv_rule": ...}.
"""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from kvp_vllm.scorers import BASELINE_RULES
from serving_helpers import BLOCK, MODEL_NAME, SERVER_BUDGET, SERVER_INTERVAL, SERVER_RULE, metric

pytestmark = pytest.mark.timeout(600)

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NON_LEARNED_RULES = BASELINE_RULES  # every servable rule but KVP, from the scorer registry


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="x", timeout=300, max_retries=0)


def _aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="x", timeout=300, max_retries=0)


def _complete(client, prompt, max_tokens, xargs=None, ignore_eos=True):
    body = {"ignore_eos": ignore_eos}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body=body)


async def _acomplete(client, prompt, max_tokens, xargs=None):
    body = {"ignore_eos": True}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                        temperature=0, extra_body=body)
    return r.choices[0].text


def _free_blocks(server) -> float:
    return metric(server["url"], "kvp_kv_cache_free_blocks")


def _wait_free_blocks(server, value, timeout=30.0) -> float:
    import time

    deadline = time.time() + timeout
    while True:
        now = _free_blocks(server)
        if now == value or time.time() > deadline:
            return now
        time.sleep(0.5)


# -- exactness --------------------------------------------------------------------------------------

def test_budget_at_least_prompt_is_plain_vllm(server):
    client = _client(server)
    prompt = FILLER * 6 + "Say something about the sky."
    compactions = metric(server["url"], "kvp_compactions_total")
    plain = _complete(client, prompt, 24, {"kv_budget": "none"})
    big = _complete(client, prompt, 24, {"kv_budget": 1000})
    assert plain.usage.prompt_tokens + 24 < 1000
    assert big.choices[0].text == plain.choices[0].text
    assert metric(server["url"], "kvp_compactions_total") == compactions  # nothing was evicted


# -- memory really freed ----------------------------------------------------------------------------

def test_blocks_freed_after_prefill_match_the_budget(server):
    client = _client(server)
    url = server["url"]
    prompt = FILLER * 25 + "What colour is the sky?"
    before = {n: metric(url, n) for n in ("kvp_blocks_freed_total", "kvp_tokens_evicted_total")}
    prefill_before = metric(url, "kvp_compactions_total", phase="prefill")
    # max_tokens=2: exactly one decode step, the one that compacts after prefill.
    r = _complete(client, prompt, 2, {"kv_budget": 100})
    L = r.usage.prompt_tokens
    k = (L - 100) // BLOCK
    assert k >= 10
    assert metric(url, "kvp_blocks_freed_total") - before["kvp_blocks_freed_total"] == k
    assert metric(url, "kvp_tokens_evicted_total") - before["kvp_tokens_evicted_total"] == k * BLOCK
    assert metric(url, "kvp_compactions_total", phase="prefill") - prefill_before == 1


def test_blocks_in_use_stay_bounded_during_a_long_generation(server):
    client = _client(server)
    url = server["url"]
    free0 = _wait_free_blocks(server, _free_blocks(server))
    prompt = FILLER * 25 + "Tell me a long story."
    decode_before = metric(url, "kvp_compactions_total", phase="decode")
    new_tokens = 160
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "vllm_xargs": {"kv_budget": SERVER_BUDGET}})
    used = []
    for i, _ in enumerate(stream):
        if i >= 4 and i % 8 == 0:
            used.append(metric(url, "kvp_kv_cache_used_blocks"))
    # Live tokens never exceed budget + interval + one block of alignment (+1 block for the newest).
    bound = -(-(SERVER_BUDGET + SERVER_INTERVAL + BLOCK) // BLOCK) + 1
    assert used and max(used) <= bound, (used, bound)
    assert metric(url, "kvp_compactions_total", phase="decode") - decode_before >= 3
    assert _wait_free_blocks(server, free0) == free0


# -- every rule through the server -----------------------------------------------------------------

def test_every_rule_runs_through_the_server(server):
    url = server["url"]
    prompt = FILLER * 14 + "Which colour is the grass?"
    rules = NON_LEARNED_RULES + ("kvp",)

    async def run():
        client = _aclient(server)
        return await asyncio.gather(*[
            _acomplete(client, prompt, 24, {"kv_budget": SERVER_BUDGET, "kv_rule": r}) for r in rules])

    before = {r: metric(url, "kvp_compactions_total", rule=r) for r in rules}
    texts = asyncio.run(run())
    assert all(isinstance(t, str) and t for t in texts)
    for r in rules:
        # One compaction after prefill and one during decoding (24 new tokens > interval).
        assert metric(url, "kvp_compactions_total", rule=r) - before[r] >= 2, r
        assert metric(url, "kvp_selection_latency_seconds_count", rule=r) >= 2, r
        # the decode-time compaction rescored per-head positions without falling back to recency
        assert metric(url, "kvp_scoring_errors_total", rule=r) == 0, r


def _needle_prompts(n=4, seed=0):
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        before, after = rng.randint(12, 20), rng.randint(16, 24)
        text = (FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key. "
                + FILLER * after + "What is the pass key? The pass key is")
        items.append((text, key))
    return items


def test_needle_recall_kvp_beats_streaming(server):
    """With the shipped SmolLM2 policy (kvp_vllm/checkpoints/SmolLM2-135M-Instruct): README's claim
    "KVP recalls the pass key 4/4, StreamingLLM 0/4 (full cache 4/4)" at budget 128."""
    budget = 128
    items = _needle_prompts()

    async def recall(xargs):
        client = _aclient(server)
        outs = await asyncio.gather(*[
            client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=8, temperature=0,
                                      extra_body={"vllm_xargs": xargs}) for text, _ in items])
        return sum(key in o.choices[0].text for o, (_, key) in zip(outs, items))

    correct = {}
    for rule in ("none", "kvp") + NON_LEARNED_RULES:
        xargs = {"kv_budget": "none"} if rule == "none" else {"kv_budget": budget, "kv_rule": rule}
        correct[rule] = asyncio.run(recall(xargs))
    print(f"needle recall out of {len(items)} at budget {budget}: {correct}")
    assert correct["none"] >= 3, correct  # the task is solvable with the full cache
    assert correct["kvp"] > correct["streaming"], correct
    # KVP's own recall. Measured (fp32, this server; policy v11d, as v11c, v8b and v6): none 4, kvp 4, keydiff 2, knorm 1,
    # tova 1, streaming/lagkv/snapkv/expected_attention/random 0 of 4; README claims 4/4. At least 3 of 4 (one miss of slack for
    # fp32 batch-order drift): a policy that ranks like random (0/4), like the best baseline (2/4) or
    # that evicts the needle fails here.
    assert correct["kvp"] >= len(items) - 1, correct


# -- prefix caching ---------------------------------------------------------------------------------

def test_prefix_sharing_evicted_request_leaves_the_other_intact(server):
    shared = FILLER * 16
    a = shared + "Question A: what colour is the sun?"
    b = shared + "Question B: where do we go?"
    url = server["url"]

    async def pair(xargs_a):
        client = _aclient(server)
        return await asyncio.gather(_acomplete(client, a, 16, xargs_a),
                                    _acomplete(client, b, 16, {"kv_budget": "none"}))

    client = _client(server)
    _complete(client, shared + "Warm the prefix cache.", 1, {"kv_budget": "none"})
    _, ref_b = asyncio.run(pair({"kv_budget": "none"}))
    before = metric(url, "kvp_compactions_total")
    _, got_b = asyncio.run(pair({"kv_budget": SERVER_BUDGET}))
    assert metric(url, "kvp_compactions_total") > before  # request A was evicted
    assert got_b == ref_b
    # And the prefix cache was not corrupted by A's rewrite: B alone, served from the cache.
    solo_b = _complete(client, b, 16, {"kv_budget": "none"}).choices[0].text
    assert solo_b == ref_b


# -- mixed concurrent batch with aborts -------------------------------------------------------------

def test_mixed_batch_with_aborts_is_clean_and_leak_free(server):
    url = server["url"]
    rng = random.Random(1)
    budgets = [None, "none", 0, 32, 64, 128, 200, 20]
    specs = []
    for i in range(18):
        prompt = FILLER * rng.randint(3, 24) + f"Request {i}: continue."
        xargs = None if budgets[i % 8] is None else {"kv_budget": budgets[i % 8]}
        specs.append((prompt, xargs, i % 5 == 4))  # every fifth request is aborted
    free0 = _wait_free_blocks(server, _free_blocks(server))

    async def one(client, prompt, xargs, abort):
        body = {"ignore_eos": True}
        if xargs is not None:
            body["vllm_xargs"] = xargs
        if not abort:
            r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20,
                                                temperature=0, extra_body=body)
            return r.choices[0].text
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=200,
                                                 temperature=0, stream=True, extra_body=body)
        n = 0
        async for _ in stream:
            n += 1
            if n >= 3:
                break
        await stream.close()  # the server aborts the request mid-generation
        return None

    async def batch():
        client = _aclient(server)
        return await asyncio.gather(*[one(client, *s) for s in specs])

    first = asyncio.run(batch())
    assert _wait_free_blocks(server, free0) == free0, "KV blocks leaked"
    second = asyncio.run(batch())
    assert _wait_free_blocks(server, free0) == free0, "KV blocks leaked"
    done = [i for i, s in enumerate(specs) if not s[2]]
    assert len(done) >= 14
    assert all(first[i] for i in done)
    assert [first[i] for i in done] == [second[i] for i in done]
    # The server is still healthy afterwards.
    assert _complete(_client(server), "Hello", 4).choices[0].text


# -- bad inputs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("xargs, needle", [
    ({"kv_budget": -1}, "kv_budget"),
    ({"kv_budget": 1.5}, "integer"),
    ({"kv_budget": "abc"}, "integer"),
    ({"kv_budget": 10 ** 9}, "maximum length"),
    ({"kv_budget": 5}, "at least 20"),
    ({"kv_rule": "oracle"}, "kv_rule"),
    ({"kv_rule": "nope"}, "kv_rule"),
])
def test_bad_request_inputs_are_http_400(server, xargs, needle):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, "Hello", 2, xargs)
    assert err.value.status_code == 400
    assert needle in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"vllm_xargs": xargs})
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2,
                                extra_body={"vllm_xargs": xargs})
    assert needle in str(err.value)
    assert _complete(client, "Hello", 2).choices[0].text is not None  # still serving


def test_responses_endpoint_accepts_a_per_request_budget(server):
    r = _client(server).responses.create(model=MODEL_NAME, input="Say hello.", max_output_tokens=4,
                                         temperature=0, extra_body={"vllm_xargs": {"kv_budget": 64}})
    assert r.output_text


# -- metrics ----------------------------------------------------------------------------------------

def test_metrics_show_the_kvp_series(server):
    url = server["url"]
    client = _client(server)
    _complete(client, FILLER * 10 + "Go on.", 2, {"kv_budget": 32})  # make sure something evicted
    before = metric(url, "kvp_compactions_total")
    chat = client.chat.completions.create(  # the chat API takes the same per-request budget
        model=MODEL_NAME, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": FILLER * 10 + "What colour is the sky?"}],
        extra_body={"vllm_xargs": {"kv_budget": 32}})
    assert chat.choices[0].message.content is not None
    assert metric(url, "kvp_compactions_total") == before + 1
    assert metric(url, "kvp_selection_latency_seconds_count", rule=SERVER_RULE) > 0
    assert metric(url, "kvp_selection_latency_seconds_sum", rule=SERVER_RULE) > 0
    assert metric(url, "kvp_compaction_latency_seconds_count", rule=SERVER_RULE) > 0
    assert metric(url, "kvp_tokens_evicted_total") > 0
    assert metric(url, "kvp_blocks_freed_total") > 0
    assert metric(url, "kvp_retained_fraction_count") > 0
    assert 0 < metric(url, "kvp_retained_fraction_sum") < metric(url, "kvp_retained_fraction_count")
    assert metric(url, "kvp_kv_cache_free_blocks") > 0
    assert metric(url, "vllm:prompt_tokens_total") > 0  # vLLM's own series are still there
