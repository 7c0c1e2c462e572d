"""README's ranking-quality claim, on fresh traces: the shipped SmolLM2 policy's held-out normalised cost
(cost/cost*, 1.0 = oracle, lower is better; `kvp_vllm/training/evaluate.py`, as in
`benchmarks/results/train_heldout_cost.md`) is below TOVA's, and below every other baseline's of
README's table.

Four short traces (~1K tokens, 24-token greedy answers) are collected from the real SmolLM2 through
`kvp-train collect` (today's prompt generators, the evaluation harness's) at seeds HELDOUT_SEED + 0..3,
apart from every seed the shipped policy was trained, selected or reported on (stages 1-4 drew the
older training-only generators at seeds 1000000-1000079 and 301-315, stages 5-8 today's generators at
1000501-1000512, 1005000-1005014, 1007000-1007011, 1012000-1012020 and 1013000-1013017; the reported evaluations use 101+, 201+, 401+, 1000901+ and
1003000+), then scored as `kvp-train evaluate` scores them
(`evaluate_rules`) with the rules' current default definitions (TOVA = kvpress's, one set for all
heads). 60-90 s on a shared 2-core CPU.
"""

import pytest
import torch

from kvp_vllm.policy import KVPPolicy
from kvp_vllm.scorers import BASELINE_RULES, rule_definition
from kvp_vllm.serving.config import shipped_checkpoint
from kvp_vllm.training import cli
from kvp_vllm.training.collect import TraceSet
from kvp_vllm.training.evaluate import default_rules, evaluate_rules

pytestmark = pytest.mark.timeout(600)

HELDOUT_SEED = 1_002_000
TASKS = "niah_single_repeat,essay_qa,niah_multikey,conversation"  # the first four of the default mix
# The baselines of README's "Learned ranking quality" table, the claim checked here (a rule added to
# the registry later joins the claim when README's table does).
README_BASELINES = ("tova", "expected_attention", "snapkv", "keydiff", "knorm", "streaming", "lagkv", "random")


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    traces = tmp_path_factory.mktemp("heldout") / "traces"
    ckpt = shipped_checkpoint("SmolLM2-135M-Instruct")
    assert ckpt is not None, "the SmolLM2 KVP policy must ship in kvp_vllm/checkpoints/"
    threads = torch.get_num_threads()
    try:
        assert cli.main(["collect", "--model", "smollm2", "--out", str(traces), "--lengths", "1024",
                         "--num-traces", "4", "--answer-tokens", "24", "--window", "64", "--tasks", TASKS,
                         "--traces-per-shard", "4", "--seed", str(HELDOUT_SEED), "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    traces = TraceSet(traces)
    # what `kvp-train evaluate` runs, on README's rules, each in its current default definition
    # (make_scorer(name): TOVA = kvpress's, one set for all heads)
    rules = default_rules(KVPPolicy.load(ckpt, expect=traces.shape), baselines=README_BASELINES)
    return traces, rules, evaluate_rules(traces, traces.trace_ids, rules)


def test_shipped_policy_heldout_cost_below_tova(heldout):
    traces, rules, res = heldout
    cost = res["overall"]
    print({r: round(c, 3) for r, c in sorted(cost.items(), key=lambda x: x[1])},
          {r: rule_definition(r) for r in rules})
    assert set(README_BASELINES) <= set(BASELINE_RULES)  # README's rules are still the registry's
    prompt_tokens = [traces.meta(t)["n_prompt"] for t in traces.trace_ids]
    assert res["traces"] == 4 and all(n > 900 for n in prompt_tokens), prompt_tokens
    assert cost["oracle"] == pytest.approx(1.0, abs=1e-5)
    # Measured (4 traces, seed 1002000): KVP 1.464 (stage 8, "v11d"; v11c 1.465, v8b 1.477, v6 1.465, v4 1.611), TOVA 2.157 (v2), then
    # KeyDiff 4.151, Expected Attention 4.287, K-Norm 4.773, SnapKV 5.197, StreamingLLM 10.382, LagKV 10.777, random 11.734; a
    # randomly initialised policy 11.80. KVP must stay at least 15% below TOVA (measured 32%); a policy
    # that ranks like random, or no better than TOVA, fails.
    assert cost["kvp"] < 0.85 * cost["tova"], cost
    # README: KVP has the lowest cost of every rule in its table (after TOVA, KeyDiff at 4.15)
    assert all(cost["kvp"] < cost[r] for r in README_BASELINES), cost


def test_shipped_policy_per_heldout_trace(heldout):
    """Not only on average: on each trace KVP's cost is below every baseline's except possibly TOVA's,
    and below TOVA's on at least three of the four. Measured per trace (KVP vs TOVA; the third rule
    is at 1.543 or more on every trace, Expected Attention or KeyDiff; fp32 on CPU is deterministic): v11d (stage 8) 1.278 vs
    2.455, 1.392 vs 1.750, 1.291 vs 2.514, 1.893 vs 1.908 -- the conversation trace is within 1% of TOVA
    (v11c lost it by 1%: 1.271, 1.383, 1.277, 1.929; v8b by 5%: 1.259, 1.382, 1.271, 1.998), the price of
    the decode-time traces that pulled stages 6-8 toward recent text (v6 had 1.898 there, v4 1.693)."""
    _, _, res = heldout
    per_trace = res["per_trace"]
    print({t: {r: round(v, 3) for r, v in sorted(c.items(), key=lambda x: x[1])} for t, c in per_trace.items()})
    assert len(per_trace) == 4
    others = [r for r in README_BASELINES if r != "tova"]
    assert all(c["kvp"] < c[r] for c in per_trace.values() for r in others), per_trace
    assert sum(c["kvp"] < c["tova"] for c in per_trace.values()) >= 3, per_trace
