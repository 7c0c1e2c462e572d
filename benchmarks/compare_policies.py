"""Put a second KVP policy beside a complete kvp-eval folder, on the same samples.

The generalisation question - how does a policy trained on short prompts do at 4K and 8K? - needs an
older policy's KVP rows beside the baselines. A kvp-eval folder holds one policy (rows of another are
recomputed, never mixed), so evaluate the older policy alone in a folder of its own, then merge:

  kvp-eval --lengths 4K --rules kvp --checkpoint OLD_POLICY --out benchmarks/results/eval_smollm2_4k_policy_v3 ...
  python benchmarks/compare_policies.py --base benchmarks/results/eval_smollm2_4k_faithful_protect_paper \\
      --other benchmarks/results/eval_smollm2_4k_policy_v3 --label kvp_v3 \\
      --out benchmarks/results/eval_smollm2_4k_policy_v3/compare

The older policy's KVP rows become rule LABEL; both folders must have evaluated the same prompts (their
full-cache rows must agree). Writes compare.md (task-averaged accuracy and perplexity tables over the
samples both folders have; for perplexity also the paired per-sample difference of the other policy
minus the base's KVP, mean ± standard error; for needles the prompts only one policy answered, with the
exact sign test on them), compare.json.gz and the usual plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvp_vllm.eval.plots import plot_all  # noqa: E402
from kvp_vllm.eval.runner import (RowMismatch, _budget_sort, aggregate, folder_policy_sha256, complete_rows,  # noqa: E402
                                  current_rows, markdown_summary, merge_policy_rows, paired_answers,
                                  paired_difference, paired_table, per_sample_loglik, read_rows, task_average,
                                  task_average_table)
from kvp_vllm.eval.store import MixedStore, write_json  # noqa: E402


def folder_rows(folder: Path):
    """A folder's current rows: KVP rows of the policy its results.json names."""
    sha = folder_policy_sha256(folder)
    try:
        rows = current_rows(read_rows(folder / "rows.jsonl"), sha)  # rows.jsonl.gz or a plain rows.jsonl
    except MixedStore as e:
        raise SystemExit(f"compare_policies: {e}")
    if not rows:
        raise SystemExit(f"compare_policies: no rows in {folder}")
    return rows, sha


def answers_table(answers) -> str:
    budgets = sorted({d["budget"] for d in answers}, key=_budget_sort)
    cell = {(d["length"], d["protocol"], d["budget"]): d for d in answers}
    lines = ["| length | protocol | prompts | " + " | ".join(f"b={b}" for b in budgets) + " |",
             "|" + "---|" * (len(budgets) + 3)]
    for length, protocol in sorted({(d["length"], d["protocol"]) for d in answers}):
        ds = [cell.get((length, protocol, b)) for b in budgets]
        vals = [f"+{d['won']} / -{d['lost']} (p = {d['p_value']:.2f})" if d else "" for d in ds]
        lines.append(f"| {length} | {protocol} | {max(d['prompts'] for d in ds if d)} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="kvp-eval folder with every rule")
    p.add_argument("--other", type=Path, required=True, help="kvp-eval folder with another policy's KVP rows")
    p.add_argument("--label", default="kvp_other", help="rule name for the other policy's rows")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    base, base_sha = folder_rows(args.base)
    other, other_sha = folder_rows(args.other)
    try:
        rows = complete_rows(merge_policy_rows(base, other, args.label))
    except (RowMismatch, ValueError) as e:
        raise SystemExit(f"compare_policies: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    agg, avg = aggregate(rows), task_average(rows)
    lines = [f"# {args.label} beside {args.base.name}\n",
             f"`kvp` = policy sha256 {str(base_sha)[:8]}… ({args.base}); `{args.label}` = policy sha256 "
             f"{str(other_sha)[:8]}… ({args.other}). Same samples for every rule.\n",
             f"Command: `python benchmarks/compare_policies.py --base {args.base} --other {args.other} "
             f"--label {args.label} --out {args.out}`\n"]
    for length in sorted({r["length"] for r in rows}):
        for protocol in sorted({r["protocol"] for r in rows}):
            table = task_average_table(avg, protocol, length)
            if table:
                lines.append(f"## task-averaged accuracy, {protocol}, {length} tokens\n\n{table}\n")
    for protocol in sorted({a["protocol"] for a in agg}):
        for metric, digits in (("accuracy", 2), ("perplexity", 1)):
            table = markdown_summary(agg, protocol, metric, digits)
            if table.count("\n") > 1:
                lines.append(f"## {metric}, {protocol}\n\n{table}\n")
    loglik = per_sample_loglik(rows)
    paired = [{**d, "rule": "kvp"} for a in agg if a["task"].startswith("ppl_") and a["rule"] == args.label
              for d in [paired_difference(loglik, a["length"], a["task"], a["budget"], args.label, "kvp")] if d]
    for length, task in sorted({(d["length"], d["task"]) for d in paired}):
        lines.append(f"## {task}, {length} tokens: paired difference of the log-likelihood per token, "
                     f"{args.label} minus kvp (mean ± standard error over the samples; positive: "
                     f"{args.label} better)\n\n{paired_table(paired, length, task)}\n")
    answers = [d for length in sorted({r["length"] for r in rows}) for protocol in sorted({r["protocol"] for r in rows})
               for budget in sorted({a["budget"] for a in agg if a["budget"] != "full"}, key=_budget_sort)
               for d in [paired_answers(rows, length, protocol, budget, args.label, "kvp")] if d]
    if answers:
        lines.append(f"## needle answers, {args.label} against kvp on the same prompts\n\n"
                     f"Prompts only {args.label} answered (+) / only kvp answered (-), and the exact two-sided "
                     f"sign test on those (p: the chance of a split this uneven between equally good "
                     f"policies).\n\n{answers_table(answers)}\n")
    (args.out / "compare.md").write_text("\n".join(lines))
    write_json(args.out / "compare.json.gz", {"base": str(args.base), "other": str(args.other),
                                              "label": args.label, "base_sha256": base_sha,
                                              "other_sha256": other_sha, "aggregate": agg, "task_average": avg,
                                              "paired_perplexity": paired, "paired_answers": answers})
    plot_all(agg, args.out, avg)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
