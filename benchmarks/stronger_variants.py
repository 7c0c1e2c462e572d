"""KVP beside the stronger of the two variants of each baseline (issue 16): never a handicapped one.

Every baseline runs twice, in two kvp-eval folders on the same samples: `--protect paper` (4 sink + 16
recent tokens always kept, the KVP paper's protocol) and `--protect none` (each rule's own choice, as
kvpress runs them). Protection helps some rules (StreamingLLM-like recency) and costs others answers
(K-Norm, KeyDiff, LagKV spend budget on tokens they would not keep). This report takes, for every
baseline and every cell (length, protocol, budget), the better of its two variants, and marks which
one it was; KVP is the shipped server's setting (`paper`). Both variants of each baseline are also listed
in full. The none folder's KVP rows (KVP without protection) are left out: they are not how KVP is
served, that folder's own report shows them, and they may be an earlier policy's.

  python benchmarks/stronger_variants.py --paper benchmarks/results/eval_smollm2_2k_faithful_protect_paper \\
      --none benchmarks/results/eval_smollm2_2k_faithful_protect_none \\
      --out benchmarks/results/eval_smollm2_2k_faithful_protect_paper/stronger

For perplexity tasks it also reports the paired per-sample difference of the log-likelihood per token,
KVP minus each baseline's stronger variant (mean ± standard error over the samples), so a small gap can
be read against the noise of the sample.

--loglik-tasks names question tasks the full cache does not answer at this model size (vt, cwe, fwe at
2K): accuracy is zero for every rule there, so they stay out of the task average and are compared by
the teacher-forced log-likelihood of the gold answer instead (`delta_logprob_per_token`: per token,
against the full cache on the same prompt; higher is better), per task and protocol, with the paired
per-sample difference KVP minus each baseline's stronger variant.

Writes stronger.md and stronger.json.gz. The folders must have evaluated the same prompts (their
full-cache rows must agree); only the samples both folders have with every rule and budget count.
--tasks restricts the report to some tasks (default: every task in the folders), e.g. the needle tasks
the full cache solves while the folders also hold tasks it does not (vt, cwe, fwe at 2K), which would
otherwise enter the task average. --budgets restricts it to some budgets (default: every budget in the
folders), e.g. the finished ones while a budget added later has rows for some samples only (a sample
counts only with every rule and budget, so a partial budget would shrink every table).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvp_vllm.eval.runner import (FULL, RowMismatch, _budget_sort, aggregate, folder_policy_sha256,  # noqa: E402
                                  complete_rows, current_rows, merge_rows, paired_difference, paired_table,
                                  per_sample_loglik, read_rows, stored_identity, task_average,
                                  task_average_table)
from kvp_vllm.eval.store import write_json  # noqa: E402

NONE_SUFFIX = "[protect=none]"


def folder_rows(folder: Path, protect: str) -> List[Dict]:
    ident = stored_identity(folder)
    if ident is None or ident.get("protect") != protect:
        raise SystemExit(f"stronger_variants: {folder} is not a --protect {protect} folder ({ident})")
    sha = folder_policy_sha256(folder)
    rows = current_rows(read_rows(folder / "rows.jsonl"), sha, protect)
    if not rows:
        raise SystemExit(f"stronger_variants: no rows in {folder}")
    return rows


def merged_rows(paper: List[Dict], none: List[Dict], kvp: str = "kvp") -> List[Dict]:
    """The paper folder's rows plus the none folder's baseline rows as `<rule>[protect=none]`. KVP is
    compared as served (`paper`), so the none folder's KVP rows (KVP without protection, possibly of an
    earlier policy) never enter the comparison nor decide which samples are complete."""
    none = [r for r in none if r["rule"] != kvp]
    labels = {r["rule"]: r["rule"] + NONE_SUFFIX for r in none if r["rule"] != FULL}
    return complete_rows(merge_rows(paper, none, labels))


def stronger_cells(cells: List[Dict], metric: str, higher_is_better: bool = True,
                   keep: Tuple[str, ...] = ("kvp",)) -> List[Dict]:
    """Per (length, protocol[, task], budget): every rule in `keep` as it is, every other rule as the
    better of `<rule>` and `<rule>[protect=none]` (the row gets `variant`: paper or none)."""
    groups: Dict[Tuple, Dict[str, Dict]] = defaultdict(dict)
    for c in cells:
        if c.get(metric) is None:
            continue
        key = (c["length"], c["protocol"], c.get("task", ""), c["budget"])
        groups[key][c["rule"]] = c
    out = []
    for key, by_rule in groups.items():
        bases = {r[:-len(NONE_SUFFIX)] if r.endswith(NONE_SUFFIX) else r for r in by_rule}
        for rule in sorted(bases):
            if rule == FULL or rule in keep:
                if rule in by_rule:
                    out.append({**by_rule[rule], "variant": "paper" if rule != FULL else FULL})
                continue
            options = [(by_rule[name], variant) for name, variant in ((rule, "paper"), (rule + NONE_SUFFIX, "none"))
                       if name in by_rule]
            best, variant = max(options, key=lambda ov: ov[0][metric] if higher_is_better else -ov[0][metric])
            out.append({**best, "rule": rule, "variant": variant})
    return out


def stronger_table(cells: List[Dict], metric: str, length: int, protocol: str, task: str = "",
                   digits: int = 3, higher_is_better: bool = True) -> str:
    """Markdown: one line per rule, one column per budget; a baseline's value is its stronger
    variant, marked ᴺ when that was --protect none."""
    sel = [c for c in cells if c["length"] == length and c["protocol"] == protocol and c.get("task", "") == task]
    if not sel:
        return ""
    budgets = sorted({c["budget"] for c in sel if c["rule"] != FULL}, key=_budget_sort)
    by_rule: Dict[str, Dict[str, Dict]] = defaultdict(dict)
    for c in sel:
        by_rule[c["rule"]][c["budget"]] = c
    full = by_rule.pop(FULL, {}).get(FULL)
    sign = 1 if higher_is_better else -1
    order = sorted(by_rule, key=lambda r: -sign * sum(by_rule[r][b][metric] for b in budgets if b in by_rule[r]))
    lines = ["| rule | " + " | ".join(f"b={b}" for b in budgets) + " | full |", "|" + "---|" * (len(budgets) + 2)]
    for rule in order:
        vals = []
        for b in budgets:
            c = by_rule[rule].get(b)
            vals.append("" if c is None else f"{c[metric]:.{digits}f}" + ("ᴺ" if c["variant"] == "none" else ""))
        lines.append(f"| {rule} | " + " | ".join(vals) + (f" | {full[metric]:.{digits}f} |" if full else " | |"))
    return "\n".join(lines)


def paired_differences(rows: List[Dict], strong: List[Dict], kvp: str = "kvp", tasks=None) -> List[Dict]:
    """Per perplexity cell (length, task, budget) and baseline: KVP's per-sample log-likelihood per token
    minus the baseline's stronger variant's (positive: KVP better), mean and standard error. With
    `tasks`: those question tasks' gold-answer log-likelihood instead (rows and cells of one protocol)."""
    loglik = per_sample_loglik(rows, tasks)
    out = []
    for c in strong:
        if c["rule"] in (FULL, kvp):
            continue
        name = c["rule"] + (NONE_SUFFIX if c["variant"] == "none" else "")
        d = paired_difference(loglik, c["length"], c["task"], c["budget"], kvp, name)
        if d:
            out.append({**d, "rule": c["rule"], "variant": c["variant"]})
    return out


