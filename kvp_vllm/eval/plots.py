"""Plots from the aggregated rows: accuracy vs cache size (one panel per task, one line per rule,
full cache dashed), task-averaged accuracy (one panel per protocol), the teacher-forced gold
log-likelihood loss vs cache size, and perplexity vs cache size. x = tokens kept per KV head (log
scale)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RULE_STYLE = {"kvp": ("C3", "o"), "oracle": ("k", "*"), "snapkv": ("C0", "s"), "tova": ("C1", "^"),
              "lagkv": ("C2", "v"), "keydiff": ("C4", "D"), "knorm": ("C5", "P"),
              "streaming": ("C6", "X"), "random": ("C7", "x")}
OTHER_STYLE = ("C9", "d")  # e.g. a second KVP policy merged in by benchmarks/compare_policies.py


def save_png(fig, path, dpi: int = 110) -> None:
    """fig as a palette PNG (128 colours): a third of matplotlib's RGBA size and the same look for line
    plots; result plots are tracked, and every GPU transfer carries the tracked tree."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, format="png",
                                                                                      optimize=True)


def _style(rule: str):
    """A rule's colour and marker; a stale variant ("tova@v1", runner.variant_label) keeps its rule's."""
    return RULE_STYLE.get(rule.split("@")[0].split("[")[0], OTHER_STYLE)


def _series(agg: List[Dict], task: str, protocol: str, metric: str):
    lines = defaultdict(list)
    full = None
    for a in agg:
        if a["task"] != task or a["protocol"] != protocol or a.get(metric) is None:
            continue
        if a["rule"] == "full":
            full = a
        else:
            lines[a["rule"]].append((a["kept_mean"], a[metric], a["n"]))
    return {r: sorted(v) for r, v in lines.items()}, full


def _style_axis(ax, title: str, ylabel: str) -> None:
    """Every panel: log2 cache-size x axis, small fonts, light grid."""
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("cache size (tokens kept per KV head)", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.tick_params(labelsize=6)
    ax.grid(alpha=0.3)


def _panel(ax, agg, task, protocol, metric, full_metric, ylabel):
    lines, full = _series(agg, task, protocol, metric)
    for rule in sorted(lines, key=_rule_order):
        color, marker = _style(rule)
        xs, ys, ns = zip(*lines[rule])
        ax.plot(xs, ys, marker=marker, color=color, label=rule, lw=1.2, ms=4)
    title = task
    if full is not None and full.get(full_metric) is not None:
        ax.axhline(full[full_metric], color="gray", ls="--", lw=1, label="full cache")
        title += f" (n={full['n']}, full={full[full_metric]:.2f})"
    _style_axis(ax, title, ylabel)


def _rule_order(rule: str) -> int:
    base = rule.split("@")[0].split("[")[0]
    return list(RULE_STYLE).index(base) if base in RULE_STYLE else 99


def plot_task_average(avg: List[Dict], out_dir: Path) -> List[Path]:
    """Task-averaged accuracy vs budget: one figure per length, one panel per protocol, one line per
    rule, full cache dashed. Absolute budgets only (fractions of the context have another x axis)."""
    written = []
    for length in sorted({a["length"] for a in avg}):
        sub = [a for a in avg if a["length"] == length]
        protocols = sorted({a["protocol"] for a in sub})
        fig, axes = plt.subplots(1, len(protocols), figsize=(5.2 * len(protocols), 3.8), squeeze=False)
        drawn = False
        for ax, protocol in zip(axes.flat, protocols):
            cells = [a for a in sub if a["protocol"] == protocol]
            lines = defaultdict(list)
            for a in cells:
                if a["budget"] != "full" and "." not in a["budget"]:
                    lines[a["rule"]].append((int(a["budget"]), a["accuracy"]))
            for rule in sorted(lines, key=_rule_order):
                color, marker = _style(rule)
                xs, ys = zip(*sorted(lines[rule]))
                ax.plot(xs, ys, marker=marker, color=color, label=rule, lw=1.2, ms=4)
                drawn = True
            full = next((a for a in cells if a["budget"] == "full"), None)
            title = protocol
            if full is not None:
                ax.axhline(full["accuracy"], color="gray", ls="--", lw=1, label="full cache")
                title += f" ({full['tasks']} tasks, {full['samples']} samples, full={full['accuracy']:.2f})"
            _style_axis(ax, title, "task-averaged accuracy")
        if drawn:
            handles, labels = axes.flat[0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 10), fontsize=7)
            fig.suptitle(f"task-averaged accuracy vs cache size - {length} tokens", fontsize=10)
            fig.tight_layout(rect=(0, 0.08, 1, 0.94))
            path = Path(out_dir) / f"eval_task_average_{length}.png"
            save_png(fig, path)
            written.append(path)
        plt.close(fig)
    return written


def plot_all(agg: List[Dict], out_dir: Path, task_avg: Optional[List[Dict]] = None) -> List[Path]:
    out_dir = Path(out_dir)
    written = plot_task_average(task_avg, out_dir) if task_avg else []
    qa_tasks = sorted({a["task"] for a in agg if "accuracy" in a})
    ppl_tasks = sorted({a["task"] for a in agg if "perplexity" in a})
    protocols = sorted({a["protocol"] for a in agg})
    for length in sorted({a["length"] for a in agg}):
        sub = [a for a in agg if a["length"] == length]
        for protocol in protocols:
            for metric, full_metric, ylabel, name in [
                    ("accuracy", "accuracy", "accuracy (all answers exact)", "accuracy"),
                    ("delta_logprob_per_token", "delta_logprob_per_token",
                     "gold log-lik./token vs full", "loglik")]:
                tasks = [t for t in qa_tasks if any(a["task"] == t and a["protocol"] == protocol for a in sub)]
                if not tasks:
                    continue
                cols = min(3, len(tasks))
                rows = (len(tasks) + cols - 1) // cols
                fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
                for ax, task in zip(axes.flat, tasks):
                    _panel(ax, sub, task, protocol, metric, full_metric, ylabel)
                for ax in list(axes.flat)[len(tasks):]:
                    ax.axis("off")
                handles, labels = axes.flat[0].get_legend_handles_labels()
                fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 10), fontsize=7)
                fig.suptitle(f"{name} vs cache size - {protocol} - {length} tokens", fontsize=10)
                fig.tight_layout(rect=(0, 0.05, 1, 0.96))
                path = out_dir / f"eval_{name}_{protocol}_{length}.png"
                save_png(fig, path)
                plt.close(fig)
                written.append(path)
        for task in ppl_tasks:
            for protocol in protocols:
                if not any(a["task"] == task and a["protocol"] == protocol for a in sub):
                    continue
                fig, ax = plt.subplots(figsize=(5, 3.6))
                _panel(ax, sub, task, protocol, "perplexity", "perplexity", "perplexity (lower is better)")
                ax.legend(fontsize=7)
                fig.tight_layout()
                path = out_dir / f"eval_perplexity_{task}_{length}.png"
                save_png(fig, path)
                plt.close(fig)
                written.append(path)
    return written
