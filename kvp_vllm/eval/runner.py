"""Evaluation runner: samples x rules x budgets x protocols, resumable, JSON + CSV outputs.

Storage (in the output folder; the raw files gzip-compressed, see store.py):
  rows.jsonl.gz      one line per (sample, protocol, rule, budget): the resume store, appended per
                     sample (one gzip member each; rewritten as one member when a run ends)
  progress.log.gz    per-sample timings by stage (`zcat progress.log.gz | tail`)
  run.json           the settings the folder was started with (a resumed run must match them)
  results.json       settings, what was measured (samples per task), task averages, timings
  per_sample.csv.gz  the rows, flattened;  aggregate.csv  the aggregated rows;  plots (plots.py)
A folder made before the raw files were compressed has plain rows.jsonl / progress.log: a resumed run
keeps appending to those (`kvp-eval --compress-store --out FOLDER` migrates it once); readers take
either name.

Resuming: a sample is skipped when every requested (protocol, rule, budget) row of it is stored; when
only some rules or budgets are missing (e.g. KVP added later with --checkpoint, or a budget added
to --budgets) only those are computed (the prefill is redone, the stored full-cache answer is
reused). KVP rows record the sha256 of the policy weights that made them; after the checkpoint
changes they count as missing and are recomputed (the newest row of a key wins), so one folder never
mixes two policies.

Definitions and protection. Every rule row also records `rule_def`, the definition of the rule that
made it (`Scorer.definition`: "v1", "v2", ...; see kvp_vllm/scorers/base.py), and `protect`, the
--protect mode (`paper`: 4 sinks + 16 recent tokens always kept, `none`: the rule's own choice). Rows
written before these fields existed are `rule_def` "v1" and `protect` "paper" (LEGACY_PROTECT). A row
whose definition is not the rule's current one, or whose protect mode is not the folder's, is stale:
a resumed run recomputes it, and it is never averaged with current rows. A folder has one protect mode
(run.json's identity; a folder from before the field is `paper`). Reports (`current_rows`) show a
rule's current rows when it has any; a rule with only stale rows (a folder made before the rule's
definition changed) is reported under a label naming its variant, e.g. `tova@v1`, so old tables stay
readable and say what they measured.
"""

from __future__ import annotations

import fcntl
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..environment import numerics_environment
from ..scorers import LEGACY_DEFINITION, SCORERS, make_scorer, rule_definition
from ..selection import DEFAULT_PROTECT, protected_counts
from . import protocol as P
from .store import (MixedStore, append_rows, append_text, compact, read_rows,  # noqa: F401 (re-exported)
                    store_path, write_csv, write_json)
from .tasks import TASKS, Renderer, Sample, make_sample, score_answers

FULL = "full"
#: The protect mode of rows and folders from before the field existed.
LEGACY_PROTECT = "paper"


def budget_label(b) -> str:
    return f"{b:g}" if isinstance(b, float) else str(int(b))


@dataclass
class EvalConfig:
    tasks: List[str]
    lengths: List[int]
    samples: int
    budgets: List  # ints (tokens) and floats (fractions of the compressed cache)
    rules: List[str]
    protocols: List[str]
    seed: int = 0
    model: str = "smollm2"
    checkpoint: Optional[str] = None
    window: int = 64
    protect: str = DEFAULT_PROTECT  # --protect: paper (4 sinks + 16 recent always kept) or none

    def __post_init__(self) -> None:
        protected_counts(self.protect)  # an unknown mode fails here

    def identity(self) -> Dict:
        """Settings that must not change when a run is resumed in the same folder."""
        return {"model": self.model, "seed": self.seed, "window": self.window, "protect": self.protect}


def stored_identity(out_dir: Path) -> Optional[Dict]:
    """The identity a folder's run.json records (None without run.json); a folder from before the
    protect field was `paper`."""
    meta = Path(out_dir) / "run.json"
    if not meta.exists():
        return None
    ident = json.loads(meta.read_text()).get("identity")
    return {"protect": LEGACY_PROTECT, **ident} if isinstance(ident, dict) else ident


def _protocols_for(sample: Sample, protocols: Sequence[str]) -> List[str]:
    # Perplexity has no question: both protocols are the same computation; run it once.
    if sample.kind == "ppl":
        return ["query_aware"]
    return list(protocols)


def make_scorers(rules: Sequence[str], sample: Sample, checkpoint: Optional[str], cache: Dict):
    out = {}
    for name in rules:
        if name == "random":
            out[name] = make_scorer("random", seed=sample.seed * 100_003 + sample.index)
        elif name == "kvp":
            if "kvp" not in cache:
                cache["kvp"] = make_scorer("kvp", checkpoint=checkpoint)
            out[name] = cache["kvp"]
        else:
            if name not in cache:
                cache[name] = make_scorer(name)
            out[name] = cache[name]
    return out