def loglik_sections(rows: List[Dict], agg: List[Dict], tasks: List[str]) -> Tuple[List[str], List[Dict], List[Dict]]:
    """The --loglik-tasks part of the report: per length, task and protocol, each rule's mean gold-answer
    log-likelihood per token against the full cache (stronger variant per baseline), and the paired
    differences KVP minus each baseline."""
    metric = "delta_logprob_per_token"
    strong = stronger_cells([a for a in agg if a["task"] in tasks], metric)
    lengths, protocols = sorted({r["length"] for r in rows}), sorted({r["protocol"] for r in rows})
    diffs = []  # per (length, protocol): per_sample_loglik does not tell protocols apart
    for length in lengths:
        for protocol in protocols:
            sel = [r for r in rows if (r["protocol"], r["length"]) == (protocol, length)]
            cells = [c for c in strong if (c["protocol"], c["length"]) == (protocol, length)]
            diffs += [{**x, "protocol": protocol} for x in paired_differences(sel, cells, tasks=tasks)]
    lines = []
    for length in lengths:
        for task in tasks:
            for protocol in protocols:
                t = stronger_table(strong, metric, length, protocol, task)
                if not t:
                    continue
                lines.append(f"## {task}, {protocol}, {length} tokens: gold-answer log-likelihood per token minus "
                             f"the full cache's (higher is better; the full cache answers too few to compare "
                             f"accuracy)\n\n{t}\n")
                d = [x for x in diffs if (x["protocol"], x["length"], x["task"]) == (protocol, length, task)]
                t = paired_table(d, length, task)
                if t:
                    lines.append(f"## {task}, {protocol}, {length} tokens: paired difference of the gold answer's "
                                 f"log-likelihood per token, KVP minus the baseline's stronger variant (mean ± "
                                 f"standard error over {max(x['samples'] for x in d)} samples; positive: KVP "
                                 f"better)\n\n{t}\n")
    return lines, strong, diffs


