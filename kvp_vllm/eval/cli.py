"""`kvp-eval`: compare eviction rules at equal cache budgets on RULER-style tasks.

Example (the committed 2K benchmark; resumable - rerun the same command to continue or to add KVP
once its checkpoint exists):
  python -m kvp_vllm.eval.cli --lengths 2K --samples 50 --budgets 64,128,256,512,1024 \
      --out benchmarks/results/eval_smollm2_2k

The folder's raw files are gzip-compressed (rows.jsonl.gz, per_sample.csv.gz, progress.log.gz; read
them with zcat); a folder from before that keeps its plain rows.jsonl until --compress-store.
--compress-store xz moves a large finished folder to xz (~30% smaller; read with xzcat; appending and
resuming work the same).

--protect paper (the default for a new folder) always keeps 4 sink + 16 recent tokens, the KVP paper's
protocol; --protect none keeps only what each rule chooses (kvpress's behaviour for the baselines). A
folder holds one mode (run.json); without --protect an existing folder continues with its own.
--protect paper,none --out PAPER_FOLDER,NONE_FOLDER fills both folders in one pass: the prefill, the
full-cache answer, KVzip's reconstruction and every rule's scores are computed once per sample (the
rows are the ones two separate runs make). --shard K/N takes the sample indices i with i % N == K, so N
processes (one thread each) can fill the same folders side by side:
  for K in 0 1; do python -m kvp_vllm.eval.cli --protect paper,none --out A,B --shard $K/2 ... & done
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

from ..scorers import SCORERS
from ..selection import DEFAULT_PROTECT, PROTECT_MODES, check_budget, protected_counts
from .protocol import PROTOCOLS
from .tasks import DEFAULT_TASKS, EVAL_SEED_LIMIT, TASKS, TaskError, parse_length


def default_checkpoint(model_name: str) -> Optional[Path]:
    """The packaged KVP checkpoint for the model, when one ships (kvp_vllm/checkpoints/<name>/)."""
    from ..assets import SMOLLM2_NAME
    from ..serving.config import shipped_checkpoint

    return shipped_checkpoint(SMOLLM2_NAME if model_name == "smollm2" else model_name)


def resolve_checkpoint(arg: Optional[str], model_name: str) -> Optional[str]:
    """--checkpoint: 'auto' = the packaged policy for the model (None when none ships), a folder
    (which must exist), or empty/None for no policy."""
    if arg == "auto":
        found = default_checkpoint(model_name)
        return str(found) if found else None
    if arg and not Path(arg).exists():
        raise ValueError(f"checkpoint {arg} does not exist")
    return arg or None


def load_model(model_name: str):
    """(model, tokenizer) in fp32, eval mode: 'smollm2' (the packaged asset, its weights verified) or
    a local Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_name == "smollm2":
        from ..assets import smollm2_path

        model_path = str(smollm2_path())  # verifies the converted weights (rebuilds them if corrupt)
    elif Path(model_name).exists():
        model_path = model_name
    else:
        raise ValueError(f"model folder {model_name} does not exist (use 'smollm2' or a local HF folder)")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, tokenizer


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_budgets(text: str, protect: str = DEFAULT_PROTECT) -> list:
    """Token counts (at least the protect mode's minimum budget) and fractions of the context."""
    out = []
    for t in _csv(text):
        try:
            v = float(t)
        except ValueError:
            raise ValueError(f"bad budget {t!r}: use token counts (256) or fractions of the context (0.25)")
        if v <= 0:
            raise ValueError(f"budgets must be positive; got {t}")
        if v < 1 or ("." in t and v == 1.0):
            out.append(v)  # a fraction of the compressed context
        else:
            if v != int(v):
                raise ValueError(f"an absolute budget must be a whole number of tokens; got {t}")
            out.append(check_budget(int(v), *protected_counts(protect), what="an absolute budget"))
    if not out:
        raise ValueError("no budgets given")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvp-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct from the local asset) or a HF model folder")
    p.add_argument("--tasks", default="all", help=f"comma list or 'all': {', '.join(TASKS)}")
    p.add_argument("--lengths", default="2K", help="target prompt lengths in tokens: 1K,2K,4K,8K or counts")
    p.add_argument("--samples", type=int, default=50, help="samples per task and length")
    p.add_argument("--budgets", default="64,128,256,512,1024",
                   help="tokens kept per KV head (ints) and/or fractions of the context (0.1)")
    p.add_argument("--rules", default="all",
                   help=f"comma list or 'all' (every rule; kvp only with a checkpoint): {', '.join(sorted(SCORERS))}")
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help="query_aware,query_agnostic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protect", default=None,
                   help="paper: always keep 4 sink + 16 recent tokens (the KVP paper's protocol); none: "
                        "nothing protected, each rule's own choice (kvpress's baselines); a comma list "
                        "(paper,none) fills one --out folder per mode in one pass. Default: the "
                        f"--out folder's mode, {DEFAULT_PROTECT} for a new folder")
    p.add_argument("--checkpoint", default="auto",
                   help="KVP checkpoint folder; 'auto' = the packaged one for the model if it exists")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results/eval_<model>); "
                                               "with several --protect modes, one folder per mode, commas")
    p.add_argument("--shard", default="0/1",
                   help="K/N: only the sample indices i with i %% N == K (N processes side by side)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new samples after this many minutes (rerun to continue)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared 2-core machine one thread per process "
                        "was 5-8x faster than two)")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite results/plots from stored rows and print markdown summary tables; "
                        "only the rows of the given --budgets (and the full cache) are reported, so a "
                        "folder whose new budgets are still being computed keeps reporting its finished ones")
    p.add_argument("--compress-store", nargs="?", const="gz", choices=("gz", "xz"), default=None,
                   help="migrate an --out folder once: compress its rows.jsonl, per_sample.csv and "
                        "progress.log with gzip (default) or xz (~30%% smaller, for large finished stores), "
                        "from plain or the other codec (checked to read back), and remove the old files; "
                        "nothing else runs")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    def fail(msg: str):
        parser.exit(2, f"kvp-eval: error: {msg}\n")

    if args.compress_store:
        from .store import MixedStore, compress_folder

        if not args.out or not Path(args.out).is_dir():
            fail("--compress-store needs --out FOLDER (an existing result folder)")
        try:
            done = compress_folder(args.out, to="." + args.compress_store)
        except MixedStore as e:
            fail(str(e))
        for name, before, after in done:
            print(f"{args.out}/{name}: {before} -> {after} bytes", file=sys.stderr)
        if not done:
            print(f"{args.out}: no raw file to compress with {args.compress_store}", file=sys.stderr)
        return 0
    from .runner import parse_shard, stored_identity

    outs = [Path(o) for o in _csv(args.out or f"benchmarks/results/eval_{Path(args.model).name}")]
    if args.protect is None:
        if len(outs) > 1:
            fail("several --out folders need one --protect mode each (e.g. --protect paper,none)")
        try:
            stored = stored_identity(outs[0])
        except ValueError as e:  # unreadable run.json
            fail(f"{outs[0]}/run.json: {e}")
        modes = [(stored or {}).get("protect") or DEFAULT_PROTECT]
    else:
        modes = _csv(args.protect)
        for m in modes:
            if m not in PROTECT_MODES:
                fail(f"unknown protect mode {m!r}; known: {', '.join(PROTECT_MODES)}")
        if len(set(modes)) != len(modes):
            fail(f"--protect names a mode twice: {args.protect}")
        if len(outs) != len(modes) or len({o.resolve() for o in outs}) != len(outs):
            fail(f"--protect {args.protect} needs {len(modes)} different --out folders, in the same order "
                 f"(got {len(outs)}: {args.out})")
    protect, out = modes[0], outs[0]
    try:
        tasks = list(DEFAULT_TASKS) if args.tasks == "all" else _csv(args.tasks)
        for t in tasks:
            if t not in TASKS:
                fail(f"unknown task {t!r}; known tasks: {', '.join(TASKS)}")
        lengths = [parse_length(x) for x in _csv(args.lengths)]
        for m in modes:  # every mode's minimum budget
            budgets = parse_budgets(args.budgets, m)
        shard = parse_shard(args.shard)
    except (TaskError, ValueError) as e:
        fail(str(e))
    if not 0 <= args.seed < EVAL_SEED_LIMIT:
        fail(f"--seed must be in [0, {EVAL_SEED_LIMIT}): larger seeds draw the training traces' prompts")
    if args.samples <= 0:
        fail(f"--samples must be positive; got {args.samples}")
    protocols = _csv(args.protocols)
    for p in protocols:
        if p not in PROTOCOLS:
            fail(f"unknown protocol {p!r}; known: {', '.join(PROTOCOLS)}")
    try:
        checkpoint = resolve_checkpoint(args.checkpoint, args.model)
    except ValueError as e:
        fail(str(e))
    if args.rules == "all":
        rules = [r for r in sorted(SCORERS) if r != "kvp"]
        if checkpoint:
            rules = ["kvp"] + rules
    else:
        rules = _csv(args.rules)
        for r in rules:
            if r not in SCORERS:
                fail(f"unknown rule {r!r}; known rules: {', '.join(sorted(SCORERS))}")
        if "kvp" in rules and not checkpoint:
            fail("the kvp rule needs a trained policy: pass --checkpoint FOLDER (none is packaged for "
                 f"{args.model} yet)")

    import torch
    from transformers import AutoConfig

    if args.model == "smollm2":
        from ..assets import smollm2_path
        model_path = str(smollm2_path(verify=False))  # checked (sha256) before loading the weights
    else:
        if not Path(args.model).exists():
            fail(f"model folder {args.model} does not exist (use 'smollm2' or a local HF folder)")
        model_path = args.model
    config = AutoConfig.from_pretrained(model_path)
    max_ctx = getattr(config, "max_position_embeddings", None)
    for length in lengths:
        if max_ctx and length > max_ctx:
            fail(f"length {length} is above the model's context of {max_ctx} tokens")

    from .runner import EvalConfig, checkpoint_sha256, current_rows, read_rows, run, write_outputs

    cfg = EvalConfig(tasks=tasks, lengths=lengths, samples=args.samples, budgets=budgets, rules=rules,
                     protocols=protocols, seed=args.seed, model=args.model, checkpoint=checkpoint,
                     protect=protect)
    if args.report_only:
        from dataclasses import replace

        from .plots import plot_all
        from .runner import FULL, budget_label, markdown_summary, needle_table, task_average_table
        from .store import MixedStore

        labels = {budget_label(b) for b in budgets}
        for mode, folder in zip(modes, outs):
            try:
                rows = current_rows(read_rows(folder / "rows.jsonl"), checkpoint_sha256(checkpoint),  # or .gz
                                    mode)
            except MixedStore as e:
                fail(str(e))
            if not rows:
                fail(f"no stored rows in {folder}")
            rows = [r for r in rows if r["rule"] == FULL or r["budget"] in labels]
            if not any(r["rule"] != FULL for r in rows):
                fail(f"no stored rows of budgets {args.budgets} in {folder}")
            res = write_outputs(folder, replace(cfg, protect=mode), rows, {"report_only": True})
            plot_all(res["aggregate"], folder, res["task_average"])
            if len(outs) > 1:
                print(f"\n## {folder} (protect {mode})")
            for protocol in protocols:
                for metric, d in (("accuracy", 2), ("delta_logprob_per_token", 2), ("perplexity", 1)):
                    table = markdown_summary(res["aggregate"], protocol, metric, d)
                    if table.count("\n") > 1:
                        print(f"\n### {metric}, {protocol}\n\n{table}")
                for length in lengths:
                    table = task_average_table(res["task_average"], protocol, length)
                    if table:
                        print(f"\n### task-averaged accuracy, {protocol}, {length} tokens\n\n{table}")
            for length in lengths:
                table = needle_table(rows, length)
                if table:
                    print(f"\n### needle tasks, {length} tokens\n\n{table}")
            print(f"\nrewrote results and plots in {folder}", file=sys.stderr)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    print(f"kvp-eval: {model_path} | tasks {','.join(tasks)} | lengths {lengths} | {args.samples} samples"
          f" | budgets {budgets} | rules full,{','.join(rules)} | {','.join(protocols)}"
          f" | protect {','.join(modes)} | out {','.join(map(str, outs))} | shard {shard[0]}/{shard[1]}",
          file=sys.stderr)
    t0 = time.time()
    res = run(cfg, model, tokenizer, out, progress=not args.no_progress, max_minutes=args.max_minutes,
              also=dict(zip(modes[1:], outs[1:])), shard=shard)
    print(f"kvp-eval: done in {time.time() - t0:.0f}s; samples with every rule: "
          f"{res['measured']['samples_per_task_all_rules']}; results in {','.join(map(str, outs))}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
