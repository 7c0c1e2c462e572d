"""The KVP trainer (`kvp-train fit`): all KV heads of the chosen layers (default: every layer) trained
at once with the stacked policy, REINFORCE-RLOO on Plackett-Luce rankings (objective.py).

AdamW, linear warm-up then cosine decay (torch's SequentialLR), grad-norm clipping, an EMA of the weights
(torch.optim.swa_utils.AveragedModel) used for evaluation and export, held-out reward (normalised cost)
on the 'val' split every `eval_every` steps with best-checkpoint selection, bf16 autocast on GPU and fp32
on CPU, a JSONL log and a loss/reward plot. Under torchrun each process takes its share of every batch
and DistributedDataParallel averages the gradients (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..environment import numerics_environment
from ..importance import check_budget_weighting
from ..policy import CheckpointError, KVPPolicy, PolicyConfig, check_shape
from ..selection import DEFAULT_RECENT, DEFAULT_SINKS
from .collect import TraceError, TraceSet, TraceUnion, open_traces
from .objective import greedy_normalised_cost, middle, rloo_loss

LOG_NAME = "train_log.jsonl"
PLOT_NAME = "train_curve.png"


@dataclass
class FitConfig:
    traces: str
    out: str
    layers: str = "all"            # "all", "L" or "A-B" (a contiguous range: one slice of the stack)
    steps: int = 300
    batch: int = 8                 # traces per optimiser step (split across processes)
    samples: int = 8               # Gumbel-sampled rankings per (trace, head)
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup: int = 20
    weight_decay: float = 1e-3
    adam_eps: float = 1e-8
    clip_grad: float = 5.0
    adv_clip: float = 2.0
    ema: float = 0.99
    eval_every: int = 50
    val_traces: int = 0            # 0 = the whole val split
    seed: int = 0
    reference: bool = False        # the paper's widths instead of the CPU-sized default
    arch: Dict = field(default_factory=dict)   # PolicyConfig overrides (e.g. hidden_dim)
    init: Optional[str] = None     # start from this checkpoint
    device: str = "auto"
    precision: str = "auto"        # policy forward: "auto" (bf16 autocast on CUDA, fp32 elsewhere),
                                   # "bf16" or "fp32"; weights, optimiser and the loss stay fp32
    n_sink: int = DEFAULT_SINKS
    n_recent: int = DEFAULT_RECENT
    cache_traces: bool = True      # keep the training traces in memory after their first read
    max_tokens: int = 0            # >0: rank a random subset of this many unprotected tokens per trace
                                   # and step (cheaper steps; the subset's cost is a noisy proxy)
    budget_weighting: str = "uniform"  # the cost's weight per budget: "uniform" (the paper) or "log"
                                   # (log-uniform: small budgets count more); training and model selection


def parse_layers(spec: str, num_layers: int) -> range:
    spec = str(spec).strip()
    if spec == "all":
        return range(num_layers)
    try:
        a, _, b = spec.partition("-")
        lo, hi = int(a), int(b) if b else int(a)
    except ValueError:
        raise ValueError(f"--layers must be 'all', 'L' or 'A-B'; got {spec!r}") from None
    if not 0 <= lo <= hi < num_layers:
        raise ValueError(f"--layers {spec} out of range for a {num_layers}-layer model")
    return range(lo, hi + 1)


class _Data:
    """Per-trace tensors for a contiguous range of layers, stacked as [layers*kv_heads, ...]."""

    def __init__(self, traces: TraceSet | TraceUnion, layers: range, cache: bool):
        self.traces, self.layers, self.cache = traces, layers, cache
        self._mem: Dict[str, Dict[str, torch.Tensor]] = {}

    def get(self, tid: str) -> Dict[str, torch.Tensor]:
        if tid in self._mem:
            return self._mem[tid]
        per = [self.traces.load(tid, l, ("keys", "values", "importance")) for l in self.layers]
        d = {k: torch.cat([p[k] for p in per], 0) for k in ("keys", "values", "importance")}
        if self.cache:
            self._mem[tid] = d
        return d


def with_config(policy: KVPPolicy, overrides: Dict) -> KVPPolicy:
    """`policy` with config fields overridden (fine-tuning with --init and --arch): only settings
    that keep every weight's shape (e.g. position_inputs); the weights carry over."""
    config = PolicyConfig(**{**asdict(policy.config), **overrides})
    new = KVPPolicy(config)
    try:
        new.load_state_dict(policy.state_dict(), strict=True)
    except RuntimeError as e:
        changed = sorted(k for k in overrides if k != "model_name")
        raise ValueError(f"--arch {changed} changes the shape of the --init policy's weights; only "
                         f"shape-preserving settings can change when fine-tuning: {e}") from e
    new.zero_unread_position_weights()
    return new.train(policy.training)


