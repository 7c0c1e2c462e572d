"""Long-generation protocol: eviction *during decoding*, measured (issue 16).

The server compacts a request after its prefill once it holds more than `budget` tokens, and again
whenever it has grown `interval` tokens past the budget (kvp_vllm/serving/scheduler.py: whole blocks
are freed from the front, so it keeps budget <= b' < budget + block_size tokens per KV head). This
protocol replays exactly that schedule in Hugging Face transformers, for every rule at the same
budgets, on prompts of 1-2K tokens followed by >= 1,024 generated tokens:

- ``essay`` (continuation quality): an essay excerpt as the prompt; the teacher-forced log-likelihood,
  token by token, of a fixed continuation under each rule's evicted cache, against the full cache.
  Two continuations: ``model`` = the full cache's own greedy continuation (what the user gets without
  eviction; EOS suppressed so it is long enough; its full-cache log-likelihood is the reference) and
  ``text`` = the essay's true next tokens.
- ``recall`` (early context after a long generation): a document with one needle (a special magic
  number) and the request "Continue writing the text above."; the full cache's greedy continuation
  (>= 1,024 tokens) is teacher-forced as the assistant's answer, then, in the same sequence, a user
  turn asks for the number and the answer is decoded greedily. The schedule runs throughout: by the
  question, the cache has been re-compacted many times and the needle is ~1-2K tokens back.

Teacher forcing makes every rule see the same tokens, so the differences come from eviction alone (a
served request would generate its own tokens, which can only drift further). Feeding the tokens
between two compaction points as one chunk is exact: with nothing evicted in between, a causal chunk
equals one token at a time. Scoring is the server's (`scorers.score_held`, `selection.select_topb`
with the --protect counts); the query-aware rules see the queries the server captures: the last
`window` rows before each compaction (the prompt's last rows at the first).

Outputs (in --out, resumable like kvp-eval): rows.jsonl.gz (one row per sample, continuation, rule and
budget), results.json, summary.md and plots.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..capture import forward_capture, hf_rope
from ..scorers import SCORERS, SERVABLE_RULES, Scorer, score_held
from ..selection import DEFAULT_PROTECT, PROTECT_MODES, protected_counts, select_topb
from .runner import checkpoint_sha256, make_scorers
from .store import append_rows, compact, read_rows, store_path, write_csv, write_json
from .tasks import (NIAH_PREAMBLE, Renderer, _essay_stream, _Filler, _fit, _insert, _key, _number,
                    score_answers)

KINDS = ("essay", "recall")
FULL = "full"
#: The server's defaults (kvp_vllm/serving/config.py EvictionConfig.interval; vLLM's GPU block size).
DEFAULT_INTERVAL = 64
DEFAULT_BLOCK_SIZE = 16
WINDOW_TOKENS = 128  # log-likelihood is also reported per window of generated tokens (plots)
ANSWER_TOKENS = 12


# ---------------------------------------------------------------------------------------------
# The server's schedule


def compaction_schedule(n_prompt: int, total: int, budget: int, interval: int,
                        block_size: int) -> List[Tuple[int, int]]:
    """[(L, keep)]: before the token at position L is fed (the cache holds L tokens), the server
    compacts the request to `keep` tokens per KV head. Decode steps feed positions n_prompt..total-1.
    The same arithmetic as `SchedulerEviction.plan` (`freed_blocks_at`)."""
    from ..serving.scheduler import freed_blocks_at

    out: List[Tuple[int, int]] = []
    k_blocks = 0
    for L in range(n_prompt, total):
        inc = freed_blocks_at(L, k_blocks, L == n_prompt, budget, interval, block_size)
        if inc:
            k_blocks += inc
            out.append((L, L - k_blocks * block_size))
    return out


# ---------------------------------------------------------------------------------------------
# Replay


@dataclass
class Replay:
    """Per batch row (rule): log-probabilities of each forced token, whether it was the argmax, the
    greedy answer decoded after the forced tokens, and the compactions made."""

    logprobs: List[List[float]]
    top1: List[List[bool]]
    answers: List[List[int]] = field(default_factory=list)
    compactions: int = 0
    #: with record=True: [(L, kept logical positions [layers, B, H, keep])] (as the server's history)
    history: List[Tuple[int, torch.Tensor]] = field(default_factory=list)


def _dynamic_cache(keys: List[torch.Tensor], values: List[torch.Tensor]):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=list(zip(keys, values)))


@torch.no_grad()
def replay(model, prompt_ids: Sequence[int], forced_ids: Sequence[int], scorers: Sequence[Optional[Scorer]],
           budget: Optional[int], interval: int = DEFAULT_INTERVAL, block_size: int = DEFAULT_BLOCK_SIZE,
           protect: str = DEFAULT_PROTECT, window: int = 64, answer_tokens: int = 0,
           record: bool = False) -> Replay:
    """Prefill `prompt_ids`, then feed `forced_ids` (teacher forcing) and decode `answer_tokens` more
    greedily, one batch row per scorer, compacting every row as the server would at `budget` (None:
    never; the full cache, one row). Returns what `Replay` describes."""
    n, m = len(prompt_ids), len(forced_ids)
    bsz = len(scorers)
    n_sink, n_recent = protected_counts(protect)
    rope = hf_rope(model)  # Expected Attention un-rotates the captured queries
    schedule = {} if budget is None else dict(
        compaction_schedule(n, n + m + answer_tokens, budget, interval, block_size))
    cap = forward_capture(model, torch.as_tensor([list(prompt_ids)]), query_last=window, all_rows=True)
    keys = [k.expand(bsz, -1, -1, -1).contiguous() for k in cap.keys]      # [B, H, T, d] per layer
    values = [v.expand(bsz, -1, -1, -1).contiguous() for v in cap.values]
    queries = [q.expand(bsz, -1, -1, -1) for q in cap.queries]              # [B, Hq, W, d]
    # logical positions each layer, row and head holds: [layers, B, H, T]
    held = torch.arange(n).expand(len(keys), bsz, keys[0].shape[1], n)
    differ = [False] * bsz  # an earlier compaction kept a different set per head
    last_logits = cap.logits[:, -1].float().expand(bsz, -1)                  # [B, V]
    forced = torch.as_tensor(list(forced_ids), dtype=torch.long)
    lps: List[List[float]] = [[] for _ in range(bsz)]
    top1: List[List[bool]] = [[] for _ in range(bsz)]
    answers: List[List[int]] = [[] for _ in range(bsz)]
    compactions = 0
    history: List[Tuple[int, torch.Tensor]] = []
    L, i = n, 0

    def compact_all(keep: int) -> None:
        nonlocal keys, values, held, compactions
        new_k, new_v, new_held = [], [], []
        for li in range(len(keys)):
            kept_rows = []
            for r, scorer in enumerate(scorers):
                # each rule reads its own last query_window captured rows, as the worker's window_queries
                q = queries[li][r][:, -scorer.query_window:].float() if scorer.needs_queries else None
                scores = score_held(scorer, li, keys[li][r].float(), values[li][r].float(), held[li, r], q,
                                    heads_differ=differ[r], rope=rope)
                kept_rows.append(select_topb(scores, keep, n_sink, n_recent))
            kept = torch.stack(kept_rows)                                     # [B, H, keep] slots
            idx = kept[..., None].expand(-1, -1, -1, keys[li].shape[-1])
            new_k.append(keys[li].gather(2, idx))
            new_v.append(values[li].gather(2, idx))
            new_held.append(held[li].gather(2, kept))
        keys, values, held = new_k, new_v, torch.stack(new_held)
        if record:
            history.append((L, held.clone()))
        for r, scorer in enumerate(scorers):
            differ[r] = differ[r] or not scorer.one_set_for_all_heads
        compactions += 1

    def feed(tokens: torch.Tensor, capture: int):
        """Feed tokens [B, k] at positions L..L+k-1; returns logits [B, k, V] and extends the state."""
        nonlocal keys, values, held, queries, L
        k = tokens.shape[1]
        cache = _dynamic_cache(keys, values)
        out = forward_capture(model, tokens, cache=cache, query_last=capture, all_rows=True, logits_to_keep=0,
                              position_ids=torch.arange(L, L + k)[None].expand(tokens.shape[0], -1))
        keys, values = list(out.keys), list(out.values)
        new_pos = torch.arange(L, L + k).expand(*held.shape[:3], k)
        held = torch.cat([held, new_pos], dim=3)
        if capture:
            # the server captures the rows before the next compaction only; older rows roll out
            queries = [torch.cat([old, new], dim=2)[:, :, -window:] for old, new in zip(queries, out.queries)]
        L += k
        return out.logits.float()

    while i < m:
        if L in schedule:
            compact_all(schedule[L])
            queries = [q[:, :, :0] for q in queries]  # the next compaction sees fresh queries only
        nxt = min((x for x in schedule if x > L), default=L + m)
        j = min(m, i + (nxt - L))
        logp = torch.log_softmax(torch.cat([last_logits[:, None], feed(
            forced[i:j][None].expand(bsz, -1), window)], dim=1), dim=-1)       # [B, j-i+1, V]
        target = forced[i:j]
        got = logp[:, :-1].gather(2, target[None, :, None].expand(bsz, -1, 1))[..., 0]
        best = logp[:, :-1].argmax(-1) == target[None]
        for r in range(bsz):
            lps[r].extend(got[r].tolist())
            top1[r].extend(best[r].tolist())
        last_logits = logp[:, -1]
        i = j
    for _ in range(answer_tokens):
        tok = last_logits.argmax(-1)
        for r in range(bsz):
            answers[r].append(int(tok[r]))
        if L in schedule:
            compact_all(schedule[L])
            queries = [q[:, :, :0] for q in queries]
        last_logits = feed(tok[:, None], window)[:, -1]
    return Replay(logprobs=lps, top1=top1, answers=answers, compactions=compactions, history=history)
    return Replay(logprobs=lps, top1=top1, answers=answers, compactions=compactions, history=history)


@torch.no_grad()
def greedy_continuation(model, prompt_ids: Sequence[int], tokens: int, banned: Sequence[int] = ()) -> List[int]:
    """The full cache's greedy continuation of `tokens` tokens, never choosing a `banned` token (EOS:
    the protocol needs a long generation, and a 135M model often stops early)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    x = torch.as_tensor([list(prompt_ids)])
    pos = 0
    out: List[int] = []
    ban = torch.as_tensor(sorted(set(banned)), dtype=torch.long)
    while len(out) < tokens:
        logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1,
                       position_ids=torch.arange(pos, pos + x.shape[1])[None]).logits[0, -1]
        pos += x.shape[1]
        if len(ban):
            logits[ban] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        x = torch.tensor([[tok]])
    return out