@torch.no_grad()
def evaluate_sample(model, tokenizer, sample: Sample, rules: Sequence[str], budgets: Sequence,
                    protocols: Sequence[str], checkpoint: Optional[str] = None,
                    full_record: Optional[Dict] = None, window: int = 64,
                    scorer_cache: Optional[Dict] = None, timings: Optional[Dict] = None,
                    protect: Union[str, Sequence[str]] = DEFAULT_PROTECT) -> List[Dict]:
    """All rows of one sample. `rules` excludes "full", which is always computed (or reused from
    full_record, which carries the stored full-cache answer). Every rule row records the rule's
    definition and the protect mode (and KVP rows the policy's sha256). KVzip rows also record the
    cost of its reconstruction pass (`extra_prefill_tokens` fed, `extra_prefill_seconds`; summed in
    timings["kvzip_reconstruction"]): a prefill no other rule pays.

    `protect` may name several modes: the prefill, the full-cache answer, KVzip's reconstruction and
    the scores are computed once and each mode's rows are made from them (the full-cache rows once).
    Each mode's compressed caches run as their own batches, so its rows are the ones a pass with that
    mode alone makes."""
    protects = [protect] if isinstance(protect, str) else list(protect)
    timings = timings if timings is not None else defaultdict(float)
    scorer_cache = scorer_cache if scorer_cache is not None else {}
    eos = P._eos_ids(model, [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    scorers = make_scorers([r for r in rules if r != FULL], sample, checkpoint, scorer_cache)
    t0 = time.perf_counter()
    pre = P.prefill(model, sample.prompt_ids, len(sample.context_ids), window=window,
                    capture=P.capture_window(window, list(scorers.values())))
    timings["prefill"] += time.perf_counter() - t0
    base = {"task": sample.task, "length": sample.length, "index": sample.index,
            "prompt_tokens": len(sample.prompt_ids), "kind": sample.kind}
    t0 = time.perf_counter()
    if full_record is not None:
        answer = list(full_record["answer_ids"])
    else:
        answer = P.full_answer(model, pre, sample.max_new_tokens, eos)
    timings["full_answer"] += time.perf_counter() - t0
    protos = _protocols_for(sample, protocols)
    future = None
    if "oracle" in rules:
        t0 = time.perf_counter()
        future = P.oracle_importance(model, pre, answer if sample.kind == "qa" else sample.gold_ids)
        timings["oracle_future"] += time.perf_counter() - t0
    # KVzip: its reconstruction pass per protocol, an extra prefill recorded on its rows
    reconstruction: Dict[str, List[torch.Tensor]] = {}
    extra: Dict[Tuple[str, str], Dict] = {}
    if "kvzip" in scorers:
        prompts = P.KVzipPrompts.for_tokenizer(tokenizer)
        for protocol in protos:
            t0 = time.perf_counter()
            reconstruction[protocol], fed = P.kvzip_importance(model, pre, protocol, prompts, scorers["kvzip"])
            dt = time.perf_counter() - t0
            timings["kvzip_reconstruction"] += dt
            extra[(protocol, "kvzip")] = {"extra_prefill_tokens": fed, "extra_prefill_seconds": round(dt, 3)}
    stamp = {name: {"rule_def": sc.definition} for name, sc in scorers.items()}
    if "kvp" in stamp:
        stamp["kvp"]["checkpoint_sha256"] = checkpoint_sha256(checkpoint)

    def row(protocol, rule, label, kept, cache_len, out: P.Outcome, mode=None):
        text = tokenizer.decode([t for t in out.tokens if t not in eos], skip_special_tokens=True)
        correct, recall = score_answers(text, sample.answers) if sample.kind == "qa" else (None, None)
        r = dict(base, protocol=protocol, rule=rule, budget=label, kept=kept, cache_len=cache_len,
                 output=text, correct=correct, recall=recall, same_as_full=out.tokens == answer,
                 agree=out.agree, gold_logprob=out.gold_logprob, gold_tokens=out.gold_tokens)
        return dict(r, **stamp.get(rule, {}), **({} if mode is None else {"protect": mode}),
                    **extra.get((protocol, rule), {}))

    rows: List[Dict] = []
    for protocol in protos:
        cache_len = pre.cache_len(protocol)
        t0 = time.perf_counter()
        full_layers = [(k[None, :, :cache_len], v[None, :, :cache_len]) for k, v in zip(pre.keys, pre.values)]
        full_out = P.evaluate_caches(model, pre, protocol, [full_layers], answer, sample.gold_ids,
                                     sample.max_new_tokens, eos)[0]
        timings["full_eval"] += time.perf_counter() - t0
        full_row = row(protocol, FULL, FULL, cache_len, cache_len, full_out)
        full_row["answer_ids"] = answer
        rows.append(full_row)
        if not scorers:
            continue
        t0 = time.perf_counter()
        ranked = {name: P.rule_scores(sc, pre, protocol, None if future is None else future[protocol],
                                      reconstruction.get(protocol) if name == "kvzip" else None)
                  for name, sc in scorers.items()}
        timings["scoring"] += time.perf_counter() - t0
        for mode in protects:
            jobs = []  # (rule, budget label, b, compacted layers): every rule and budget of this mode
            for budget in budgets:
                b = P.resolve_budget(budget, cache_len, mode)
                label = budget_label(budget)
                if b >= cache_len:  # keeps everything: identical to the full cache
                    for name in scorers:
                        rows.append(dict(full_row, rule=name, budget=label, answer_ids=None, **stamp[name],
                                         protect=mode, **extra.get((protocol, name), {})))
                    continue
                t0 = time.perf_counter()
                for name in scorers:
                    kept = P.kept_indices(ranked[name], b, mode)
                    jobs.append((name, label, b, P.compacted_layers(pre, protocol, kept)))
                timings["select_compact"] += time.perf_counter() - t0
            if jobs:
                t0 = time.perf_counter()
                outs = P.evaluate_caches(model, pre, protocol, [j[3] for j in jobs], answer, sample.gold_ids,
                                         sample.max_new_tokens, eos)
                timings["compressed_eval"] += time.perf_counter() - t0
                for (name, label, b, _), out in zip(jobs, outs):
                    rows.append(row(protocol, name, label, b, cache_len, out, mode))
    for r in rows:
        if r.get("answer_ids") is None:
            r.pop("answer_ids", None)
    return rows


# ---------------------------------------------------------------------------------------------
# Store


def checkpoint_sha256(checkpoint: Optional[str]) -> Optional[str]:
    """The weights' sha256 recorded in a policy folder's config.json (None without a checkpoint)."""
    if not checkpoint:
        return None
    path = Path(checkpoint) / "config.json"
    return json.loads(path.read_text()).get("weights_sha256") if path.exists() else None


def folder_policy_sha256(folder: Path) -> Optional[str]:
    """The KVP policy a result folder reports: the sha256 its results.json records (older folders: the
    one of the checkpoint it names)."""
    settings = json.loads((Path(folder) / "results.json").read_text())["settings"]
    return settings.get("checkpoint_weights_sha256") or checkpoint_sha256(settings.get("checkpoint"))


def row_definition(r: Dict) -> str:
    """The definition of the rule that made a row (rows from before the field: LEGACY_DEFINITION)."""
    return r.get("rule_def", LEGACY_DEFINITION)


def row_protect(r: Dict) -> str:
    """The protect mode a row was made with (rows from before the field: LEGACY_PROTECT)."""
    return r.get("protect", LEGACY_PROTECT)


def is_current(r: Dict, kvp_sha: Optional[str], protect: str = DEFAULT_PROTECT) -> bool:
    """False for a stale row: a KVP row made by another policy than the current checkpoint, a row of a
    rule whose definition has changed since, or a row made under another protect mode. Full-cache rows
    depend on neither and are always current."""
    rule = r["rule"]
    if rule == FULL:
        return True
    if rule in SCORERS and row_definition(r) != rule_definition(rule):
        return False
    if row_protect(r) != protect:
        return False
    return rule != "kvp" or r.get("checkpoint_sha256") == kvp_sha


def variant_label(rule: str, definition: str, protect: str, current_protect: str = DEFAULT_PROTECT) -> str:
    """The name stale rows are reported under: the rule, "@<definition>" when that is not the rule's
    current one, "[protect=<mode>]" when the mode is not the current one (e.g. "tova@v1")."""
    label = rule
    if rule in SCORERS and definition != rule_definition(rule):
        label += f"@{definition}"
    if protect != current_protect:
        label += f"[protect={protect}]"
    return label


def current_rows(rows: List[Dict], kvp_sha: Optional[str], protect: str = DEFAULT_PROTECT) -> List[Dict]:
    """The rows to report: the newest row of every key (per policy for KVP); KVP rows of another policy
    left out. Rows of another definition or protect mode (stale) are never reported beside current
    rows of their rule: a rule with current rows loses its stale ones; a rule with none (e.g. a folder
    made before the rule changed) is reported from its newest stored variant, renamed by
    `variant_label`."""
    # KVP rows are kept per policy: a later policy's row for the same prompt and budget (e.g. a one-pass
    # run with another --checkpoint) must not hide the current policy's
    newest = {(row_key(r), r.get("checkpoint_sha256") if r["rule"] == "kvp" else None): (i, r)
              for i, r in enumerate(rows)}.values()
    out: List[Dict] = []
    stale: Dict[str, List[Tuple[int, Dict]]] = defaultdict(list)
    for i, r in newest:
        if is_current(r, kvp_sha, protect):
            out.append(r)
        elif not (r["rule"] == "kvp" and r.get("checkpoint_sha256") != kvp_sha):
            stale[r["rule"]].append((i, r))
    reported = {r["rule"] for r in out}
    for rule, rs in stale.items():
        if rule in reported:
            continue
        variant = lambda r: (row_definition(r), row_protect(r))  # noqa: E731
        last = variant(max(rs, key=lambda ir: ir[0])[1])
        label = variant_label(rule, *last, current_protect=protect)
        out.extend({**r, "rule": label} for _, r in sorted(rs, key=lambda ir: ir[0]) if variant(r) == last)
    return out


def reported_rules(rows: List[Dict], rules: Sequence[str]) -> List[str]:
    """The names `rules` have in reported rows: the rule itself, else the label of its stale variant."""
    present = {r["rule"] for r in rows}
    out = []
    for rule in rules:
        if rule in present:
            out.append(rule)
        else:
            variants = sorted(p for p in present if p.startswith((rule + "@", rule + "[")))
            out.extend(variants or [rule])
    return out


def row_key(r: Dict) -> Tuple:
    return (r["task"], r["length"], r["index"], r["protocol"], r["rule"], r["budget"])


def wanted_keys(sample: Sample, rules, budgets, protocols) -> Dict[str, List[Tuple]]:
    """Per rule (incl. full), the row keys the sample needs."""
    out: Dict[str, List[Tuple]] = {}
    for p in _protocols_for(sample, protocols):
        out.setdefault(FULL, []).append((sample.task, sample.length, sample.index, p, FULL, FULL))
        for rule in rules:
            for b in budgets:
                out.setdefault(rule, []).append(
                    (sample.task, sample.length, sample.index, p, rule, budget_label(b)))
    return out


# ---------------------------------------------------------------------------------------------
# Aggregation


def aggregate(rows: List[Dict]) -> List[Dict]:
    full = {(r["task"], r["length"], r["index"], r["protocol"]): r for r in rows if r["rule"] == FULL}
    groups: Dict[Tuple, List[Dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["length"], r["protocol"], r["rule"], r["budget"])].append(r)
    out = []
    for (task, length, protocol, rule, budget), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], kv[0][3], _budget_sort(kv[0][4]))):
        fulls = [full.get((r["task"], r["length"], r["index"], r["protocol"])) for r in rs]
        pairs = [(r, f) for r, f in zip(rs, fulls) if f is not None]
        agg = {"task": task, "length": length, "protocol": protocol, "rule": rule, "budget": budget,
               "n": len(rs), "kept_mean": sum(r["kept"] for r in rs) / len(rs),
               "cache_len_mean": sum(r["cache_len"] for r in rs) / len(rs)}
        kind = rs[0].get("kind", "qa")
        if kind == "qa":
            agg["accuracy"] = sum(bool(r["correct"]) for r in rs) / len(rs)
            agg["recall"] = sum(r["recall"] for r in rs) / len(rs)
            agg["full_accuracy"] = (sum(bool(f["correct"]) for _, f in pairs) / len(pairs)) if pairs else None
            agg["same_as_full"] = sum(bool(r["same_as_full"]) for r in rs) / len(rs)
        tok = sum(r["gold_tokens"] for r in rs)
        agg["gold_logprob_per_token"] = sum(r["gold_logprob"] for r in rs) / max(tok, 1)
        if pairs:
            agg["delta_logprob_per_token"] = sum(
                (r["gold_logprob"] - f["gold_logprob"]) / max(r["gold_tokens"], 1) for r, f in pairs) / len(pairs)
        extra = [r for r in rs if r.get("extra_prefill_tokens") is not None]
        if extra:  # a rule paying a second forward pass (KVzip's reconstruction): its mean cost
            agg["extra_prefill_tokens_mean"] = sum(r["extra_prefill_tokens"] for r in extra) / len(extra)
            agg["extra_prefill_seconds_mean"] = sum(r["extra_prefill_seconds"] for r in extra) / len(extra)
        if kind == "ppl":
            agg["perplexity"] = math.exp(-sum(r["gold_logprob"] for r in rs) / max(tok, 1))
            ftok = sum(f["gold_tokens"] for _, f in pairs)
            agg["full_perplexity"] = math.exp(-sum(f["gold_logprob"] for _, f in pairs) / max(ftok, 1)) \
                if pairs else None
        out.append(agg)
    return out