def _dist_info():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return world, rank, local


def _device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        spec = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    return torch.device(spec)


def use_bf16(precision: str, device: torch.device) -> bool:
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32; got {precision!r}")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def trace_loss(model, data: Dict[str, torch.Tensor], groups: slice, cfg: FitConfig, device,
               generator) -> tuple:
    n = data["keys"].shape[1]
    mid = middle(n, cfg.n_sink, cfg.n_recent)
    keys = data["keys"][:, mid].to(device)
    values = data["values"][:, mid].to(device)
    c = data["importance"][:, mid].to(device)
    pos = torch.arange(n, device=device)[mid]
    m = keys.shape[1]
    if cfg.max_tokens and m > cfg.max_tokens:
        idx = torch.randperm(m, generator=generator)[:cfg.max_tokens].sort().values.to(device)
        keys, values, c, pos = keys[:, idx], values[:, idx], c[:, idx], pos[idx]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16(cfg.precision, device)):
        scores = model(keys, values, pos, n, groups)
    return rloo_loss(scores.float(), c, samples=cfg.samples, clip=cfg.adv_clip, generator=generator,
                     weighting=cfg.budget_weighting)


@torch.no_grad()
def validate(policy: KVPPolicy, data: _Data, ids: Sequence[str], groups: slice, cfg: FitConfig,
             device) -> Dict[str, float]:
    """Mean greedy normalised cost on `ids` (overall and per layer), fp32."""
    per_layer = torch.zeros(len(data.layers), dtype=torch.float64)
    h = policy.config.num_kv_heads
    for tid in ids:
        d = data.get(tid)
        n = d["keys"].shape[1]
        mid = middle(n, cfg.n_sink, cfg.n_recent)
        pos = torch.arange(n, device=device)[mid]
        s = policy(d["keys"][:, mid].to(device), d["values"][:, mid].to(device), pos, n, groups)
        cost = greedy_normalised_cost(s, d["importance"][:, mid].to(device), cfg.budget_weighting).double().cpu()
        per_layer += cost.view(-1, h).mean(1)
    per_layer /= max(len(ids), 1)
    return {"val_cost": float(per_layer.mean()), "val_cost_per_layer": [round(float(x), 4) for x in per_layer]}


def _frozen_slices(policy: KVPPolicy, groups: slice):
    """Copies of the parameter rows outside `groups` (every stacked parameter has the group dim first)."""
    if groups == slice(0, policy.num_groups):
        return None
    return [(p, p.detach()[:groups.start].clone(), p.detach()[groups.stop:].clone())
            for p in policy.parameters()]


@torch.no_grad()
def _restore(policy: KVPPolicy, frozen) -> None:
    if frozen is None:
        return
    for p, head, tail in frozen:
        p[:head.shape[0]] = head
        p[p.shape[0] - tail.shape[0]:] = tail