# ---------------------------------------------------------------------------------------------
# Samples


@dataclass
class LongSample:
    kind: str
    index: int
    prompt_ids: List[int]
    text_continuation: List[int] = field(default_factory=list)  # essay: the true next tokens
    bridge_ids: List[int] = field(default_factory=list)         # recall: the question turn
    answers: List[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.index}"


def make_long_sample(kind: str, tokenizer, prompt_tokens: int, generate: int, index: int,
                     seed: int = 0, renderer: Optional[Renderer] = None) -> LongSample:
    """Sample `index` of `kind`: deterministic in (kind, prompt_tokens, generate, index, seed)."""
    rng = random.Random(f"kvp-eval-longgen/{seed}/{kind}/{prompt_tokens}/{generate}/{index}")
    if kind == "essay":
        stream = _essay_stream(id(tokenizer), tokenizer)
        if prompt_tokens + generate > len(stream):
            raise ValueError(f"the essays hold {len(stream)} tokens; cannot take {prompt_tokens} + {generate}")
        start = rng.randrange(len(stream) - prompt_tokens - generate)
        return LongSample(kind, index, list(stream[start:start + prompt_tokens]),
                          text_continuation=list(stream[start + prompt_tokens:start + prompt_tokens + generate]))
    if kind != "recall":
        raise ValueError(f"unknown long-generation kind {kind!r}; known: {', '.join(KINDS)}")
    r = renderer or Renderer(tokenizer)
    key, number = _key(rng, set()), _number(rng)
    needle = f"One of the special magic numbers for {key} is: {number}."
    filler = _Filler("essay", rng)
    depth_seed = rng.random()

    def build(k):
        units = _insert(filler.take(k), [needle], random.Random(depth_seed))
        return r.split(NIAH_PREAMBLE + " ".join(units) + "\n", "\nContinue writing the text above.", "")

    _, c, q = _fit(build, prompt_tokens)
    question = f"What is the special magic number for {key} mentioned in the provided text?"
    prefix = f"The special magic number for {key} mentioned in the provided text is"
    if r.chat:  # close the assistant's long answer, ask in a new user turn, open the answer
        turn = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
             {"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        bridge = turn[turn.index("y") + 1:] + prefix
    else:
        bridge = f"\n\n{question}\n{prefix}"
    return LongSample(kind, index, c + q, bridge_ids=r.ids(bridge), answers=[number])


# ---------------------------------------------------------------------------------------------
# One sample: every rule and budget


@dataclass
class LongGenConfig:
    kinds: List[str]
    samples: int
    budgets: List[int]
    rules: List[str]
    prompt_tokens: int = 1536
    generate: int = 1024
    interval: int = DEFAULT_INTERVAL
    block_size: int = DEFAULT_BLOCK_SIZE
    protect: str = DEFAULT_PROTECT
    seed: int = 0
    model: str = "smollm2"
    checkpoint: Optional[str] = None
    window: int = 64

    def identity(self) -> Dict:
        """Settings that must not change when a run is resumed in the same folder."""
        return {"model": self.model, "seed": self.seed, "prompt_tokens": self.prompt_tokens,
                "generate": self.generate, "interval": self.interval, "block_size": self.block_size,
                "protect": self.protect, "window": self.window}


def _windows(values: Sequence[float], size: int = WINDOW_TOKENS) -> List[float]:
    return [float(sum(values[s:s + size])) for s in range(0, len(values), size)]


def _row(base: Dict, target: str, rule: str, budget, lps: List[float], top1: List[bool], **extra) -> Dict:
    return dict(base, target=target, rule=rule, budget=budget, tokens=len(lps), logprob=float(sum(lps)),
                logprob_windows=_windows(lps), top1=int(sum(top1)), top1_windows=_windows(top1), **extra)


def row_key(r: Dict) -> Tuple:
    return (r["kind"], r["index"], r["target"], r["rule"], str(r["budget"]))


@torch.no_grad()
def evaluate_long_sample(model, tokenizer, sample: LongSample, cfg: LongGenConfig, scorers: Dict[str, Scorer],
                         stamp: Dict[str, Dict], have: Dict[Tuple, Dict],
                         timings: Dict[str, float]) -> List[Dict]:
    """Rows of one sample that `have` lacks: the full cache once per continuation, then every
    missing rule at each budget in one batch (every rule keeps the same count at every step)."""
    base = {"kind": sample.kind, "index": sample.index, "prompt_tokens": len(sample.prompt_ids)}
    eos = {t for t in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None))
           if isinstance(t, int)}
    rows: List[Dict] = []
    t0 = time.perf_counter()
    model_key = (sample.kind, sample.index, "model", FULL, FULL)
    if model_key in have:
        generated = list(have[model_key]["continuation_ids"])
    else:
        generated = greedy_continuation(model, sample.prompt_ids, cfg.generate, banned=sorted(eos))
    timings["generate"] += time.perf_counter() - t0
    targets = {"model": generated}
    if sample.kind == "essay":
        targets["text"] = sample.text_continuation
    answer_tokens = ANSWER_TOKENS if sample.kind == "recall" else 0

    def answer_fields(ids: List[int]) -> Dict:
        if not answer_tokens:
            return {}
        text = tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
        return {"output": text, "correct": score_answers(text, sample.answers)[0]}

    for target, cont in targets.items():
        forced = cont + (sample.bridge_ids if sample.kind == "recall" else [])
        fkey = (sample.kind, sample.index, target, FULL, FULL)
        if fkey not in have:
            t0 = time.perf_counter()
            rep = replay(model, sample.prompt_ids, forced, [None], None, answer_tokens=answer_tokens)
            timings["full_replay"] += time.perf_counter() - t0
            extra = {"continuation_ids": cont} if target == "model" else {}
            rows.append(_row(base, target, FULL, FULL, rep.logprobs[0][:len(cont)], rep.top1[0][:len(cont)],
                             compactions=0, **answer_fields(rep.answers[0] if rep.answers else []), **extra))
        for budget in cfg.budgets:
            names = [n for n in scorers if (sample.kind, sample.index, target, n, str(budget)) not in have]
            if not names:
                continue
            t0 = time.perf_counter()
            rep = replay(model, sample.prompt_ids, forced, [scorers[n] for n in names], budget,
                         interval=cfg.interval, block_size=cfg.block_size, protect=cfg.protect,
                         window=cfg.window, answer_tokens=answer_tokens)
            timings["compressed_replay"] += time.perf_counter() - t0
            for r, name in enumerate(names):
                rows.append(_row(base, target, name, budget, rep.logprobs[r][:len(cont)], rep.top1[r][:len(cont)],
                                 compactions=rep.compactions,
                                 **answer_fields(rep.answers[r] if rep.answers else []), **stamp[name]))
    return rows