class RowMismatch(ValueError):
    """Two result folders did not evaluate the same prompts."""


def merge_policy_rows(base: List[Dict], other: List[Dict], label: str) -> List[Dict]:
    """`base` (every rule) plus the KVP rows of another policy from `other`, renamed to `label`.

    A folder holds one policy's KVP rows (rows of another are recomputed, never mixed), so comparing
    two policies means evaluating the second in a folder of its own and merging here."""
    return merge_rows(base, other, {"kvp": label})


def merge_rows(base: List[Dict], other: List[Dict], labels: Dict[str, str]) -> List[Dict]:
    """`base` plus the rows of `other` whose rule is in `labels`, renamed to labels[rule] (another
    policy's KVP rows, or the baselines of a --protect none folder beside a paper one). Both folders
    must have evaluated the same prompts: every full-cache row they share must agree (prompt length,
    greedy output, gold log-likelihood to 1e-4 relative), else RowMismatch. complete_rows() then keeps
    the samples that both folders have."""
    taken = {r["rule"] for r in base}
    for label in labels.values():
        if label in taken:
            raise ValueError(f"label {label!r} is already a rule of the base rows")
    full = {row_key(r): r for r in base if r["rule"] == FULL}
    shared = 0
    for r in other:
        if r["rule"] != FULL or row_key(r) not in full:
            continue
        f = full[row_key(r)]
        # gold log-likelihoods agree to fp32 noise only: the batch a row was decoded in changes the
        # reduction order (~3e-6 relative seen on 64-token sums)
        if (f["prompt_tokens"], f.get("output")) != (r["prompt_tokens"], r.get("output")) or \
                abs(f["gold_logprob"] - r["gold_logprob"]) > 1e-4 * max(1.0, abs(f["gold_logprob"])):
            raise RowMismatch(f"the folders evaluated different prompts: full-cache rows differ at "
                              f"{row_key(r)[:4]}")
        shared += 1
    if not shared:
        raise RowMismatch("the folders share no sample (no full-cache row in common)")
    return base + [{**r, "rule": labels[r["rule"]]} for r in other if r["rule"] in labels]


