"""Where do the kept tokens sit, and how much future attention do they keep? Per rule, on collected traces.

A diagnostic for rules that lose at long contexts: for each rule and budget b, select the top-b tokens
per KV head exactly as the server does (4 sinks + 16 recent protected, `select_topb`) and report, averaged
over traces, layers and heads:
  - recent_share: the share of the kept tokens that lie in the last R prompt tokens (R = --recent);
  - kept_mass: the share of the future attention mass (c_i, PAPER.md) that the kept tokens hold
    (1.0 = nothing the answer attends to was evicted).
The oracle's row shows what the answer actually needed.

  python benchmarks/recency_kept.py --traces ~/.cache/kvp-vllm/traces/smollm2-ppl8192 \\
      --checkpoint kvp_vllm/checkpoints/SmolLM2-135M-Instruct --budgets 256,512 \\
      --out benchmarks/results/train_generalisation/recency_ppl_8k.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvp_vllm.eval.store import dumps_readable  # noqa: E402
from kvp_vllm.policy import KVPPolicy  # noqa: E402
from kvp_vllm.selection import select_topb  # noqa: E402
from kvp_vllm.training.collect import TraceSet  # noqa: E402
from kvp_vllm.training.evaluate import BASELINES, default_rules, layer_kv  # noqa: E402


@torch.no_grad()
def recency_stats(traces: TraceSet, rules, budgets, recent: int):
    sums = {(r, b): torch.zeros(2, dtype=torch.float64) for r in rules for b in budgets}
    count = 0
    ids = traces.split("all")
    for tid in ids:
        for layer in range(traces.shape.num_layers):
            kv = layer_kv(traces.load(tid, layer), layer)
            n, c = kv.length, kv.future_importance  # c: [H, n]
            total = c.sum(1).clamp_min(1e-12)
            for name, scorer in rules.items():
                scores = scorer.score(kv)
                for b in budgets:
                    kept = select_topb(scores, b)  # [H, b] ascending indices
                    recent_share = (kept >= n - recent).double().mean(1)
                    kept_mass = c.gather(1, kept).sum(1) / total
                    sums[(name, b)] += torch.stack([recent_share.mean(), kept_mass.double().mean()])
            count += 1
    return {"traces": len(ids), "prompt_tokens": [traces.meta(t).get("n_prompt") for t in ids],
            "recent": recent,
            "rows": [{"rule": r, "budget": b, "recent_share": float(v[0] / count), "kept_mass": float(v[1] / count)}
                     for (r, b), v in sums.items()]}


def markdown(res) -> str:
    budgets = sorted({row["budget"] for row in res["rows"]})
    by_rule = {}
    for row in res["rows"]:
        by_rule.setdefault(row["rule"], {})[row["budget"]] = row
    head = "| rule | " + " | ".join(f"kept mass b={b} | recent share b={b}" for b in budgets) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(budgets)]
    for rule, cells in sorted(by_rule.items(), key=lambda kv: -kv[1][budgets[0]]["kept_mass"]):
        lines.append(f"| {rule} | " + " | ".join(
            f"{cells[b]['kept_mass']:.3f} | {cells[b]['recent_share']:.3f}" for b in budgets) + " |")
    return (f"{res['traces']} traces (prompt tokens {res['prompt_tokens']}); recent = the last "
            f"{res['recent']} prompt tokens\n\n" + "\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--budgets", default="256,512")
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--rules", default="kvp,snapkv,tova,streaming,keydiff,lagkv,oracle")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    wanted = [r for r in args.rules.split(",") if r]
    known = ("kvp", *BASELINES, "oracle")  # what default_rules builds: the scorer registry's rules
    unknown = [r for r in wanted if r not in known]
    if unknown or not wanted:
        p.error(f"unknown rule {unknown[0]!r}; known: {','.join(known)}" if unknown else "no --rules given")
    torch.set_num_threads(1)
    traces = TraceSet(args.traces)
    policy = KVPPolicy.load(args.checkpoint, expect=traces.shape)
    rules = {k: v for k, v in default_rules(policy).items() if k in wanted}
    res = recency_stats(traces, rules, [int(b) for b in args.budgets.split(",")], args.recent)
    res["command"] = "python benchmarks/recency_kept.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps_readable(res))
    table = markdown(res)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