# ---------------------------------------------------------------------------------------------
# Aggregation and reports


def is_current(r: Dict, kvp_sha: Optional[str]) -> bool:
    from ..scorers import rule_definition

    if r["rule"] == FULL:
        return True
    if r["rule"] in SCORERS and r.get("rule_def") != rule_definition(r["rule"]):
        return False
    return r["rule"] != "kvp" or r.get("checkpoint_sha256") == kvp_sha


def aggregate(rows: List[Dict]) -> List[Dict]:
    """Per (kind, target, rule, budget), over the samples that have every rule and budget: the mean
    change in log-likelihood per generated token against the full cache (0 = no loss; the full row's
    own value for rule full), per window of generated tokens too, top-1 agreement with the forced
    token, and the recall accuracy."""
    newest = {row_key(r): r for r in rows}
    rows = list(newest.values())
    combos: Dict[Tuple, set] = defaultdict(set)
    got: Dict[Tuple, set] = defaultdict(set)
    for r in rows:
        combos[(r["kind"], r["target"])].add((r["rule"], str(r["budget"])))
        got[(r["kind"], r["target"], r["index"])].add((r["rule"], str(r["budget"])))
    full = {(r["kind"], r["target"], r["index"]): r for r in rows if r["rule"] == FULL}
    groups: Dict[Tuple, List[Dict]] = defaultdict(list)
    for r in rows:
        if got[(r["kind"], r["target"], r["index"])] == combos[(r["kind"], r["target"])]:
            groups[(r["kind"], r["target"], r["rule"], str(r["budget"]))].append(r)
    out = []
    for (kind, target, rule, budget), rs in sorted(groups.items()):
        tokens = sum(r["tokens"] for r in rs)
        lp = sum(r["logprob"] for r in rs) / tokens
        f = [full[(kind, target, r["index"])] for r in rs]
        delta = lp - sum(x["logprob"] for x in f) / sum(x["tokens"] for x in f)
        n_win = min(len(r["logprob_windows"]) for r in rs)
        win_tokens = [sum(min(WINDOW_TOKENS, r["tokens"] - w * WINDOW_TOKENS) for r in rs) for w in range(n_win)]
        win_delta = [(sum(r["logprob_windows"][w] for r in rs) - sum(x["logprob_windows"][w] for x in f))
                     / win_tokens[w] for w in range(n_win)]
        a = {"kind": kind, "target": target, "rule": rule, "budget": budget, "n": len(rs),
             "logprob_per_token": lp, "delta_logprob_per_token": delta, "perplexity": math.exp(-lp),
             "top1_agreement": sum(r["top1"] for r in rs) / tokens,
             "delta_logprob_per_window": win_delta, "window_tokens": WINDOW_TOKENS,
             "compactions": sum(r["compactions"] for r in rs) / len(rs)}
        if any("correct" in r for r in rs):
            a["accuracy"] = sum(bool(r.get("correct")) for r in rs) / len(rs)
        out.append(a)
    return out