def plot_log(log_path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ..eval.plots import save_png
    from ..eval.store import open_text

    # logs are kept as train_log.jsonl (fresh fit) or .jsonl.gz (committed): both redraw
    with open_text(log_path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_cost" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    ax[0].set_title("RLOO loss"); ax[0].set_xlabel("step")
    ax[1].plot([r["step"] for r in train], [r["sampled_cost"] for r in train], lw=0.8, label="sampled (train)")
    ax[1].plot([r["step"] for r in train], [r["greedy_cost"] for r in train], lw=0.8, label="greedy (train)")
    ax[1].plot([r["step"] for r in val], [r["val_cost"] for r in val], "o-", label="greedy EMA (val)")
    ax[1].set_title("normalised cost = -reward (1 = oracle)"); ax[1].set_xlabel("step")
    ax[1].set_yscale("log"); ax[1].legend()
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    save_png(fig, tmp)
    plt.close(fig)
    os.replace(tmp, out_png)


def fit(cfg: FitConfig, progress: bool = True, command: Optional[str] = None) -> Optional[Path]:
    """Train and export the best EMA policy to cfg.out (rank 0). Returns the folder on rank 0."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from tqdm import tqdm

    world, rank, local = _dist_info()
    device = _device(cfg.device, local)
    use_bf16(cfg.precision, device)  # a bad --precision fails before anything is read or written
    check_budget_weighting(cfg.budget_weighting)  # and a bad --budget-weighting
    traces = open_traces(cfg.traces)  # errors out on a missing/corrupt manifest before anything is written
    shape = traces.shape
    layers = parse_layers(cfg.layers, shape.num_layers)
    h = shape.num_kv_heads
    groups = slice(layers.start * h, layers.stop * h)
    train_ids, val_ids = traces.split("train"), traces.split("val")
    if not train_ids:
        raise TraceError(f"{traces.folder} has no training traces (split 'train' is empty)")
    if cfg.val_traces:
        val_ids = val_ids[:cfg.val_traces]
    if cfg.init:
        policy = KVPPolicy.load(cfg.init, expect=shape)
        policy = with_config(policy, {**cfg.arch, "model_name": shape.model_name})
    else:
        torch.manual_seed(cfg.seed)
        make = PolicyConfig.reference if cfg.reference else PolicyConfig.small
        policy = KVPPolicy(make(shape, **cfg.arch))
    check_shape(policy.config, shape, cfg.init or "policy")
    policy.to(device).train()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = policy
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(policy, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    warm = max(1, min(cfg.warmup, cfg.steps - 1))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / warm, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.steps - warm), eta_min=cfg.min_lr),
    ], milestones=[warm])
    ema = AveragedModel(policy, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema))
    data = _Data(traces, layers, cfg.cache_traces)
    out = Path(cfg.out).expanduser()
    log_path = out / LOG_NAME
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log_tmp = out / f".{LOG_NAME}.tmp"
        log_tmp.write_text("")
        log_f = open(log_tmp, "a")
    rng = random.Random(cfg.seed)             # the same batches on every process
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 1000 + rank)
    best = (math.inf, -1, None)
    t0 = time.time()
    bar = tqdm(range(1, cfg.steps + 1), desc="fit", disable=not progress or rank != 0)

    def log(row):
        if rank == 0:
            log_f.write(json.dumps(row) + "\n")
            log_f.flush()

    def do_eval(step):
        nonlocal best
        if rank != 0 or not val_ids:
            return
        ema.module.eval()
        v = validate(ema.module, data if cfg.cache_traces else _Data(traces, layers, False), val_ids,
                     groups, cfg, device)
        v.update(step=step, elapsed_s=round(time.time() - t0, 1))
        log(v)
        bar.write(f"[kvp-train] step {step}: val normalised cost {v['val_cost']:.4f}")
        if v["val_cost"] < best[0]:
            best = (v["val_cost"], step, copy.deepcopy(ema.module.state_dict()))

    do_eval(0)
    for step in bar:
        batch = [train_ids[rng.randrange(len(train_ids))] for _ in range(cfg.batch)]
        mine = batch[rank::world] or batch[:1]
        opt.zero_grad(set_to_none=True)
        losses, stats = [], []
        for i, tid in enumerate(mine):
            sync_later = world > 1 and i < len(mine) - 1
            with model.no_sync() if sync_later else contextlib.nullcontext():
                loss, st = trace_loss(model, data.get(tid), groups, cfg, device, gen)
                (loss / len(mine)).backward()  # one graph at a time; DDP syncs on the last one
            losses.append(loss.detach())
            stats.append(st)
        gnorm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.clip_grad))
        frozen = _frozen_slices(policy, groups)
        opt.step()
        _restore(policy, frozen)  # layers outside --layers stay exactly as they were (no weight decay)
        sched.step()
        ema.update_parameters(policy)
        row = {"step": step, "loss": float(torch.stack(losses).mean()),
               "sampled_cost": sum(s["sampled_cost"] for s in stats) / len(stats),
               "greedy_cost": sum(s["greedy_cost"] for s in stats) / len(stats),
               "grad_norm": round(gnorm, 4), "lr": opt.param_groups[0]["lr"]}
        log(row)
        bar.set_postfix(cost=f"{row['greedy_cost']:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            do_eval(step)
    if world > 1:
        dist.barrier()
    if rank != 0:
        return None
    log_f.close()
    os.replace(log_tmp, log_path)
    if best[2] is None:  # no val split: export the final EMA weights
        best = (math.nan, cfg.steps, ema.module.state_dict())
    final = KVPPolicy(policy.config)
    final.load_state_dict({k: v.detach().float().cpu() for k, v in best[2].items()})
    extra = {"trained_on": str(traces.folder), "traces_sha256": traces.content_sha256,
             "environment": numerics_environment(), "trace_model": shape.model_name,
             "trace_manifest_config": traces.manifest["config"], "layers_trained": [layers.start, layers.stop - 1],
             "train_traces": len(train_ids), "val_traces": len(val_ids), "best_step": best[1],
             "best_val_normalised_cost": best[0], "fit_config": asdict(cfg), "world_size": world,
             "train_seconds": round(time.time() - t0, 1), "command": command or " ".join(sys.argv)}
    final.save(out, extra=extra)
    plot_log(log_path, out / PLOT_NAME)
    return out