def complete_rows(rows: List[Dict]) -> List[Dict]:
    """Rows of the samples that have a row for every (rule, budget) seen at their length and protocol:
    every rule is then aggregated over the same samples (a rule added later, or a run cut short,
    would otherwise be averaged over a different subset)."""
    combos: Dict[Tuple, set] = defaultdict(set)
    got: Dict[Tuple, set] = defaultdict(set)
    for r in rows:
        combos[(r["length"], r["protocol"])].add((r["rule"], r["budget"]))
        got[(r["task"], r["length"], r["index"], r["protocol"])].add((r["rule"], r["budget"]))
    return [r for r in rows
            if got[(r["task"], r["length"], r["index"], r["protocol"])] == combos[(r["length"], r["protocol"])]]


def task_average(rows: List[Dict]) -> List[Dict]:
    """Accuracy averaged over the question-answering tasks, per (length, protocol, rule, budget), on
    the samples that have every (rule, budget) (see complete_rows)."""
    per_task: Dict[Tuple, List[bool]] = defaultdict(list)
    counted: Dict[Tuple, set] = defaultdict(set)
    for r in complete_rows([r for r in rows if r.get("kind", "qa") == "qa"]):
        counted[(r["length"], r["protocol"])].add((r["task"], r["index"]))
        per_task[(r["length"], r["protocol"], r["rule"], r["budget"], r["task"])].append(bool(r["correct"]))
    by_cell: Dict[Tuple, List[float]] = defaultdict(list)
    for (length, protocol, rule, budget, task), hits in per_task.items():
        by_cell[(length, protocol, rule, budget)].append(sum(hits) / len(hits))
    return [{"length": length, "protocol": protocol, "rule": rule, "budget": budget,
             "accuracy": sum(accs) / len(accs), "tasks": len(accs),
             "samples": len(counted[(length, protocol)])}
            for (length, protocol, rule, budget), accs in sorted(
                by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], _budget_sort(kv[0][3])))]


