"""Latency of KVP score + select and of tail compaction against context length and batch.

Paths (one layer, a batch of requests, keys/values read from a paged cache):
  unfused      gather K/V out of the pages, ``policy.score_layer``, ``select_topb`` (full sort), per request
  torch_fused  kvp_vllm.kernels' torch path: all requests in one batched pass with packed weights and a
               sort-free threshold selection (what runs without a GPU)
  triton       the fused Triton kernels (GPU only)
Compaction: the torch reference (gather, then scatter) against the Triton kernel (GPU only).

Shapes: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64; the small CPU policy) and Qwen2.5-7B
(28 layers, 4 KV heads, head_dim 128; the paper's reference policy widths 256/256/32/256).
Floors: the MLP's FLOPs and the bytes read, against peak rates measured on this machine.

  python benchmarks/selection_latency.py            # CPU: quick mode, writes selection_latency_cpu.json
  python benchmarks/selection_latency.py --full     # GPU: full sweep, writes selection_latency_gpu.json
Each run also writes a PNG plot beside the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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

SHAPES = {  # the goal shape first: a run cut short by a time limit still has it
    "qwen2.5-7b": dict(model="Qwen2.5-7B", layers=28, kv_heads=4, head_dim=128, reference=True),
    "smollm2": dict(model="SmolLM2-135M", layers=30, kv_heads=3, head_dim=64, reference=False),
}


# ------------------------------------------------------------------------------------------------
# timing and peak rates


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, reps, warmup=None, setup=None):
    """Median wall time in ms of fn() over reps runs (setup() runs untimed before each)."""
    if warmup is None:
        warmup = 1 if device.type == "cuda" else 0
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    sync(device)
    times, cpu = [], []
    for _ in range(reps):
        if setup:
            setup()
        sync(device)
        t, c = time.perf_counter(), time.process_time()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    LAST_CPU_MS[0] = statistics.median(cpu)
    return statistics.median(times)


LAST_CPU_MS = [0.0]  # process CPU time (all threads) of the last timeit: robust on a shared CPU


def timed(row, key, fn, device, reps, **kw):
    """row[key_ms] = median wall ms; on CPU also row[key_cpu_ms] = median process CPU ms."""
    row[f"{key}_ms"] = timeit(fn, device, reps, **kw)
    if device.type != "cuda":
        row[f"{key}_cpu_ms"] = LAST_CPU_MS[0]


def measure_peaks(device, quick):
    """Measured matmul throughput (TFLOP/s) and copy bandwidth (GB/s) on this device."""
    n = 1024 if quick else 8192
    out = {}
    dtypes = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if device.type == "cuda" else [])
    for name, dt in dtypes:
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)
        if device.type == "cuda" and name == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True
            name = "tf32"
        ms = timeit(lambda: a @ b, device, reps=5 if quick else 20, warmup=2)
        out[f"matmul_{name}_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    m = (64 if quick else 1024) * 2**20
    x = torch.empty(m // 4, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    ms = timeit(lambda: y.copy_(x), device, reps=5 if quick else 20, warmup=2)
    out["copy_gbps"] = 2 * m / (ms * 1e-3) / 1e9
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
    cache = K.make_cache(layout, total, block_size, s["kv_heads"], s["head_dim"], dtype, device)
    cache.normal_()
    perm = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    return policy, cache, table


def run_point(shape, length, batch, args, device, layout, block_size, dtype, paths, precision=None):
    lens = [length] * batch
    budgets = [max(20, length // 4)] * batch
    policy, cache, table = build(shape, lens, block_size, layout, dtype, device)
    c = policy.config
    row = dict(shape=shape, model=SHAPES[shape]["model"], length=length, batch=batch, layout=layout,
               block_size=block_size, cache_dtype=str(dtype).replace("torch.", ""),
               kv_heads=c.num_kv_heads, head_dim=c.head_dim,
               policy_widths=[c.key_dim, c.value_dim, c.pos_dim, c.hidden_dim, c.depth],
               budget=budgets[0])
    tokens = length * batch * c.num_kv_heads
    row["mlp_gflop"] = tokens * mlp_flops_per_token(c) / 1e9
    row["kv_bytes_mb"] = tokens * 2 * c.head_dim * cache.element_size() / 1e6
    reps = args.reps
    sel = None
    with torch.no_grad():
        if "unfused" in paths:
            timed(row, "unfused", lambda: K.unfused_score_select(
                policy, 0, cache, layout, table, lens, budgets), device, reps)
        if "torch_fused" in paths:
            timed(row, "torch_fused", lambda: K.paged_score_select(
                policy, 0, cache, layout, table, lens, budgets, backend="torch"), device, reps)
        if "triton" in paths:
            row["triton_precision"] = precision or "tf32"
            row["triton_ms"] = timeit(lambda: K.paged_score_select(
                policy, 0, cache, layout, table, lens, budgets, backend="triton",
                precision=precision), device, reps, warmup=2)
            # the two launches alone, inputs prepared (what a serving loop with persistent buffers pays)
            from kvp_vllm.kernels.score_select import score_triton, select_triton

            packed = K.packed_layer(policy, 0, device,
                                    torch.bfloat16 if precision == "bf16" else torch.float32)
            lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
            counts = K.aligned_counts(lens, budgets, block_size)
            counts_t = torch.tensor(counts, dtype=torch.int32, device=device)
            scores = torch.empty(batch, c.num_kv_heads, length, device=device)
            kept = torch.empty(batch, c.num_kv_heads, max(counts), device=device, dtype=torch.int32)

            hist = torch.zeros(batch, c.num_kv_heads, 256, device=device, dtype=torch.int32)

            def launches():
                hist.zero_()
                score_triton(packed, cache, layout, table, lens_t, length, precision=precision,
                             out=scores, hist=hist)
                select_triton(scores, lens_t, counts_t, max(counts), 4, 16, out=kept, hist=hist)

            row["triton_kernels_ms"] = timeit(launches, device, reps, warmup=2)
        sel = K.paged_score_select(policy, 0, cache, layout, table, lens, budgets,
                                   backend="triton" if "triton" in paths else "torch")
        work = cache.clone()
        reset = lambda: work.copy_(cache)  # noqa: E731
        timed(row, "compact_torch", lambda: K.compact_tail_batched(
            work, layout, table, lens, sel.kept, sel.counts, backend="torch"), device, reps, setup=reset)
        if "triton" in paths:
            row["compact_triton_ms"] = timeit(lambda: K.compact_tail_batched(
                work, layout, table, lens, sel.kept, sel.counts, backend="triton"), device, reps,
                setup=reset)
        row["moved_mb"] = (int(sel.counts[0]) * batch * c.num_kv_heads * 2 * c.head_dim
                           * cache.element_size() * 2 / 1e6)  # read + write
    if "unfused_ms" in row and "torch_fused_ms" in row:
        row["torch_fused_speedup"] = row["unfused_ms"] / row["torch_fused_ms"]
    if "unfused_cpu_ms" in row and "torch_fused_cpu_ms" in row:
        row["torch_fused_speedup_cpu_time"] = row["unfused_cpu_ms"] / row["torch_fused_cpu_ms"]
    if "triton_ms" in row and "unfused_ms" in row:
        row["triton_speedup_vs_unfused"] = row["unfused_ms"] / row["triton_ms"]
    del policy, cache, table, sel
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def add_floors(row, peaks):
    compute_peak = peaks.get("matmul_bf16_tflops", peaks.get("matmul_fp32_tflops"))
    row["floor_compute_ms"] = row["mlp_gflop"] / compute_peak  # GFLOP / TFLOP/s = ms
    row["floor_bytes_ms"] = row["kv_bytes_mb"] / peaks["copy_gbps"]  # MB / (GB/s) = ms
    row["floor_ms"] = max(row["floor_compute_ms"], row["floor_bytes_ms"])
    for key in ("triton_kernels_ms", "triton_ms", "torch_fused_ms", "unfused_ms"):
        if key in row:
            row[key.replace("_ms", "_x_floor")] = row[key] / row["floor_ms"]
    if "compact_triton_ms" in row:
        row["compact_floor_ms"] = row["moved_mb"] / peaks["copy_gbps"]


# ------------------------------------------------------------------------------------------------


def triton_config_sweep(device, args, length=10240, grid=None):
    """At the goal point (Qwen2.5-7B layer, 10K tokens, batch 1): every tile config and precision."""
    from kvp_vllm.kernels.score_select import score_triton, select_triton

    out = []
    budget = length // 4
    policy, cache, table = build("qwen2.5-7b", [length], 16, "gpu", torch.bfloat16, device)
    lens_t = torch.tensor([length], dtype=torch.int32, device=device)
    counts_t = torch.tensor([budget], dtype=torch.int32, device=device)
    ref = K.score_select_ref(policy, 0, cache, "gpu", table, [length], [budget], return_scores=True)
    # each (precision, block_t, warps) is one compile of a large kernel (ptxas: tens of seconds)
    g = grid or dict(precision=("tf32", "bf16"), block_t=(64, 128), warps=(8,), progs=(1, 2, 4),
                     select_block=(1024, 2048, 4096, 8192), select_warps=(4, 8, 16),
                     chunk=(32, 64, 128, 256), compact_warps=(4, 8))
    sms = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
           else 1)
    for precision in g["precision"]:
        for block_t in g["block_t"]:
            for warps in g["warps"]:
                for progs_per_sm in g["progs"]:
                    packed = K.packed_layer(policy, 0, device,
                                            torch.bfloat16 if precision == "bf16" else torch.float32)
                    kw = dict(precision=precision, block_t=block_t, num_warps=warps,
                              num_programs=progs_per_sm * sms)
                    try:
                        hist = torch.zeros(1, 4, 256, dtype=torch.int32, device=device)
                        scores = score_triton(packed, cache, "gpu", table, lens_t, length, hist=hist,
                                              **kw)
                        err = ((scores[0] - ref.scores[0]).abs()
                               / (1e-3 + ref.scores[0].abs())).max().item()
                        junk = torch.zeros_like(hist)  # accumulates across reps; only timed
                        ms = timeit(lambda: score_triton(packed, cache, "gpu", table, lens_t, length,
                                                         hist=junk, **kw), device, args.reps, warmup=2)
                        sel_ms = timeit(lambda: select_triton(scores, lens_t, counts_t, budget, 4, 16,
                                                              hist=hist),
                                        device, args.reps, warmup=2)
                        out.append(dict(kw, num_programs=kw["num_programs"], score_ms=ms,
                                        select_ms=sel_ms, max_rel_err=err))
                    except Exception as e:  # a config that does not compile is a result too
                        out.append(dict(kw, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print("config", out[-1], flush=True)
    scores = score_triton(K.packed_layer(policy, 0, device), cache, "gpu", table, lens_t, length)
    for block in g["select_block"]:
        for warps in g["select_warps"]:
            try:
                ms = timeit(lambda: select_triton(scores, lens_t, counts_t, budget, 4, 16, block=block,
                                                  num_warps=warps), device, args.reps, warmup=2)
                out.append(dict(kernel="select", block=block, num_warps=warps, select_ms=ms))
            except Exception as e:
                out.append(dict(kernel="select", block=block, num_warps=warps,
                                error=f"{type(e).__name__}: {str(e)[:300]}"))
            print("config", out[-1], flush=True)
    from kvp_vllm.kernels.compact import compact_triton

    sel = K.paged_score_select(policy, 0, cache, "gpu", table, [length], [budget], backend="triton")
    work = cache.clone()
    for chunk in g["chunk"]:
        for warps in g["compact_warps"]:
            try:
                ms = timeit(lambda: compact_triton(work, "gpu", table, [length], sel.kept, sel.counts,
                                                   chunk=chunk, num_warps=warps), device, args.reps,
                            warmup=2, setup=lambda: work.copy_(cache))
                out.append(dict(kernel="compact", chunk=chunk, num_warps=warps, compact_ms=ms))
            except Exception as e:
                out.append(dict(kernel="compact", chunk=chunk, num_warps=warps,
                                error=f"{type(e).__name__}: {str(e)[:300]}"))
            print("config", out[-1], flush=True)
    return out


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for col, shape in enumerate(shapes):
        rs = [r for r in rows if r["shape"] == shape]
        for batch in sorted({r["batch"] for r in rs}):
            b = sorted([r for r in rs if r["batch"] == batch], key=lambda r: r["length"])
            x = [r["length"] for r in b]
            for key, style in (("unfused_ms", "o--"), ("torch_fused_ms", "s-"), ("triton_ms", "^-"),
                               ("triton_kernels_ms", "v-"), ("floor_ms", ":")):
                if all(key in r for r in b):
                    axes[0, col].plot(x, [r[key] for r in b], style, label=f"{key[:-3]} B={batch}")
            for key, style in (("compact_torch_ms", "o--"), ("compact_triton_ms", "^-")):
                if all(key in r for r in b):
                    axes[1, col].plot(x, [r[key] for r in b], style, label=f"{key[:-3]} B={batch}")
        for ax, what in ((axes[0, col], "score + select"), (axes[1, col], "compaction")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens per request)")
            ax.set_ylabel("ms per layer")
            ax.set_title(f"{what}, one layer, {shape} ({result['device']})", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="full sweep (GPU): 1K-128K, batch 1/4/16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="*")
    ap.add_argument("--batches", type=int, nargs="*")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the Triton config sweep (GPU)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine two OpenMP threads "
                         "spin against each other and run ~10x slower)")
    ap.add_argument("--plot-only", type=Path, default=None, help="re-plot an existing result JSON")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return None
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(args.threads)
    full = args.full
    lengths = args.lengths or ([1024, 2048, 4096, 10240, 16384, 32768, 65536, 131072] if full
                               else [1024, 4096, 10240])
    batches = args.batches or ([1, 4, 16] if full else [1, 4])
    args.reps = args.reps or (10 if gpu else 3)
    if gpu:
        layout, block_size, paths = "gpu", 16, ["unfused", "torch_fused", "triton"]
    else:
        layout, block_size, paths = "cpu", 32, ["unfused", "torch_fused"]
    dtype = torch.bfloat16
    torch.set_grad_enabled(False)
    t_start = time.time()
    peaks = measure_peaks(device, quick=not gpu)
    print("peaks", peaks, flush=True)
    result = dict(
        benchmark="selection_latency", mode="full" if full else "quick",
        command="python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if gpu else f"CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)",
        load_average_at_start=os.getloadavg(),
        torch=torch.__version__, triton=_triton_version(), layout=layout, block_size=block_size,
        peaks=peaks, notes=("times are medians per call for ONE layer; a full model multiplies by its "
                            "layer count. floor = max(MLP FLOPs / measured matmul peak, K+V bytes / "
                            "measured copy bandwidth)."),
        rows=[])
    out = args.out or RESULTS / f"selection_latency_{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        if gpu and not args.no_sweep and shape == "qwen2.5-7b":
            result["triton_configs_qwen_10k"] = triton_config_sweep(device, args)
            out.write_text(json.dumps(result, indent=1))
        for length in lengths:
            for batch in batches:
                # the unfused path at 128K x 16 requests is long on purpose; skip only on CPU
                p = list(paths)
                if not gpu and length * batch > 16 * 1024:
                    continue
                if gpu and length * batch > 512 * 1024:
                    p = [x for x in p if x != "unfused"]
                row = run_point(shape, length, batch, args, device, layout, block_size, dtype, p)
                add_floors(row, peaks)
                result["rows"].append(row)
                out.write_text(json.dumps(result, indent=1))  # partial results survive a time limit
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                  for k, v in row.items()}), flush=True)
    goal = [r for r in result["rows"] if r["shape"] == "qwen2.5-7b" and r["length"] == 10240
            and r["batch"] == 1]
    if goal:
        g = goal[0]
        result["goal_point"] = {k: g.get(k) for k in ("unfused_ms", "torch_fused_ms", "triton_ms",
                                                       "triton_kernels_ms", "triton_kernels_x_floor",
                                                       "floor_compute_ms", "floor_ms",
                                                       "triton_x_floor", "compact_triton_ms",
                                                       "compact_torch_ms")}
        result["goal_point"]["target_ms"] = 0.15
        result["goal_point"]["paper_b200_ms"] = 0.71
    result["wall_s"] = round(time.time() - t_start, 1)
    result["load_average_at_end"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=1))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as e:  # a bare GPU machine may lack matplotlib: re-plot later with --plot-only
        print(f"no plot ({e}); run: python benchmarks/selection_latency.py --plot-only {out}")
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']} s")
    return result


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