def report(rows: List[Dict], loglik_tasks: List[str] = ()) -> Tuple[str, Dict]:
    avg = task_average([r for r in rows if r["task"] not in loglik_tasks])
    agg = aggregate(rows)
    ppl = [a for a in agg if a["task"].startswith("ppl_")]
    strong_acc = stronger_cells(avg, "accuracy")
    strong_ppl = stronger_cells(ppl, "perplexity", higher_is_better=False)
    diffs = paired_differences(rows, strong_ppl)
    lines = []
    for length in sorted({r["length"] for r in rows}):
        for protocol in sorted({r["protocol"] for r in rows}):
            t = stronger_table(strong_acc, "accuracy", length, protocol)
            if t:
                n = next(a for a in avg if a["length"] == length and a["protocol"] == protocol)
                lines.append(f"## task-averaged accuracy, {protocol}, {length} tokens: KVP vs each baseline's "
                             f"stronger variant\n\n{n['tasks']} tasks, {n['samples']} samples; ᴺ = the "
                             f"--protect none variant was the stronger\n\n{t}\n")
        for task in sorted({a["task"] for a in ppl}):
            t = stronger_table(strong_ppl, "perplexity", length, "query_aware", task, digits=2,
                               higher_is_better=False)
            if t:
                lines.append(f"## {task} perplexity (lower is better), {length} tokens: KVP vs each baseline's "
                             f"stronger variant\n\n{t}\n")
            t = paired_table(diffs, length, task)
            if t:
                n = max(d["samples"] for d in diffs if d["length"] == length and d["task"] == task)
                lines.append(f"## {task}, {length} tokens: paired difference of the log-likelihood per token, "
                             f"KVP minus the baseline's stronger variant (mean ± standard error over {n} "
                             f"samples; positive: KVP better)\n\n{t}\n")
    ll_lines, strong_ll, ll_diffs = loglik_sections(rows, agg, list(loglik_tasks)) if loglik_tasks else ([], [], [])
    lines += ll_lines
    for length in sorted({r["length"] for r in rows}):
        for protocol in sorted({r["protocol"] for r in rows}):
            t = task_average_table(avg, protocol, length)
            if t:
                lines.append(f"## both variants: task-averaged accuracy, {protocol}, {length} tokens\n\n{t}\n")
    return "\n".join(lines), {"task_average": avg, "stronger_accuracy": strong_acc,
                              "stronger_perplexity": strong_ppl, "paired_perplexity": diffs,
                              "stronger_loglik": strong_ll, "paired_loglik": ll_diffs, "aggregate": agg}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", type=Path, required=True, help="kvp-eval folder run with --protect paper")
    p.add_argument("--none", type=Path, required=True, help="kvp-eval folder run with --protect none")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tasks", default=None, help="comma list: report only these tasks (default: all)")
    p.add_argument("--budgets", default=None, help="comma list: report only these budgets (default: all)")
    p.add_argument("--loglik-tasks", default="",
                   help="comma list of question tasks to compare by the gold answer's log-likelihood, not accuracy")
    args = p.parse_args(argv)
    paper, none = folder_rows(args.paper, "paper"), folder_rows(args.none, "none")
    loglik_tasks = [t.strip() for t in args.loglik_tasks.split(",") if t.strip()]
    absent = sorted(set(loglik_tasks) - {r["task"] for r in paper if r.get("kind", "qa") == "qa"})
    if absent:
        raise SystemExit(f"stronger_variants: --loglik-tasks: no question rows of {', '.join(absent)} in {args.paper}")
    if args.tasks is not None:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        absent = sorted(set(tasks) - {r["task"] for r in paper})
        if not tasks or absent:
            raise SystemExit(f"stronger_variants: --tasks {args.tasks!r}: no rows of {', '.join(absent) or 'any task'}"
                             f" in {args.paper}")
        if set(loglik_tasks) - set(tasks):
            raise SystemExit("stronger_variants: every --loglik-tasks task must also be in --tasks")
        paper = [r for r in paper if r["task"] in tasks]
        none = [r for r in none if r["task"] in tasks]
    if args.budgets is not None:
        budgets = {b.strip() for b in args.budgets.split(",") if b.strip()}
        absent = sorted(budgets - {r["budget"] for r in paper})
        if not budgets or absent:
            raise SystemExit(f"stronger_variants: --budgets {args.budgets!r}: no rows of budget "
                             f"{', '.join(absent) or 'any'} in {args.paper}")
        paper = [r for r in paper if r["rule"] == FULL or r["budget"] in budgets]
        none = [r for r in none if r["rule"] == FULL or r["budget"] in budgets]
    try:
        rows = merged_rows(paper, none)
    except (RowMismatch, ValueError) as e:
        raise SystemExit(f"stronger_variants: {e}")
    if not rows:
        raise SystemExit("stronger_variants: the folders have no sample in common with every rule and budget")
    text, data = report(rows, loglik_tasks)
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = (f"python benchmarks/stronger_variants.py --paper {args.paper} --none {args.none} --out {args.out}"
           + (f" --tasks {args.tasks}" if args.tasks is not None else "")
           + (f" --budgets {args.budgets}" if args.budgets is not None else "")
           + (f" --loglik-tasks {args.loglik_tasks}" if loglik_tasks else ""))
    (args.out / "stronger.md").write_text(f"# KVP vs the stronger variant of each baseline\n\nCommand: `{cmd}`\n\n"
                                          + text)
    write_json(args.out / "stronger.json.gz", {"paper": str(args.paper), "none": str(args.none), **data})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