def task_average_table(avg: List[Dict], protocol: str, length: int) -> str:
    """Markdown: one line per rule, one column per budget (task-averaged accuracy), full cache beside."""
    cells = [a for a in avg if a["protocol"] == protocol and a["length"] == length]
    if not cells:
        return ""
    budgets = sorted({a["budget"] for a in cells if a["rule"] != FULL}, key=_budget_sort)
    full = next((a for a in cells if a["rule"] == FULL), None)
    by_rule: Dict[str, Dict[str, float]] = defaultdict(dict)
    for a in cells:
        if a["rule"] != FULL:
            by_rule[a["rule"]][a["budget"]] = a["accuracy"]
    lines = [f"| rule | " + " | ".join(f"b={b}" for b in budgets) + " | full |",
             "|" + "---|" * (len(budgets) + 2)]
    mid = [b for b in budgets if b in ("128", "256", "512")] or budgets
    for rule, accs in sorted(by_rule.items(), key=lambda kv: -sum(kv[1].get(b, 0) for b in mid)):
        lines.append(f"| {rule} | " + " | ".join(f"{accs[b]:.3f}" if b in accs else "" for b in budgets)
                     + (f" | {full['accuracy']:.3f} |" if full else " | |"))
    n = cells[0]
    return (f"{n['tasks']} tasks, {n['samples']} samples with every rule and budget\n\n"
            + "\n".join(lines))


def per_sample_loglik(rows: List[Dict], tasks: Optional[Sequence[str]] = None) -> Dict[Tuple, Dict[int, float]]:
    """Rows of the perplexity tasks (or of `tasks`: the gold answer's teacher-forced log-likelihood; give
    rows of one protocol) as (length, task, rule, budget) -> sample index -> log-likelihood per token."""
    out: Dict[Tuple, Dict[int, float]] = defaultdict(dict)
    for r in rows:
        if (r["task"] in tasks if tasks is not None else r["task"].startswith("ppl_")) and r.get("gold_tokens"):
            out[r["length"], r["task"], r["rule"], r["budget"]][r["index"]] = r["gold_logprob"] / r["gold_tokens"]
    return out


def paired_difference(loglik: Dict[Tuple, Dict[int, float]], length: int, task: str, budget: str,
                      rule: str, other: str) -> Optional[Dict]:
    """`rule`'s log-likelihood per token minus `other`'s, paired over the samples both have (positive:
    `rule` better): mean, standard error and sample count; None under two samples (no error bar)."""
    ours, theirs = loglik.get((length, task, rule, budget), {}), loglik.get((length, task, other, budget), {})
    diffs = [ours[i] - theirs[i] for i in sorted(ours.keys() & theirs.keys())]
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    return {"length": length, "task": task, "budget": budget, "samples": len(diffs), "mean": mean,
            "stderr": sd / math.sqrt(len(diffs))}