def summary_markdown(agg: List[Dict]) -> str:
    """Tables: Δ log-likelihood per token (and top-1 agreement) per continuation; recall accuracy."""
    parts = []
    budgets = sorted({a["budget"] for a in agg if a["rule"] != FULL}, key=int)
    for kind, target in sorted({(a["kind"], a["target"]) for a in agg}):
        cells = [a for a in agg if a["kind"] == kind and a["target"] == target]
        by_rule: Dict[str, Dict[str, Dict]] = defaultdict(dict)
        for a in cells:
            by_rule[a["rule"]][a["budget"]] = a
        full = by_rule.pop(FULL, {}).get(FULL)
        n = cells[0]["n"]
        metric = "accuracy" if kind == "recall" else "delta_logprob_per_token"
        title = ("recall accuracy after the long generation" if kind == "recall" else
                 f"Δ log-likelihood per token vs the full cache ({target} continuation; 0 = no loss)")
        lines = [f"#### {kind} / {target}: {title}, {n} samples", "",
                 "| rule | " + " | ".join(f"b={b}" for b in budgets) + " | top-1 agreement |",
                 "|---|" + "---|" * (len(budgets) + 1)]
        key = (lambda item: -sum(item[1][b][metric] for b in budgets if b in item[1]))
        for rule, by_b in sorted(by_rule.items(), key=key):
            vals = [f"{by_b[b][metric]:+.3f}" if metric != "accuracy" else f"{by_b[b][metric]:.2f}"
                    for b in budgets if b in by_b]
            agree = " / ".join(f"{by_b[b]['top1_agreement']:.3f}" for b in budgets if b in by_b)
            lines.append(f"| {rule} | " + " | ".join(vals) + f" | {agree} |")
        if full:
            ref = (f"full cache: accuracy {full['accuracy']:.2f}" if kind == "recall" else
                   f"full cache: {full['logprob_per_token']:.3f} nats/token (perplexity {full['perplexity']:.2f})")
            lines += ["", ref]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot(agg: List[Dict], out_dir: Path) -> List[Path]:
    """Per (kind, target) and budget: Δ log-likelihood per token along the generation (windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from .plots import save_png

    paths = []
    budgets = sorted({a["budget"] for a in agg if a["rule"] != FULL}, key=int)
    for kind, target in sorted({(a["kind"], a["target"]) for a in agg}):
        fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4), squeeze=False)
        for ax, b in zip(axes[0], budgets):
            for a in sorted((a for a in agg if (a["kind"], a["target"], a["budget"]) == (kind, target, b)),
                            key=lambda a: a["rule"]):
                xs = [(w + 0.5) * a["window_tokens"] for w in range(len(a["delta_logprob_per_window"]))]
                ax.plot(xs, a["delta_logprob_per_window"], marker="o", ms=3, label=a["rule"],
                        lw=2.5 if a["rule"] == "kvp" else 1.2)
            ax.axhline(0, color="black", lw=0.8)
            ax.set_title(f"{kind}/{target}, budget {b}")
            ax.set_xlabel("generated token")
            ax.set_ylabel("Δ log-likelihood / token vs full")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"longgen_{kind}_{target}.png"
        save_png(fig, path)
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(out_dir: Path, cfg: LongGenConfig, rows: List[Dict], extra: Dict) -> Dict:
    agg = aggregate(rows)
    results = {"settings": {**cfg.__dict__}, "measured": {"rows": len(rows), **extra},
               "notes": ["delta_logprob_per_token: teacher-forced log-likelihood per generated token under "
                         "the rule's evicted cache minus the full cache's (0 = no loss), over the samples "
                         "that have every rule and budget",
                         "model continuation = the full cache's greedy continuation (EOS suppressed); "
                         "text continuation = the essay's true next tokens",
                         "recall: the needle's number in the greedy answer after the long generation and "
                         "the question turn (teacher-forced), the server's schedule running throughout",
                         f"schedule: compaction after the prompt, then whenever the request holds more than "
                         f"budget + {cfg.interval} tokens, whole blocks of {cfg.block_size} freed"],
               "aggregate": agg}
    write_json(out_dir / "results.json", results)
    fields = ["kind", "index", "target", "rule", "budget", "tokens", "logprob", "top1", "compactions",
              "correct", "output", "prompt_tokens"]
    write_csv(out_dir / "per_sample.csv.gz", rows, fields)
    (out_dir / "summary.md").write_text(summary_markdown(agg) + "\n")
    return results


def run(cfg: LongGenConfig, model, tokenizer, out_dir: Path, progress: bool = True,
        max_minutes: Optional[float] = None, plots: bool = True) -> Dict:
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    meta = out_dir / "run.json"
    if meta.exists():
        stored = json.loads(meta.read_text()).get("identity")
        if stored != cfg.identity():
            raise SystemExit(f"error: {out_dir} holds a run with other settings {stored} (now "
                             f"{cfg.identity()}); use another --out folder")
    else:
        meta.write_text(json.dumps({"identity": cfg.identity(), "started": time.time()}, indent=1))
    store = store_path(out_dir, "rows.jsonl")
    kvp_sha = checkpoint_sha256(cfg.checkpoint)
    have = {row_key(r): r for r in read_rows(store) if is_current(r, kvp_sha)}
    scorer_cache: Dict = {}
    timings: Dict[str, float] = defaultdict(float)
    renderer = Renderer(tokenizer)
    started = time.time()
    plan = [(i, kind) for i in range(cfg.samples) for kind in cfg.kinds]
    computed, stopped = 0, False
    for i, kind in tqdm(plan, desc="kvp-eval longgen", disable=not progress, dynamic_ncols=True):
        if max_minutes is not None and (time.time() - started) / 60 > max_minutes:
            stopped = True
            break
        sample = make_long_sample(kind, tokenizer, cfg.prompt_tokens, cfg.generate, i, cfg.seed, renderer)
        scorers = make_scorers(cfg.rules, SimpleNamespace(seed=cfg.seed, index=i), cfg.checkpoint,
                               scorer_cache)
        stamp = {n: {"rule_def": sc.definition, "protect": cfg.protect} for n, sc in scorers.items()}
        if "kvp" in stamp:
            stamp["kvp"]["checkpoint_sha256"] = kvp_sha
        new = evaluate_long_sample(model, tokenizer, sample, cfg, scorers, stamp, have, timings)
        if new:
            append_rows(store, new)
            for r in new:
                have[row_key(r)] = r
            computed += 1
    compact(store)
    rows = [r for r in read_rows(store) if is_current(r, kvp_sha)]
    extra = {"this_invocation": {"samples_computed": computed, "seconds": round(time.time() - started, 1),
                                 "stopped_by_time_limit": stopped,
                                 "seconds_by_stage": {k: round(v, 1) for k, v in timings.items()}}}
    results = write_outputs(out_dir, cfg, rows, extra)
    if plots:
        plot(results["aggregate"], out_dir)
    return results


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvp-eval-longgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a HF model folder")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list: {', '.join(KINDS)}")
    p.add_argument("--samples", type=int, default=8, help="samples per kind")
    p.add_argument("--prompt-tokens", type=int, default=1536, help="prompt length (1-2K in the protocol)")
    p.add_argument("--generate", type=int, default=1024, help="generated tokens after the prompt")
    p.add_argument("--budgets", default="256,512", help="tokens kept per KV head")
    p.add_argument("--rules", default="all", help=f"comma list or 'all' (every servable rule; kvp with a "
                                                 f"checkpoint): {', '.join(SERVABLE_RULES)}")
    p.add_argument("--interval", type=int, default=DEFAULT_INTERVAL,
                   help="re-compaction interval (the server's --kv-evict-interval default)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="KV block size (vLLM's GPU default)")
    p.add_argument("--protect", choices=list(PROTECT_MODES), default=DEFAULT_PROTECT)
    p.add_argument("--checkpoint", default="auto", help="KVP checkpoint folder; 'auto' = the packaged one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/longgen_smollm2")
    p.add_argument("--max-minutes", type=float, default=None, help="stop starting new samples after this")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--report-only", action="store_true", help="rewrite results/plots from stored rows")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from .cli import _csv, load_model, parse_budgets, resolve_checkpoint

    parser = build_parser()
    args = parser.parse_args(argv)

    def fail(msg: str):
        parser.exit(2, f"kvp-eval-longgen: error: {msg}\n")

    kinds = _csv(args.kinds)
    for k in kinds:
        if k not in KINDS:
            fail(f"unknown kind {k!r}; known: {', '.join(KINDS)}")
    try:
        budgets = parse_budgets(args.budgets, args.protect)
        checkpoint = resolve_checkpoint(args.checkpoint, args.model)
    except ValueError as e:
        fail(str(e))
    if any(isinstance(b, float) for b in budgets):
        fail("long-generation budgets are token counts (the server's budgets)")
    for name, v in (("--samples", args.samples), ("--interval", args.interval), ("--block-size", args.block_size),
                    ("--generate", args.generate), ("--prompt-tokens", args.prompt_tokens)):
        if v < 1:
            fail(f"{name} must be positive; got {v}")
    if args.rules == "all":
        rules = [r for r in SERVABLE_RULES if r != "kvp"]
        rules = (["kvp"] if checkpoint else []) + rules
    else:
        rules = _csv(args.rules)
        for r in rules:
            if r not in SERVABLE_RULES:
                fail(f"unknown or unservable rule {r!r}; servable rules: {', '.join(SERVABLE_RULES)}")
        if "kvp" in rules and not checkpoint:
            fail("the kvp rule needs a trained policy: pass --checkpoint FOLDER")
    cfg = LongGenConfig(kinds=kinds, samples=args.samples, budgets=budgets, rules=rules,
                        prompt_tokens=args.prompt_tokens, generate=args.generate, interval=args.interval,
                        block_size=args.block_size, protect=args.protect, seed=args.seed, model=args.model,
                        checkpoint=checkpoint)
    windows = [SCORERS[r]().query_window for r in rules if r not in ("kvp", "random")]
    cfg.window = max([64] + windows)
    out = Path(args.out)
    if args.report_only:
        rows = [r for r in read_rows(store_path(out, "rows.jsonl")) if is_current(r, checkpoint_sha256(checkpoint))]
        if not rows:
            fail(f"no stored rows in {out}")
        res = write_outputs(out, cfg, rows, {"report_only": True})
        plot(res["aggregate"], out)
        print(summary_markdown(res["aggregate"]))
        return 0
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    print(f"kvp-eval-longgen: {args.model} | kinds {','.join(kinds)} | {args.samples} samples | prompt "
          f"{args.prompt_tokens} + {args.generate} generated | budgets {budgets} | rules {','.join(rules)} | "
          f"interval {args.interval} | block {args.block_size} | protect {args.protect} | out {out}", file=sys.stderr)
    res = run(cfg, model, tokenizer, out, progress=not args.no_progress, max_minutes=args.max_minutes)
    print(summary_markdown(res["aggregate"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
