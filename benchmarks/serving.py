"""Serving benchmark: the same workload on the same fixed KV block pool, eviction off vs on.

Starts `kvp-vllm serve` twice (plain vLLM, then `--kv-eviction RULE --kv-budget B`), drives each with
one concurrent async OpenAI client (long needle-in-a-haystack chat prompts, modest outputs, burst or
Poisson arrivals) and records: peak concurrently running requests, preemptions, peak waiting requests,
output tokens/s, TTFT and time per output token (p50/p99), KV blocks in use over time, selection
overhead as a share of prefill time, and the needle answers' accuracy. Writes JSON + a plot and
prints the eviction/no-eviction ratios.

    python benchmarks/serving.py                       # full run (a few minutes on 2 CPU cores)
    python benchmarks/serving.py --quick --out /tmp/x  # reduced mode used by the test suite
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL_NAME = "smol"
FILLER_TOKENS = 25  # tokens per filler sentence of the needle prompt (SmolLM2 tokenizer)

FULL = dict(requests=24, min_tokens=2000, max_tokens=4000, output_tokens=32, budget=768,
            pool_blocks=420, block_size=32, rate=0.0)
QUICK = dict(requests=4, min_tokens=400, max_tokens=600, output_tokens=24, budget=128,
             pool_blocks=48, block_size=32, rate=0.0)


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


async def drive(url: str, items: List[dict], output_tokens: int) -> List[dict]:
    import openai

    from kvp_vllm.eval.tasks import score_answers

    t0 = time.perf_counter()

    async def one(item: dict) -> dict:
        await asyncio.sleep(item["arrival"])
        sent = time.perf_counter()
        stamps, text = [], []
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=item["prompt"], max_tokens=output_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            # every request makes exactly output_tokens in both runs: throughput compares like with like
            extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
                text.append(chunk.choices[0].text)
        answer = "".join(text)
        n_out = usage.completion_tokens if usage else len(stamps)
        ttft = stamps[0] - sent if stamps else None
        first = stamps[0] - t0 if stamps else None
        tpot = (stamps[-1] - stamps[0]) / max(n_out - 1, 1) if len(stamps) > 1 else None
        return dict(id=item["id"], prompt_tokens=usage.prompt_tokens if usage else None,
                    output_tokens=n_out, ttft=ttft, tpot=tpot, start=sent - t0, first_token=first,
                    end=time.perf_counter() - t0, correct=score_answers(answer, item["answers"])[0],
                    answer=answer)

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


def run_server(label: str, cfg: dict, eviction: List[str], items: List[dict], workdir: Path) -> dict:
    from kvp_vllm.assets import smollm2_path
    from kvp_vllm.serving.launch import ServerProcess

    args = ["--enforce-eager", "--dtype", "bfloat16", "--block-size", str(cfg["block_size"]),
            "--num-gpu-blocks-override", str(cfg["pool_blocks"]), "--max-model-len",
            str(cfg["max_tokens"] + 600), "--max-num-seqs", "64", "--served-model-name", MODEL_NAME,
            "--disable-uvicorn-access-log", *eviction]
    print(f"[{label}] starting server: {' '.join(eviction) or 'no eviction'}", file=sys.stderr)
    with ServerProcess(smollm2_path(), args, workdir / f"{label}.log", start_timeout=900) as url:
        asyncio.run(drive(url, items[:1], 2))  # warm-up, not measured
        before = scrape(url)
        sampler = Sampler(url, cfg["pool_blocks"])
        sampler.start()
        t0 = time.perf_counter()
        results = asyncio.run(drive(url, items, cfg["output_tokens"]))
        wall = time.perf_counter() - t0
        time.sleep(0.6)
        sampler.stop_event.set()
        sampler.join()
        after = scrape(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    prefill_s = delta.get("vllm:request_prefill_time_seconds_sum", 0.0)
    selection_s = delta.get("kvp_selection_latency_seconds_sum", 0.0)
    return dict(
        label=label, eviction=eviction, wall_s=wall,
        requests=len(results), correct=sum(r["correct"] for r in results),
        accuracy=sum(r["correct"] for r in results) / len(results),
        output_tokens=sum(r["output_tokens"] for r in results),
        output_tokens_per_s=sum(r["output_tokens"] for r in results) / wall,
        peak_running=max((s["running"] for s in sampler.samples), default=0.0),  # vLLM's gauge, sampled
        peak_decoding_client=peak_decoding(results),
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


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for run in report["runs"]:
        t = [s["t"] for s in run["timeline"]]
        axes[0].plot(t, [s["blocks_used"] for s in run["timeline"]], label=run["label"])
        axes[1].plot(t, [s["running"] for s in run["timeline"]], label=run["label"])
    axes[0].axhline(report["config"]["pool_blocks"], color="gray", ls="--", lw=0.8, label="pool")
    axes[0].set(xlabel="seconds", ylabel="KV blocks in use", title="KV blocks in use")
    axes[1].set(xlabel="seconds", ylabel="requests", title="Concurrently running requests")
    for ax in axes:
        ax.legend()
    fig.suptitle(f"{report['config']['requests']} needle requests, "
                 f"{report['config']['min_tokens']}-{report['config']['max_tokens']} prompt tokens, "
                 f"pool {report['config']['pool_blocks']} blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced mode: a few short requests")
    p.add_argument("--rule", default="kvp", help="eviction rule of the second run (default kvp)")
    p.add_argument("--budget", type=int, help="tokens kept per KV head (default ~25%% of the prompt)")
    p.add_argument("--requests", type=int)
    p.add_argument("--pool-blocks", type=int, help="fixed KV block pool of both servers")
    p.add_argument("--output-tokens", type=int, help="tokens generated per request (EOS ignored)")
    p.add_argument("--rate", type=float, help="Poisson arrivals per second (0 = one burst)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and the plot")
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("budget", "requests", "pool_blocks", "output_tokens", "rate"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if cfg["budget"] < 20 or cfg["requests"] < 1 or cfg["pool_blocks"] < 1 or cfg["output_tokens"] < 1:
        p.error("--budget must be >= 20, --requests, --pool-blocks and --output-tokens >= 1")
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
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "serving_quick" if args.quick else "serving"
    tmp = args.out / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out / f"{stem}.json")
    plot(report, args.out / f"{stem}.png")
    print(f"\n{'':<22}{'no eviction':>14}{ev['label']:>18}{'ratio':>9}")
    for key in ("peak_running", "peak_decoding_client", "preemptions", "peak_waiting", "output_tokens_per_s",
                "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "accuracy"):
        a, b = base[key], ev[key]
        r = f"{b / a:.2f}x" if a else "-"
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{key:<22}{fmt(a):>14}{fmt(b):>18}{r:>9}")
    share = ev["selection_share_of_prefill"]
    print(f"selection overhead: {ev['selection_seconds']:.3f} s = "
          f"{'-' if share is None else f'{100 * share:.2f}%'} of {ev['prefill_seconds']:.2f} s prefill")
    print(f"wrote {args.out / (stem + '.json')} and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
