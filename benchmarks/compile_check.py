"""Compile the Triton kernels for a GPU target on a machine without a GPU (Triton's own ptxas), and
report shared memory, registers and spill stack per configuration. Catches what the interpreter
cannot: constructs the compiler rejects, shared-memory overflow, register spills.

  python benchmarks/compile_check.py                 # sm_90 (H100/H200), all configs -> results JSON
  python benchmarks/compile_check.py --quick         # select + compact + the small scorer only
  python benchmarks/compile_check.py --smoke         # one select, one compact, the small scorer (tests)

The dim strides are the constexprs a real launch on vLLM's GPU layout passes (1); token strides are
runtime arguments (NHD and HND share one binary).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real
if "--use-cache" not in sys.argv:  # a fresh Triton cache: every config really compiles, times are real
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvp-compile-check-")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

WEIGHTS = ["wk", "wv", "wp", "w0", "wh"]
VECTORS = ["bk", "gk", "betak", "bv", "gv", "betav", "bp", "gp", "betap", "freqs_ptr", "b0", "g0",
           "beta0", "bh", "gh", "betah", "wo", "bo"]


def _kernels():
    import selection_latency  # noqa: F401  (registers kvp_vllm.kernels when not installed)
    from kvp_vllm.kernels.compact import _compact_kernel
    from kvp_vllm.kernels.score_select import INTERPRET, _score_kernel, _select_kernel

    if INTERPRET:
        raise RuntimeError("kernels were imported under TRITON_INTERPRET=1; run this in a fresh process")
    return _score_kernel, _select_kernel, _compact_kernel


def compile_one(fn, ptrs, floats, consts, num_warps, arch=90):
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32"))
           for n in fn.arg_names}
    t = time.time()
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    seconds = time.time() - t
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                           text=True).stdout.replace("\n", " ")
    os.unlink(f.name)
    reg = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(shared_bytes=k.metadata.shared, registers=int(reg.group(1)) if reg else None,
                spill_stack_bytes=int(stack.group(1)) if stack else None,
                compile_s=round(seconds, 1))


def score_config(name, d, kd, vd, pd, hd, precision, block_t, num_warps, cache="*bf16", heads=4,
                 page=16):
    ptrs = {"cache_ptr": cache, "bt_ptr": "*i32", "lens_ptr": "*i32", "pos_ptr": "*i32",
            "plen_ptr": "*i32", "scores_ptr": "*fp32", "scratch_ptr": "*fp32", "hist_ptr": "*i32"}
    for w in WEIGHTS:
        ptrs[w] = "*bf16" if precision == "bf16" else "*fp32"
    for v in VECTORS:
        ptrs[v] = "*fp32"
    consts = dict(k_sd=1, v_sd=1, PAGE=page, D=d, KD=kd, VD=vd, PD=pd,
                  HD=hd, NPF=34, NPF_PAD=64, NFREQ=8, DEPTH=2, BLOCK_T=block_t, BK=32,
                  SW=max(kd + vd + pd, hd), HAS_POS=False, PRECISION=precision, FUSE_HIST=True)
    return dict(kernel="score", policy=name, head_dim=d, precision=precision, block_t=block_t,
                num_warps=num_warps), (ptrs, {"eps"}, consts, num_warps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="one select, one compact and the small-policy scorer config (tests)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--use-cache", action="store_true",
                    help="use Triton's normal kernel cache (default: a fresh temporary one)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile_check_sm90.json")
    args = ap.parse_args(argv)
    score, select, compact = _kernels()
    jobs = []
    for block, warps in ((1024, 8), (2048, 8), (4096, 16)):
        for hist_in in (True, False):
            jobs.append((dict(kernel="select", block=block, num_warps=warps, hist_in=hist_in), select,
                         ({"scores_ptr": "*fp32", "lens_ptr": "*i32", "counts_ptr": "*i32",
                           "kept_ptr": "*i32", "hist_ptr": "*i32"}, set(),
                          dict(BLOCK=block, HIST_IN=hist_in), warps)))
    for d in (64, 128):
        for chunk, warps in ((2048 // d, 4), (4096 // d, 8)):
            for stage in (1, 0):
                jobs.append((dict(kernel="compact", head_dim=d, chunk=chunk, num_warps=warps,
                                  phase="stage" if stage else "move"), compact,
                             ({"cache_ptr": "*bf16", "stage_ptr": "*bf16", "bt_ptr": "*i32",
                               "lens_ptr": "*i32", "counts_ptr": "*i32", "kept_ptr": "*i32"}, set(),
                              dict(k_sd=1, v_sd=1, PAGE=16, D=d, CHUNK=chunk, STAGE=stage), warps)))
    jobs.append((*score_config("small", 64, 32, 32, 16, 64, "tf32", 64, 4, heads=3)[:1], score,
                 score_config("small", 64, 32, 32, 16, 64, "tf32", 64, 4, heads=3)[1]))
    if not args.quick:
        for precision in ("tf32", "bf16"):
            for block_t, warps in ((64, 8), (128, 8)):
                meta, a = score_config("reference", 128, 256, 256, 32, 256, precision, block_t, warps)
                jobs.append((meta, score, a))
    if args.smoke:
        jobs = [j for j in jobs if (j[0]["kernel"] == "select" and j[0]["block"] == 2048
                                    and j[0]["hist_in"]) or
                (j[0]["kernel"] == "compact" and j[0]["head_dim"] == 128 and j[0]["chunk"] == 16)
                or (j[0]["kernel"] == "score" and j[0]["policy"] == "small")]
    results, failed = [], 0
    for meta, fn, a in jobs:
        try:
            meta.update(compile_one(fn, *a, arch=args.arch))
            meta["status"] = "ok"
        except Exception as e:  # report every config
            meta.update(status="FAILED", error=f"{type(e).__name__}: {str(e)[:800]}")
            failed += 1
        results.append(meta)
        print(json.dumps(meta), flush=True)
    out = dict(target=f"cuda sm_{args.arch}", triton=triton.__version__, results=results, failed=failed)
    if not (args.quick or args.smoke):
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