def paired_answers(rows: List[Dict], length: int, protocol: str, budget: str, rule: str,
                   other: str) -> Optional[Dict]:
    """`rule`'s needle answers against `other`'s on the same prompts (every task scored by `correct`):
    the prompts only `rule` answered (won), those only `other` answered (lost), and the exact two-sided
    sign test on those discordant prompts (McNemar's exact test): the chance of a split at least this
    uneven if the two were equally good. None when they share no prompt."""
    got: Dict[str, Dict[Tuple, bool]] = defaultdict(dict)
    for r in rows:
        if (r["length"], r["protocol"], r["budget"]) == (length, protocol, budget) and r["rule"] in (rule, other) \
                and r.get("correct") is not None and not r["task"].startswith("ppl_"):
            got[r["rule"]][r["task"], r["index"]] = bool(r["correct"])
    ours, theirs = got.get(rule, {}), got.get(other, {})
    shared = ours.keys() & theirs.keys()
    if not shared:
        return None
    won = sum(ours[k] and not theirs[k] for k in shared)
    lost = sum(theirs[k] and not ours[k] for k in shared)
    n = won + lost
    tail = sum(math.comb(n, i) for i in range(min(won, lost) + 1)) / 2 ** n
    return {"length": length, "protocol": protocol, "budget": budget, "prompts": len(shared), "won": won,
            "lost": lost, "p_value": min(1.0, 2 * tail)}


