"""`kvp-train`: collect traces, fit a KVP policy, evaluate it against the baselines.

  kvp-train collect --model smollm2 --out ~/.cache/kvp-vllm/traces/smollm2
  kvp-train fit --traces ~/.cache/kvp-vllm/traces/smollm2 --out runs/kvp-smollm2
  kvp-train evaluate --traces ~/.cache/kvp-vllm/traces/smollm2 --checkpoint runs/kvp-smollm2 \
      --out benchmarks/results/train_heldout_cost.json

Until the console script is registered in setup.py: python -m kvp_vllm.training.cli ...
Multi-GPU / multi-node: torchrun --nproc_per_node N -m kvp_vllm.training.cli fit ...
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def _ints(s: str):
    return tuple(int(x) for x in s.split(",") if x)


def _strs(s: str):
    return tuple(x for x in s.split(",") if x)


def build_parser() -> argparse.ArgumentParser:
    from .collect import COMPRESS_POINTS, FUTURES, CollectConfig
    from .trainer import FitConfig

    p = argparse.ArgumentParser(prog="kvp-train", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 is fastest on a shared 2-core machine)")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = CollectConfig()
    c = sub.add_parser("collect", help="run a model on prompts + greedy answers; store keys, values, "
                                       "future importance by layer")
    c.add_argument("--model", default=d.model, help="'smollm2', a tiny test model, or an HF model folder")
    c.add_argument("--out", required=True, help="trace folder (resumable; keep it out of git)")
    c.add_argument("--lengths", type=_ints, default=d.lengths, help="prompt lengths, comma separated")
    c.add_argument("--num-traces", type=int, default=d.num_traces)
    c.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
    c.add_argument("--window", type=int, default=d.window, help="last prompt queries kept (TOVA/SnapKV eval)")
    c.add_argument("--decode-tokens", type=int, default=d.decode_tokens,
                   help="first let the model write this many tokens of its own (greedy, EOS banned) and "
                        "store the cache mid-generation: prompt + own text (decode-time training data)")
    c.add_argument("--future", choices=FUTURES, default=d.future,
                   help="whose queries define importance: the model's own greedy answer (the paper), or the "
                        "harness task's reference continuation teacher-forced (essay text, canonical answer)")
    c.add_argument("--compress-at", choices=COMPRESS_POINTS, default=d.compress_at,
                   help="where the stored cache ends: the whole prompt (query-aware), or the harness task's "
                        "context before its question (query-agnostic; the question's queries join the future)")
    c.add_argument("--tasks", type=_strs, default=d.tasks)
    c.add_argument("--seed", type=int, default=d.seed)
    c.add_argument("--traces-per-shard", type=int, default=d.traces_per_shard)
    c.add_argument("--max-disk-gb", type=float, default=d.max_disk_gb)
    c.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    c.add_argument("--device", default=d.device)
    c.add_argument("--no-progress", action="store_true")

    f = sub.add_parser("fit", help="train a policy on collected traces")
    f.add_argument("--traces", required=True, help="trace folder, or several comma separated (one "
                                                   "set; each folder keeps its own train/val/test split)")
    f.add_argument("--out", required=True, help="checkpoint folder (config.json + policy.safetensors)")
    for name, fld in FitConfig.__dataclass_fields__.items():
        if name in ("traces", "out", "arch", "reference", "cache_traces"):
            continue
        default = fld.default
        kind = type(default) if default is not None else str
        f.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    f.add_argument("--reference", action="store_true", help="the paper's reference widths")
    f.add_argument("--arch", type=json.loads, default={}, help='PolicyConfig overrides as JSON, e.g. '
                                                            '\'{"hidden_dim": 128}\'')
    f.add_argument("--no-cache-traces", action="store_true")
    f.add_argument("--no-progress", action="store_true")

    e = sub.add_parser("evaluate", help="held-out normalised cost of KVP and every baseline")
    e.add_argument("--traces", required=True, help="trace folder, or several comma separated")
    e.add_argument("--checkpoint", default=None, help="KVP policy folder (omit: baselines only)")
    e.add_argument("--split", default="test", choices=["test", "val", "train", "all"])
    e.add_argument("--max-traces", type=int, default=0)
    e.add_argument("--lengths", type=_ints, default=None,
                   help="only traces collected at these target lengths (e.g. 4096,8192)")
    e.add_argument("--out", default=None, help="JSON file (a .md table is written beside it)")
    e.add_argument("--show-layers", type=_ints, default=None)
    e.add_argument("--no-progress", action="store_true")

    g = sub.add_parser("plot", help="redraw a fit's loss / normalised-cost plot from its log "
                                    "(train_log.jsonl or .jsonl.gz)")
    g.add_argument("log", help="train log, e.g. kvp_vllm/checkpoints/*/train_log_stage5.jsonl.gz")
    g.add_argument("--out", required=True, help="PNG file to write")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command = "kvp-train " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from ..policy import CheckpointError
    from .collect import CollectConfig, TraceError

    try:
        if args.cmd == "collect":
            from .collect import collect

            cfg = CollectConfig(model=args.model, lengths=args.lengths, num_traces=args.num_traces,
                                answer_tokens=args.answer_tokens, window=args.window, tasks=args.tasks,
                                decode_tokens=args.decode_tokens, future=args.future,
                                compress_at=args.compress_at,
                                seed=args.seed, traces_per_shard=args.traces_per_shard,
                                max_disk_gb=args.max_disk_gb, dtype=args.dtype, device=args.device)
            out = collect(cfg, args.out, progress=not args.no_progress)
            print(f"traces in {out}")
        elif args.cmd == "fit":
            from .trainer import FitConfig, fit

            kw = {k: getattr(args, k) for k in FitConfig.__dataclass_fields__ if hasattr(args, k)}
            kw["cache_traces"] = not args.no_cache_traces
            out = fit(FitConfig(**kw), progress=not args.no_progress, command=command)
            if out is not None:
                print(f"policy in {out}")
        elif args.cmd == "evaluate":
            evaluate_cmd(args, command)
        elif args.cmd == "plot":
            from .trainer import plot_log

            plot_log(Path(args.log), Path(args.out))
            print(f"plot in {args.out}")
    except (TraceError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"kvp-train: error: {e}", file=sys.stderr)
        return 2
    return 0


def evaluate_cmd(args, command: str) -> None:
    from ..policy import KVPPolicy
    from ..scorers import rule_definition
    from .collect import open_traces
    from .evaluate import default_rules, evaluate_rules, markdown_table

    traces = open_traces(args.traces)
    policy = KVPPolicy.load(args.checkpoint, expect=traces.shape) if args.checkpoint else None
    ids = traces.split(args.split)
    if args.lengths:
        ids = [t for t in ids if traces.meta(t)["target_tokens"] in set(args.lengths)]
    if args.max_traces:
        ids = ids[:args.max_traces]
    if not ids:
        raise ValueError(f"split {args.split!r} of {traces.folder} has no traces"
                         + (f" of length {args.lengths}" if args.lengths else ""))
    rules = default_rules(policy)
    res = evaluate_rules(traces, ids, rules, progress=not args.no_progress)
    # which definition of each rule these costs are (e.g. TOVA v2 = kvpress's, v1 = per KV group)
    res.update(rule_definitions={r: rule_definition(r) for r in rules})
    res.update(model=traces.shape.model_name, split=args.split, checkpoint=args.checkpoint,
               traces_folder=str(traces.folder), command=command, lengths=args.lengths,
               prompt_tokens=[traces.meta(t)["n_prompt"] for t in ids],
               trace_config=traces.manifest["config"])
    n = traces.shape.num_layers
    show = args.show_layers or tuple(sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 1}))
    table = markdown_table(res, show)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        for path, text in ((out, json.dumps(res, indent=1)), (out.with_suffix(".md"), table + "\n")):
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
