"""Needle-in-a-haystack demo on the real SmolLM2: one prompt answered with each eviction rule at a
budget, printing what each rule kept and whether the answer survived.

Protocol (the paper's): prefill everything but the last prompt token, compress the cache physically
(per-head gather, positions preserved), then feed the last token and decode greedily, so no
generated token ever sees an evicted entry.

    python -m kvp_vllm.demo --budget 128
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import List, Optional

import torch

from .capture import compact_cache, forward_capture
from .importance import future_importance
from .scorers import SCORERS, make_scorer
from .selection import check_budget, select_topb

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def needle_message(n_filler: int = 30, seed: int = 0):
    """A user message hiding one 5-digit pass key in repetitive filler; returns (text, key)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = rng.randint(n_filler // 4, 3 * n_filler // 4)
    parts = [FILLER] * n_filler
    parts.insert(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    text = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
            + "".join(parts) + "\n\nWhat is the pass key?")
    return text, key


def needle_prompt(tokenizer, n_filler: int = 30, seed: int = 0):
    """The needle message in the chat template, answer primed; returns (input_ids [1, n], key)."""
    user, key = needle_message(n_filler, seed)
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True) + "The pass key is"
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return ids, key


@torch.no_grad()
def greedy(model, cache, first_ids: torch.Tensor, start_pos: int, max_new: int, eos: Optional[int]):
    """Greedy decoding on top of a (possibly compacted) cache with logical positions."""
    out: List[int] = []
    ids = first_ids
    pos = start_pos
    for _ in range(max_new):
        n = ids.shape[1]
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(pos, pos + n)[None]).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        pos += n
        ids = torch.tensor([[nxt]])
    return out


def run(budget: int, rules: List[str], n_filler: int, seed: int, max_new: int = 12) -> List[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .assets import SMOLLM2_NAME, smollm2_path
    from .policy import KVPPolicy, ModelShape

    check_budget(budget)
    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids, key = needle_prompt(tok, n_filler, seed)
    n = ids.shape[1]
    eos = tok.eos_token_id
    print(f"prompt: {n} tokens, pass key {key}, budget {budget} tokens per KV head "
          f"({100 * min(budget, n - 1) / (n - 1):.0f}% of the context)")

    # every cached token's query when Expected Attention reads them all (the other rules read the last 64)
    query_last = max([64] + [SCORERS[r]().query_window for r in rules if r not in ("kvp", "random")])
    prefix = forward_capture(model, ids[:, :-1], query_last=min(query_last, n - 1))
    results = []

    # Full cache first: its answer also gives the oracle its future attention.
    full_cache = compact_cache(prefix.keys, prefix.values,
                               [torch.arange(n - 1).expand(k.shape[0], -1) for k in prefix.keys])
    answer_ids = greedy(model, full_cache, ids[:, -1:], n - 1, max_new, eos)
    importance = None
    if "oracle" in rules and answer_ids:
        seq = torch.cat([ids, torch.tensor([answer_ids])], dim=1)
        full = forward_capture(model, seq, query_last=len(answer_ids))
        importance = [future_importance(full.queries[l], full.keys[l], n - 1) for l in range(len(full.keys))]
    results.append(dict(rule="full", kept=n - 1, answer=tok.decode(answer_ids),
                        survived=key in tok.decode(answer_ids), ms=0.0))

    for rule in rules:
        if rule == "kvp":
            from .serving.config import shipped_checkpoint

            ckpt = shipped_checkpoint(SMOLLM2_NAME)
            if ckpt is None:
                print("kvp: no shipped SmolLM2 policy in this install (train one with `kvp-train`); skipped",
                      file=sys.stderr)
                continue
            scorer = make_scorer("kvp", policy=KVPPolicy.load(ckpt, expect=ModelShape.from_hf_config(model.config)))
        else:
            scorer = make_scorer(rule)
        start = time.perf_counter()
        reconstruction = None
        if rule == "kvzip":  # its context-reconstruction pass (an extra prefill; counted in ms)
            from .eval.protocol import KVzipPrompts, kvzip_reconstruction

            reconstruction, _ = kvzip_reconstruction(
                model, prefix.keys, prefix.values, ids[0, :-1].tolist(), KVzipPrompts.for_tokenizer(tok),
                n_sink=scorer.n_sink, chunk_size=scorer.chunk_size, prev_postfix_size=scorer.prev_postfix_size)
        kept = []
        for layer in range(len(prefix.keys)):
            kv = prefix.layer_kv(layer, future_importance=importance[layer] if importance else None)
            kv.reconstruction = None if reconstruction is None else reconstruction[layer]
            kept.append(select_topb(scorer.score(kv), budget))
        ms = 1000 * (time.perf_counter() - start)
        cache = compact_cache(prefix.keys, prefix.values, kept)
        out = tok.decode(greedy(model, cache, ids[:, -1:], n - 1, max_new, eos))
        # Which of the needle's tokens survived in layer 0, head 0 (a glimpse of what was kept).
        results.append(dict(rule=rule, kept=kept[0].shape[1], answer=out, survived=key in out, ms=ms,
                            first_kept=kept[0][0, 4:12].tolist()))
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=128, help="tokens kept per KV head (>= 20)")
    parser.add_argument("--rules", default=",".join(sorted(SCORERS)),
                        help="comma-separated rules (default: all)")
    parser.add_argument("--filler", type=int, default=30, help="filler sentences (prompt length)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = [r for r in rules if r not in SCORERS]
    if unknown:
        parser.error(f"unknown rule(s) {unknown}; known: {', '.join(sorted(SCORERS))}")
    try:
        check_budget(args.budget)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    results = run(args.budget, rules, args.filler, args.seed)
    print(f"\n{'rule':<18} {'kept/head':>9} {'select ms':>9}  survived  answer")
    for r in results:
        print(f"{r['rule']:<18} {r['kept']:>9} {r['ms']:>9.1f}  {'yes' if r['survived'] else 'no ':<8}  "
              f"{r['answer'].strip()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
