"""GPU correctness check of the Triton kernels against their torch references (compiled, not
interpreted); ~1 min on an H200, compiles included (about ten kernel variants). Writes gpu_check.json
into the output folder.

Checks, on CUDA tensors, fixed seed (KVP_TEST_SEED overrides), on vLLM's GPU cache layout in both
physical orders (NHD: FlashAttention/Triton; HND: FlashInfer) and on a layer's view into a shared
allocation (storage offset), the way the serving worker calls the kernels:
  * score + select, small policy, head_dim 128 / 64, block sizes 16 / 32 / 128, cache bf16 / fp16,
    edge sizes in one batch (length not a multiple of the block, < sinks+recent, one token, budget >=
    length, a 3000-token request so programs loop): scores vs the fp32 torch mirror within tolerance
    (NaN never passes, outputs poisoned), the fused first radix pass, kept == select_topb(kernel scores)
    exactly, kept == reference kept away from near-ties;
  * the paper-size policy (256/256/32/256, head_dim 128) through ``paged_score_select`` with its GPU
    launch settings (persistent grid of 2 programs per SM, 32-wide K chunks, 2048-wide select chunks):
    the default tf32 dots (Qwen2.5-7B heads, NHD and HND; Llama-3.1-8B heads) and bf16 dots with
    bf16-packed weights, 10K-token requests;
  * the radix select alone at long lengths (up to 128K) with heavy ties and -0.0, exact;
  * compaction through ``compact_tail_batched`` byte-exact against the torch reference (random /
    prefix / tail kept sets, a 4000-token request).

Dry run on CPU (small sizes, the interpreter, ieee dots):
  KVP_CHECK_DEVICE=cpu TRITON_INTERPRET=1 python benchmarks/gpu_check.py --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from selection_latency import K  # noqa: E402  (registers kvp_vllm.kernels when not installed)

from kvp_vllm.kernels.score_select import score_triton, select_triton  # noqa: E402
from kvp_vllm.policy import KVPPolicy, ModelShape  # noqa: E402
from kvp_vllm.selection import DEFAULT_RECENT, DEFAULT_SINKS, block_aligned_budget, select_topb  # noqa: E402

DEV = torch.device(os.environ.get("KVP_CHECK_DEVICE", "cuda"))
DRY = DEV.type != "cuda"   # a dry run of this script on CPU under TRITON_INTERPRET=1: small sizes
TOL = {"ieee": (1e-4, 1e-4), "tf32": (3e-2, 3e-2), "bf16": (8e-2, 8e-2)}   # (rtol, atol)
DEFAULT_SEED = 1234


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def paged(case, lens, heads, hd, bs, dtype):
    """A cache with every request's blocks shuffled through a pool, filled with noise. case:
    "gpu-NHD", "gpu-HND", or "gpu-layer-view" (layer 1 of a [3 layers, blocks, block, heads, 2D]
    allocation, NHD: a storage offset, as vLLM's per-layer views have)."""
    need = [-(-n // bs) for n in lens]
    total = sum(need) + 3
    if case == "gpu-layer-view":
        alloc = torch.zeros(3, total, bs, heads, 2 * hd, dtype=dtype, device=DEV)
        cache = alloc[1].transpose(1, 2)
        assert cache.storage_offset() > 0
    else:
        layout, _, order = case.partition("-")
        cache = K.make_cache(layout, total, bs, heads, hd, dtype, DEV, order=order or None)
    cache.copy_(torch.randn(cache.shape, device=DEV) * 2)
    perm = torch.randperm(total, device=DEV).to(torch.int32)
    table = torch.full((len(lens), max(need) + 1), total + 99, dtype=torch.int32, device=DEV)
    s = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[s:s + n]
        s += n
    return cache, table


def bits(t):
    return t.view(torch.int16)


def top_byte_histogram(scores, n_sink=DEFAULT_SINKS, n_recent=DEFAULT_RECENT):
    n = scores.shape[1]
    s = torch.where(scores == 0, torch.zeros_like(scores), scores)
    b = s.view(torch.int32).long()
    key = torch.where(b < 0, b ^ 0x7FFFFFFF, b) + 2**31
    idx = torch.arange(n, device=scores.device)
    key[:, (idx < n_sink) | (idx >= n - n_recent)] = 2**32 - 1
    return torch.stack([torch.bincount(k >> 24, minlength=256) for k in key]).to(torch.int32)


def compare(scores, kept, ref, lens, counts, precision, pad):
    """Kernel scores / kept vs the fp32 reference; returns (worst scaled error, requests differing)."""
    rtol, atol = TOL["ieee" if DRY else precision]
    worst, ref_mismatch = 0.0, 0
    for i, (n, c) in enumerate(zip(lens, counts)):
        g, w = scores[i, :, :n], ref.scores[i, :, :n]
        assert torch.isfinite(g).all(), f"request {i}: non-finite / unwritten scores"
        err = float(((g - w).abs() / (atol + rtol * w.abs())).max())
        worst = max(worst, err)
        assert err <= 1.0, f"request {i}: scaled score error {err:.3g}"
        own = select_topb(g, max(c, 20))
        assert torch.equal(kept[i, :, :c].long(), own), f"request {i}: kept != select_topb(scores)"
        assert (kept[i, :, c:] == pad).all(), f"request {i}: wrote past its count"
        if not torch.equal(kept[i, :, :c].to(ref.kept.dtype), ref.kept[i, :, :c]):
            ref_mismatch += 1   # near-ties under reduced precision; counted, not failed
    return dict(max_scaled_err=round(worst, 4), requests_differing_from_fp32_ref=ref_mismatch)


def check_score_select(case, hd, bs, dtype, lens, budgets, precision="tf32"):
    """The two launches directly (poisoned outputs, the fused histogram checked)."""
    heads = 3
    layout = "gpu"
    policy = KVPPolicy.random_init(ModelShape(1, heads, hd), seed=random.randrange(1000)).to(DEV)
    cache, table = paged(case, lens, heads, hd, bs, dtype)
    ref = K.score_select_ref(policy, 0, cache, layout, table, lens, budgets, return_scores=True)
    counts = [block_aligned_budget(n, b, bs) for n, b in zip(lens, budgets)]
    packed = K.packed_layer(policy, 0, DEV)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scores = torch.full((len(lens), heads, max(lens)), float("nan"), device=DEV)
    hist = torch.zeros(len(lens), heads, 256, dtype=torch.int32, device=DEV)
    score_triton(packed, cache, layout, table, lens_t, max(lens), precision="ieee" if DRY else precision,
                 out=scores, hist=hist)
    kept = torch.full((len(lens), heads, max(counts)), -7777, dtype=torch.int32, device=DEV)
    select_triton(scores, lens_t, torch.tensor(counts, dtype=torch.int32, device=DEV), max(counts),
                  4, 16, out=kept, hist=hist)
    sync()
    for i, n in enumerate(lens):
        assert torch.equal(hist[i], top_byte_histogram(scores[i, :, :n])), f"request {i}: histogram"
    return compare(scores, kept, ref, lens, counts, precision, pad=-7777)


def check_dispatcher(case, heads, lens, budgets, precision, reference=True, bs=16):
    """paged_score_select as the worker calls it (auto backend = Triton on CUDA, GPU launch
    settings; precision None = the default, tf32), the paper-size policy, head_dim 128."""
    hd = 128
    policy = KVPPolicy.random_init(ModelShape(1, heads, hd), seed=random.randrange(1000),
                                   reference=reference).to(DEV)
    cache, table = paged(case, lens, heads, hd, bs, torch.bfloat16)
    ref = K.score_select_ref(policy, 0, cache, "gpu", table, lens, budgets, return_scores=True)
    if not DRY:
        assert K.backend_for(cache) == "triton"
    sel = K.paged_score_select(policy, 0, cache, "gpu", table, lens, budgets, return_scores=True,
                               precision="ieee" if DRY else precision,
                               backend="triton" if DRY else None)
    sync()
    counts = [block_aligned_budget(n, b, bs) for n, b in zip(lens, budgets)]
    assert sel.counts.tolist() == counts
    info = compare(sel.scores, sel.kept, ref, lens, counts, precision or "tf32", pad=-1)
    # compaction of that selection through the dispatcher, against the reference on a copy
    want = cache.clone()
    K.compact_tail_batched(want, "gpu", table, lens, sel.kept, sel.counts, backend="torch")
    freed = K.compact_tail_batched(cache, "gpu", table, lens, sel.kept, sel.counts,
                                   backend="triton" if DRY else None)
    sync()
    assert freed == [(n - c) // bs for n, c in zip(lens, counts)]
    assert torch.equal(bits(cache), bits(want)), "compaction after selection differs"
    return info


def check_select_long():
    out = []
    sizes = ((131072, 2048), (100003, 50000), (4096, 20), (37, 21), (1, 1))
    for n, c in (sizes[3:] + ((700, 300),) if DRY else sizes):
        s = torch.randint(-50, 50, (4, n), device=DEV).float() * 0.25
        s[:, ::7] = -0.0
        s[1] = torch.randn(n, device=DEV)
        kept = torch.full((1, 4, c), -7777, dtype=torch.int32, device=DEV)
        select_triton(s[None], torch.tensor([n], dtype=torch.int32, device=DEV),
                      torch.tensor([c], dtype=torch.int32, device=DEV), c, 4, 16, out=kept)
        want = select_topb(s, max(c, 20))
        assert torch.equal(kept[0].long(), want), f"select mismatch at L={n}, b'={c}"
        out.append([n, c])
    return out


def check_compact(case, hd, bs, dtype):
    heads = 3
    lens = [bs * 3 + 5, 2 * bs, 1, 30, 300 if DRY else 4000]
    counts = [block_aligned_budget(n, b, bs) for n, b in zip(lens, [21, 20, 20, 20, 500])]
    cache, table = paged(case, lens, heads, hd, bs, dtype)
    kept = torch.full((len(lens), heads, max(counts)), -7777, dtype=torch.int32, device=DEV)
    for i, (n, c) in enumerate(zip(lens, counts)):
        for h in range(heads):
            kind = (i + h) % 3
            if kind == 0:
                idx = torch.arange(c)
            elif kind == 1:
                idx = torch.arange(n - c, n)
            else:
                idx = torch.randperm(n)[:c].sort().values
            kept[i, h, :c] = idx.to(torch.int32)
    want = cache.clone()
    K.compact_tail_batched(want, "gpu", table, lens, kept, counts, backend="torch")
    freed = K.compact_tail_batched(cache, "gpu", table, lens, kept, counts,
                                   backend="triton" if DRY else None)
    sync()
    assert freed == [(n - c) // bs if c < n else 0 for n, c in zip(lens, counts)]
    assert torch.equal(bits(cache), bits(want)), "compaction differs from the reference"


def jobs_list():
    big = (lambda full, dry: dry if DRY else full)
    edge = lambda bs: [bs * 2 + 37, 19, 1, 70, big(3000, 150)]  # noqa: E731
    edge_budgets = [40, 20, 20, 100, 700]
    jobs = []
    # (case, head_dim, block size, cache dtype): NHD and HND share a binary per (head_dim, block size)
    for case, hd, bs, dt in (("gpu-NHD", 128, 16, torch.bfloat16), ("gpu-HND", 128, 16, torch.float16),
                             ("gpu-NHD", 64, 32, torch.float16), ("gpu-HND", 64, 128, torch.bfloat16),
                             ("gpu-layer-view", 128, 16, torch.bfloat16)):
        name = f"{case} hd{hd} bs{bs} {str(dt)[6:]}"
        jobs.append((f"score_select small policy {name}", check_score_select,
                     (case, hd, bs, dt, edge(bs), edge_budgets)))
        jobs.append((f"compact {name}", check_compact, (case, hd, bs, dt)))
    qwen_lens, qwen_budgets = big([10240, 777, 19], [100, 37, 19]), big([2560, 300, 20], [30, 20, 20])
    jobs += [
        ("paper-size policy, default (tf32) dots, Qwen2.5-7B heads, gpu-NHD", check_dispatcher,
         ("gpu-NHD", 4, qwen_lens, qwen_budgets, None)),
        ("paper-size policy, bf16 dots, Qwen2.5-7B heads, gpu-NHD", check_dispatcher,
         ("gpu-NHD", 4, qwen_lens, qwen_budgets, "bf16")),
        ("paper-size policy, default (tf32) dots, Qwen2.5-7B heads, gpu-HND", check_dispatcher,
         ("gpu-HND", 4, qwen_lens, qwen_budgets, None)),
        ("paper-size policy, bf16 dots, Llama-3.1-8B heads, gpu-layer-view", check_dispatcher,
         ("gpu-layer-view", 8, big([10240, 50], [80, 50]), big([1024, 20], [24, 20]), "bf16")),
        ("radix select long rows", check_select_long, ()),
    ]
    return jobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    ap.add_argument("--only", default=None, help="run the checks whose name contains this")
    args = ap.parse_args()
    t_start = time.time()
    env = os.environ.get("KVP_TEST_SEED", "")
    seed = random.SystemRandom().randrange(2**31) if env == "random" else int(env or DEFAULT_SEED)
    torch.manual_seed(seed)
    random.seed(seed)
    print("seed", seed, flush=True)
    import triton

    results = dict(seed=seed, torch=torch.__version__, triton=triton.__version__, dry_run=DRY,
                   device=torch.cuda.get_device_name(DEV) if not DRY else "cpu (interpreter)",
                   checks=[])
    jobs = [j for j in jobs_list() if args.only is None or args.only in j[0]]
    failed = 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, fn, a in jobs:
        t = time.time()
        try:
            info = fn(*a)
            status = "pass"
        except Exception as e:  # report every check, then fail at the end
            info, status = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", "FAIL"
            failed += 1
        results["checks"].append(dict(name=name, status=status, info=info,
                                      seconds=round(time.time() - t, 2)))
        print(status, name, info if status == "pass" else "", f"{time.time() - t:.1f}s", flush=True)
        if status == "FAIL":
            print(info, flush=True)
        results["failed"] = failed
        results["wall_s"] = round(time.time() - t_start, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"{len(jobs) - failed}/{len(jobs)} checks passed in {time.time() - t_start:.0f} s; wrote "
          f"{args.out / 'gpu_check.json'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
