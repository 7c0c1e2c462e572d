"""GPU correctness check of the Triton kernels against their torch references (compiled, not
interpreted). Run by benchmarks/gpu_check.sh; writes gpu_check.json into the output folder.

Checks, on CUDA tensors, fresh random inputs (seed printed):
  * score + select for every layout x head_dim x block size (cache dtype alternating bf16/fp16),
    edge sizes in one batch (length not a multiple of the block, < sinks+recent, one token,
    budget >= length): scores vs the fp32 torch mirror within tolerance (NaN never passes, outputs
    poisoned), kept == select_topb(kernel scores) exactly, kept == reference kept away from near-ties;
  * the paper-size policy (256/256/32/256, head_dim 128) in tf32, bf16 and ieee precision;
  * the radix select alone at long lengths (up to 128K) with heavy ties and -0.0, exact;
  * compaction byte-exact against the torch reference (random / prefix / tail kept sets).
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

from kvp_vllm.kernels.compact import compact_triton  # noqa: E402
from kvp_vllm.kernels.score_select import score_triton, select_triton  # noqa: E402
from kvp_vllm.policy import KVPPolicy, ModelShape  # noqa: E402
from kvp_vllm.selection import block_aligned_budget, select_topb  # noqa: E402

DEV = torch.device(os.environ.get("KVP_CHECK_DEVICE", "cuda"))
DRY = DEV.type != "cuda"   # a dry run of this script on CPU under TRITON_INTERPRET=1: small sizes
TOL = {"ieee": (1e-4, 1e-4), "tf32": (3e-2, 3e-2), "bf16": (8e-2, 8e-2)}   # (rtol, atol)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def paged(case, lens, heads, hd, bs, dtype):
    """case: "gpu-NHD", "gpu-HND" or "cpu"."""
    layout, _, order = case.partition("-")
    need = [-(-n // bs) for n in lens]
    total = sum(need) + 3
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


def check_score_select(case, hd, bs, dtype, lens, budgets, precision, reference=False):
    layout = case.partition("-")[0]
    heads = 4 if reference else 3
    policy = KVPPolicy.random_init(ModelShape(1, heads, hd), seed=random.randrange(1000),
                                   reference=reference).to(DEV)
    cache, table = paged(case, lens, heads, hd, bs, dtype)
    ref = K.score_select_ref(policy, 0, cache, layout, table, lens, budgets, return_scores=True)
    counts = [block_aligned_budget(n, b, bs) for n, b in zip(lens, budgets)]
    packed = K.packed_layer(policy, 0, DEV, torch.bfloat16 if precision == "bf16" else torch.float32)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scores = torch.full((len(lens), heads, max(lens)), float("nan"), device=DEV)
    hist = torch.zeros(len(lens), heads, 256, dtype=torch.int32, device=DEV)
    score_triton(packed, cache, layout, table, lens_t, max(lens), precision=precision, out=scores,
                 hist=hist)
    kept = torch.full((len(lens), heads, max(counts)), -7777, dtype=torch.int32, device=DEV)
    select_triton(scores, lens_t, torch.tensor(counts, dtype=torch.int32, device=DEV), max(counts),
                  4, 16, out=kept, hist=hist)
    sync()
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
        if not torch.equal(kept[i, :, :c], ref.kept[i, :, :c]):
            ref_mismatch += 1   # near-ties under reduced precision; counted, not failed
    return dict(max_scaled_err=worst, requests_differing_from_fp32_ref=ref_mismatch)


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
    layout = case.partition("-")[0]
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
    K.compact_tail_batched(want, layout, table, lens, kept, counts, backend="torch")
    got = cache.clone()
    compact_triton(got, layout, table, lens, kept, counts)
    sync()
    assert torch.equal(bits(got), bits(want)), "compaction differs from the reference"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    args = ap.parse_args()
    seed = int(os.environ.get("KVP_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    random.seed(seed)
    print("seed", seed, flush=True)
    results = dict(seed=seed, torch=torch.__version__, dry_run=DRY,
                   device=torch.cuda.get_device_name(DEV) if not DRY else "cpu (interpreter)",
                   checks=[])
    import triton

    results["triton"] = triton.__version__
    n = 0
    jobs = []
    for layout in ("gpu-NHD", "gpu-HND", "cpu"):
        for hd in (64, 128):
            for bs in (16, 32, 128):
                dt = (torch.bfloat16, torch.float16)[n % 2]
                n += 1
                lens = [bs * 2 + 37, 19, 1, 70, 150 if DRY else 3000]
                jobs.append((f"score_select {layout} hd{hd} bs{bs} {dt}", check_score_select,
                             (layout, hd, bs, dt, lens, [40, 20, 20, 100, 700], "tf32")))
                jobs.append((f"compact {layout} hd{hd} bs{bs} {dt}", check_compact, (layout, hd, bs, dt)))
    for precision in ("tf32", "bf16", "ieee"):
        jobs.append((f"score_select reference-size policy {precision}", check_score_select,
                     ("gpu-NHD", 128, 16, torch.bfloat16, [100, 37, 19] if DRY else [10240, 777, 19],
                      [30, 20, 20] if DRY else [2560, 300, 20], "ieee" if DRY else precision,
                      True)))
    jobs.append(("radix select long rows", check_select_long, ()))
    failed = 0
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"{len(jobs) - failed}/{len(jobs)} checks passed; wrote {args.out / 'gpu_check.json'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