def paired_table(diffs: List[Dict], length: int, task: str) -> str:
    """Markdown: one line per compared rule (`rule`), one column per budget, mean ± standard error
    (marked ᴺ when the compared row was a --protect none variant)."""
    sel = [d for d in diffs if d["length"] == length and d["task"] == task]
    if not sel:
        return ""
    budgets = sorted({d["budget"] for d in sel}, key=_budget_sort)
    cell = {(d["rule"], d["budget"]): d for d in sel}
    lines = ["| vs | " + " | ".join(f"b={b}" for b in budgets) + " |", "|" + "---|" * (len(budgets) + 1)]
    for rule in sorted({d["rule"] for d in sel}):
        vals = [f"{cell[rule, b]['mean']:+.3f} ± {cell[rule, b]['stderr']:.3f}"
                + ("ᴺ" if cell[rule, b].get("variant") == "none" else "") if (rule, b) in cell else ""
                for b in budgets]
        lines.append(f"| {rule} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _leading_number(text: str) -> str:
    digits = text.lstrip()
    n = len(digits) - len(digits.lstrip("0123456789"))
    return digits[:n]


def needle_table(rows: List[Dict], length: int) -> str:
    """Markdown: correct answers on the needle (niah_*) tasks per rule, budget and protocol, over the
    samples with every rule and budget; beside them, "cut short": single-needle answers that are a
    strict prefix of the needle's number (the full cache answered it), i.e. the rule kept the first
    digits but evicted the rest (SmolLM2 reads one token per digit)."""
    rows = complete_rows([r for r in rows if r["task"].startswith("niah_") and r["length"] == length])
    if not rows:
        return ""
    full = {(r["task"], r["index"], r["protocol"]): r for r in rows if r["rule"] == FULL}
    correct: Dict[Tuple, int] = defaultdict(int)
    cut: Dict[Tuple, int] = defaultdict(int)
    for r in rows:
        key = (r["protocol"], r["rule"], r["budget"])
        correct[key] += bool(r["correct"])
        f = full[(r["task"], r["index"], r["protocol"])]
        if r["task"].startswith("niah_single") and f["correct"] and not r["correct"]:
            got, needle = _leading_number(r["output"]), _leading_number(f["output"])
            cut[key] += bool(got) and len(got) < len(needle) and needle.startswith(got)
    protocols = sorted({r["protocol"] for r in rows})
    budgets = sorted({r["budget"] for r in rows if r["rule"] != FULL}, key=_budget_sort)
    rules = sorted({r["rule"] for r in rows if r["rule"] != FULL},
                   key=lambda rule: -sum(correct[(p, rule, b)] for p in protocols for b in budgets))
    samples = len({(r["task"], r["index"]) for r in rows})
    fulls = ", ".join(f"{p} {correct[(p, FULL, FULL)]}" for p in protocols)
    head = " | ".join(f"{p} b={' / '.join(budgets)}" for p in protocols)
    lines = [f"{samples} samples (full cache correct: {fulls}); each cell: correct (cut short)", "",
             f"| rule | {head} |", "|---|" + "---|" * len(protocols)]
    for rule in rules:
        cells = [" / ".join(f"{correct[(p, rule, b)]} ({cut[(p, rule, b)]})" for b in budgets)
                 for p in protocols]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _budget_sort(label: str):
    if label == FULL:
        return (2, 0.0)
    v = float(label)
    return (1, v) if "." in label else (0, v)


CSV_ROW_FIELDS = ["task", "length", "index", "protocol", "rule", "budget", "kept", "cache_len",
                  "prompt_tokens", "correct", "recall", "same_as_full", "agree", "gold_logprob",
                  "gold_tokens", "output", "extra_prefill_tokens", "extra_prefill_seconds"]


def samples_done(rows: List[Dict], rules: Sequence[str]) -> Dict[str, int]:
    """Per task/length: samples with a stored row for every given rule."""
    have: Dict[Tuple, set] = defaultdict(set)
    for r in rows:
        have[(r["task"], r["length"], r["index"])].add(r["rule"])
    out: Dict[str, int] = defaultdict(int)
    for (task, length, _), rs in have.items():
        if set(rules) | {FULL} <= rs:
            out[f"{task}/{length}"] += 1
    return dict(sorted(out.items()))


def write_outputs(out_dir: Path, cfg: EvalConfig, rows: List[Dict], extra: Dict) -> Dict:
    agg = aggregate(complete_rows(rows))
    settings = {**cfg.__dict__, "budgets": [budget_label(b) for b in cfg.budgets],
                "rule_definitions": {r: rule_definition(r) for r in cfg.rules if r in SCORERS}}
    if checkpoint_sha256(cfg.checkpoint):
        settings["checkpoint_weights_sha256"] = checkpoint_sha256(cfg.checkpoint)
    stale = sorted({r["rule"] for r in rows if "@" in r["rule"] or "[" in r["rule"]})  # variant_label
    results = {
        "settings": settings,
        "measured": {"samples_per_task_all_rules": samples_done(rows, reported_rules(rows, cfg.rules)),
                     "rows": len(rows), **({"stale_variants_reported": stale} if stale else {}),
                     **extra},
        "environment": numerics_environment(),
        "notes": ["perplexity task: both protocols coincide (no question), reported as query_aware",
                  "accuracy = every expected answer present in the greedy output (RULER exact match)",
                  "aggregates cover the samples that have every rule and budget (the same samples "
                  "for every rule); per_sample.csv.gz has every row",
                  "delta_logprob_per_token = teacher-forced log-likelihood of the gold answer per "
                  "token under the compressed cache minus the full cache (0 = no loss)",
                  f"protect={cfg.protect}: " + ("the 4 sink and 16 most recent tokens are always kept "
                                                "(the KVP paper's protocol)" if cfg.protect == "paper"
                                                else "no token is protected (each rule's own choice)"),
                  "rows record rule_def (the rule's definition) and protect; a rule reported as "
                  "name@vN (or name[protect=...]) has only rows of an older definition (or another "
                  "protect mode) in this folder: rerun kvp-eval to recompute it"],
        "aggregate": agg,
        "task_average": task_average(rows),
    }
    # The aggregated rows go to aggregate.csv only (results.json names it): the same numbers twice
    # would double the largest tracked result files. The returned dict carries them.
    write_json(out_dir / "results.json", {**results, "aggregate": "aggregate.csv"})
    write_csv(out_dir / "per_sample.csv.gz", rows, CSV_ROW_FIELDS)  # removes a plain per_sample.csv
    write_csv(out_dir / "aggregate.csv", agg)
    return results


# ---------------------------------------------------------------------------------------------
# Run


@dataclass
class _Folder:
    """One output folder of a run: its settings (one protect mode), stores and current rows."""
    cfg: EvalConfig
    path: Path
    store: Path
    log_path: Path
    have: Dict[Tuple, Dict]


def _open_folder(cfg: EvalConfig, out_dir: Path, kvp_sha: Optional[str]) -> _Folder:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / "run.json"
    with open(out_dir / ".lock", "w") as lock:  # processes sharing a new folder: one creates run.json
        fcntl.flock(lock, fcntl.LOCK_EX)
        if meta_path.exists():
            stored = stored_identity(out_dir)
            if stored != cfg.identity():
                raise SystemExit(f"error: {out_dir} holds a run with other settings {stored}"
                                 f" (now {cfg.identity()}); use another --out folder")
        else:
            meta_path.write_text(json.dumps({"identity": cfg.identity(), "started": time.time()}, indent=1))
    try:
        store, log_path = store_path(out_dir, "rows.jsonl"), store_path(out_dir, "progress.log")
    except MixedStore as e:
        raise SystemExit(f"error: {e}")
    # a stale row (another policy, rule definition or protect mode) counts as missing
    have = {row_key(r): r for r in read_rows(store) if is_current(r, kvp_sha, cfg.protect)}
    return _Folder(cfg, out_dir, store, log_path, have)


def parse_shard(text: str) -> Tuple[int, int]:
    """'K/N' -> (K, N): this process takes the sample indices i with i % N == K."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"a shard is K/N (e.g. 0/2); got {text!r}") from None
    if not 0 <= k < n:
        raise ValueError(f"a shard K/N needs 0 <= K < N; got {text!r}")
    return k, n


def run(cfg: EvalConfig, model, tokenizer, out_dir: Path, progress: bool = True,
        max_minutes: Optional[float] = None, log=print, plots: bool = True,
        also: Optional[Dict[str, Path]] = None, shard: Tuple[int, int] = (0, 1)) -> Dict:
    """Evaluate every missing row of cfg into out_dir; returns its results.

    also: {protect mode: folder}, more folders filled in the same pass (cfg with that mode): a sample
    computes what the modes share (prefill, full-cache answer, KVzip's reconstruction, scores) once:
    about 70% of a 2K sample's time (the stages in progress.log.gz).
    shard (K, N): only the sample indices i with i % N == K, so N processes can fill the same folders
    side by side (their rows are appended under a lock; whichever ends last reports every row)."""
    from tqdm import tqdm

    kvp_sha = checkpoint_sha256(cfg.checkpoint)
    modes = {cfg.protect: Path(out_dir), **(also or {})}
    folders = [_open_folder(replace(cfg, protect=mode), path, kvp_sha) for mode, path in modes.items()]
    renderer = Renderer(tokenizer)
    # Interleave tasks (sample index outermost) so an interrupted run covers every task evenly.
    plan = [(i, length, task) for i in range(cfg.samples) if i % shard[1] == shard[0]
            for length in cfg.lengths for task in cfg.tasks]
    timings: Dict[str, float] = defaultdict(float)
    scorer_cache: Dict = {}
    started = time.time()
    computed = 0
    bar = tqdm(plan, desc="kvp-eval", disable=not progress, dynamic_ncols=True)
    stopped_early = False
    for i, length, task in bar:
        bar.set_postfix_str(f"{task}/{length}#{i}")
        sample = make_sample(task, tokenizer, length, i, cfg.seed, renderer=renderer)
        want = wanted_keys(sample, cfg.rules, cfg.budgets, cfg.protocols)
        missing = {f.cfg.protect: [rule for rule, keys in want.items() if any(k not in f.have for k in keys)]
                   for f in folders}
        if not any(missing.values()):
            continue
        if max_minutes is not None and (time.time() - started) / 60 > max_minutes:
            stopped_early = True
            break
        full_keys = want[FULL]
        full_record = next((f.have[full_keys[0]] for f in folders if all(k in f.have for k in full_keys)), None)
        rules = [r for r in cfg.rules if any(r in m for m in missing.values())]
        # only the budgets some row lacks (e.g. a budget added to a finished folder): each budget's
        # caches run as their own batches, so the rows equal those of a pass over every budget
        lacking = {k[5] for f in folders for keys in want.values() for k in keys if k not in f.have}
        budgets = [b for b in cfg.budgets if budget_label(b) in lacking]
        new = evaluate_sample(model, tokenizer, sample, rules, budgets, cfg.protocols, cfg.checkpoint,
                              full_record, cfg.window, scorer_cache, timings,
                              protect=[mode for mode, m in missing.items() if m])
        computed += 1
        timings["samples"] += 1
        stages = {k: round(v) for k, v in timings.items()}
        for f in folders:
            if not missing[f.cfg.protect]:
                continue
            mine = [r for r in new if r.get("protect", f.cfg.protect) == f.cfg.protect and row_key(r) not in f.have]
            append_rows(f.store, mine)
            f.have.update((row_key(r), r) for r in mine)
            append_text(f.log_path, f"{time.strftime('%H:%M:%S')} {sample.key} "
                                    f"rules={','.join(missing[f.cfg.protect])} protect={','.join(modes)} "
                                    f"elapsed={time.time() - started:.0f}s stages={stages}\n")
    bar.close()
    elapsed = time.time() - started
    extra = {"this_invocation": {"samples_computed": computed, "seconds": round(elapsed, 1),
                                 "stopped_by_time_limit": stopped_early, "protect_modes": list(modes),
                                 "shard": list(shard),
                                 "seconds_by_stage": {k: round(v, 1) for k, v in timings.items()}}}
    results = [_report(f, kvp_sha, extra, plots, log) for f in folders]
    return results[0]


def _report(f: _Folder, kvp_sha: Optional[str], extra: Dict, plots: bool, log) -> Dict:
    # Another process (disjoint --tasks or another shard) may share the folder: under one lock, report
    # every stored row, so whichever process writes last writes the complete results.
    with open(f.path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in (f.store, f.log_path):
            compact(path)  # the per-sample gzip members as one (no-op for a plain file)
        rows = current_rows(read_rows(f.store), kvp_sha, f.cfg.protect)
        results = write_outputs(f.path, f.cfg, rows, extra)
        if plots:
            try:
                from .plots import plot_all
                plot_all(results["aggregate"], f.path, results["task_average"])
            except Exception as e:  # plots are a convenience; the numbers are already written
                log(f"warning: plotting failed: {e}")
    return results


def markdown_summary(agg: List[Dict], protocol: str, metric: str = "accuracy", digits: int = 2) -> str:
    """A markdown table: one line per (task, rule), one column per budget, the full cache beside."""
    rows = [a for a in agg if a["protocol"] == protocol and a.get(metric) is not None]
    budgets = sorted({a["budget"] for a in rows if a["rule"] != FULL}, key=_budget_sort)
    full = {(a["task"], a["length"]): a for a in rows if a["rule"] == FULL}
    lines = [f"| task | n | rule | " + " | ".join(f"b={b}" for b in budgets) + " | full |",
             "|" + "---|" * (len(budgets) + 4)]
    cells: Dict[Tuple, Dict[str, Dict]] = defaultdict(dict)
    for a in rows:
        if a["rule"] != FULL:
            cells[(a["task"], a["length"], a["rule"])][a["budget"]] = a
    for (task, length, rule), by_b in sorted(cells.items()):
        f = full.get((task, length))
        n = f["n"] if f else max(a["n"] for a in by_b.values())
        vals = [f"{by_b[b][metric]:.{digits}f}" if b in by_b else "" for b in budgets]
        lines.append(f"| {task} | {n} | {rule} | " + " | ".join(vals) +
                     f" | {f[metric]:.{digits}f} |" if f else " | |")
    return "\n".join(lines)
