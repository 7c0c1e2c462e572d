"""Held-out evaluation of rankings on collected traces: mean normalised cost cost/cost* (1.0 = oracle,
lower is better) of KVP and of every baseline scoring rule, per layer and overall.

Every rule is run through the one scoring interface (`make_scorer(name).score(LayerKV)`), on the prompt's
post-RoPE keys/values, with the last W prompt queries for the query-aware rules (TOVA, SnapKV; Expected
Attention, which reads every query, has these W only, and the model's RoPE from the traces' model
folder). The ranking and cost cover the unprotected tokens only (see `objective.middle`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..scorers import BASELINE_RULES, QUERY_AWARE_RULES, LayerKV, Rope, make_scorer
from .collect import TraceSet, TraceUnion
from .objective import greedy_normalised_cost, middle

BASELINES = BASELINE_RULES  # every servable rule but KVP, from the scorer registry
QUERY_AGNOSTIC = tuple(r for r in BASELINES if r not in QUERY_AWARE_RULES)


def layer_kv(data: Dict[str, torch.Tensor], layer: int, rope: Optional[Rope] = None) -> LayerKV:
    n = data["keys"].shape[1]
    return LayerKV(keys=data["keys"].float(), values=data["values"].float(),
                   positions=torch.arange(n), queries=data["window_queries"].float(),
                   future_importance=data["importance"].float(), layer=layer, rope=rope)


def traces_rope(traces: TraceSet | TraceUnion) -> Optional[Rope]:
    """The rotary embedding of the model the traces were collected from (its folder's config), or None
    when that folder is gone (Expected Attention then refuses with a clear error)."""
    from ..capture import config_rope

    path = traces.manifest.get("model_path")
    return config_rope(path) if path else None


@torch.no_grad()
def evaluate_rules(traces: TraceSet | TraceUnion, ids: Sequence[str], rules: Dict[str, object],
                   layers: Optional[Sequence[int]] = None, progress: bool = False) -> Dict:
    """rules: name -> Scorer. Returns {"overall": {rule: cost}, "per_layer": {rule: [cost per layer]},
    "per_head": {rule: [[...]]}, "per_trace": {trace id: {rule: cost}}, "traces": n}. Means are over
    traces and heads (equal weight), so "overall" is the mean of "per_trace"."""
    from tqdm import tqdm

    layers = list(range(traces.shape.num_layers)) if layers is None else list(layers)
    sums = {r: torch.zeros(len(layers), traces.shape.num_kv_heads, dtype=torch.float64) for r in rules}
    rope = traces_rope(traces) if any(getattr(s, "needs_queries", False) for s in rules.values()) else None
    per_trace = {}
    for tid in tqdm(ids, desc="evaluate", disable=not progress):
        trace = {r: torch.zeros_like(v) for r, v in sums.items()}
        for li, l in enumerate(layers):
            kv = layer_kv(traces.load(tid, l), l, rope)
            mid = middle(kv.length)
            c = kv.future_importance[:, mid]
            for name, scorer in rules.items():
                s = scorer.score(kv)[:, mid]
                trace[name][li] = greedy_normalised_cost(s, c).double()
        for r, v in trace.items():
            sums[r] += v
        per_trace[tid] = {r: float(v.mean()) for r, v in trace.items()}
    n = max(len(ids), 1)
    per_head = {r: (v / n) for r, v in sums.items()}
    return {"traces": len(ids), "layers": layers,
            "overall": {r: float(v.mean()) for r, v in per_head.items()},
            "per_layer": {r: [float(x) for x in v.mean(1)] for r, v in per_head.items()},
            "per_head": {r: v.tolist() for r, v in per_head.items()}, "per_trace": per_trace}


def default_rules(policy=None, baselines: Sequence[str] = BASELINES) -> Dict[str, object]:
    rules = {}
    if policy is not None:
        rules["kvp"] = make_scorer("kvp", policy=policy)
    for b in baselines:
        rules[b] = make_scorer(b)
    rules["oracle"] = make_scorer("oracle")
    return rules


def markdown_table(result: Dict, layers_shown: Sequence[int] = ()) -> str:
    rules = sorted(result["overall"], key=lambda r: result["overall"][r])
    head = "| rule | overall | " + " | ".join(f"layer {l}" for l in layers_shown) + " |"
    sep = "|---|---:|" + "---:|" * len(layers_shown)
    rows = [head, sep]
    idx = {l: i for i, l in enumerate(result["layers"])}
    for r in rules:
        cells = [f"{result['per_layer'][r][idx[l]]:.3f}" for l in layers_shown]
        rows.append(f"| {r} | {result['overall'][r]:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
