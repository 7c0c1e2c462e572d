"""The trainer and CLI on tiny traces: checkpoint, log, plot, evaluation, bad input, and two-process DDP."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvp_vllm.policy import CheckpointError, KVPPolicy, ModelShape
from kvp_vllm.scorers import BASELINE_RULES, rule_definition
from kvp_vllm.training import cli
from kvp_vllm.training.collect import CollectConfig, TraceError, TraceSet, TraceUnion, collect, open_traces
from kvp_vllm.training.trainer import FitConfig, fit, parse_layers


def test_fit_writes_a_loadable_policy_log_and_plot(tiny_traces, tmp_path):
    out = fit(FitConfig(traces=str(tiny_traces), out=str(tmp_path / "ckpt"), steps=6, batch=2, samples=4,
                        warmup=2, eval_every=3), progress=False)
    ts = TraceSet(tiny_traces)
    policy = KVPPolicy.load(out, expect=ts.shape)
    extra = json.loads((out / "config.json").read_text())["extra"]
    assert extra["best_step"] in (0, 3, 6) and extra["train_traces"] == 12
    # what a rebuild checks first: the traces it trained on, and the machine's numerics
    assert extra["traces_sha256"] == ts.content_sha256
    assert extra["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    rows = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in rows) == 6 and sum("val_cost" in r for r in rows) == 3
    assert all(r["val_cost"] >= 1.0 - 1e-6 for r in rows if "val_cost" in r)
    assert (out / "train_curve.png").stat().st_size > 1000
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert policy.config.num_layers == 3
    # committed logs are gzipped and their plots are not committed: `kvp-train plot` redraws from either
    gz = tmp_path / "train_log.jsonl.gz"
    gz.write_bytes(gzip.compress((out / "train_log.jsonl").read_bytes()))
    assert cli.main(["plot", str(gz), "--out", str(tmp_path / "redrawn.png")]) == 0
    assert (tmp_path / "redrawn.png").stat().st_size > 1000
    assert cli.main(["plot", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_fit_and_evaluate_on_two_trace_folders(tiny_traces, tmp_path):
    """`--traces A,B`: one set whose ids name their folder, each folder keeping its own split; a fit
    trains on both folders' train traces; folders of another model are refused."""
    more = tmp_path / "more"
    collect(CollectConfig(model="tiny-llama", lengths=(640,), num_traces=8, answer_tokens=4, window=16,
                          traces_per_shard=4, tasks=("essay_qa",), seed=2_000_000), more, progress=False)
    union = open_traces(f"{tiny_traces},{more}")
    assert isinstance(union, TraceUnion) and union.shape == TraceSet(tiny_traces).shape
    assert union.split("train") == [f"0/{t}" for t in TraceSet(tiny_traces).split("train")] + \
        [f"1/{t}" for t in TraceSet(more).split("train")]
    assert union.meta("1/t00001")["target_tokens"] == 640
    assert torch.equal(union.load("1/t00001", 0)["keys"], TraceSet(more).load("t00001", 0)["keys"])
    out = fit(FitConfig(traces=f"{tiny_traces},{more}", out=str(tmp_path / "ckpt"), steps=2, batch=2,
                        samples=4, warmup=1, eval_every=2), progress=False)
    extra = json.loads((out / "config.json").read_text())["extra"]
    assert extra["train_traces"] == 12 + 6 and extra["val_traces"] == 2 + 1
    assert len(extra["trace_manifest_config"]) == 2
    assert extra["traces_sha256"] == f"{TraceSet(tiny_traces).content_sha256},{TraceSet(more).content_sha256}"
    assert cli.main(["evaluate", "--traces", f"{tiny_traces},{more}", "--split", "test", "--lengths", "640",
                     "--no-progress"]) == 0
    other = tmp_path / "qwen"
    collect(CollectConfig(model="tiny-qwen2", lengths=(512,), num_traces=1, answer_tokens=2, window=16,
                          traces_per_shard=1, tasks=("essay_qa",), seed=2_000_100), other, progress=False)
    with pytest.raises(TraceError, match="come from"):
        open_traces(f"{tiny_traces},{other}")
    with pytest.raises(TraceError, match="listed twice"):
        open_traces(f"{more},{more}")
    with pytest.raises(TraceError, match="not a trace id"):
        union.load("7/t00001", 0)


def test_bf16_autocast_path_trains_an_fp32_policy(tiny_traces, tmp_path):
    """The GPU default (bf16 autocast around the policy forward) exercised on CPU: the matmuls really
    run in bf16, the loss and gradients are finite, the exported weights are fp32."""
    from kvp_vllm.training.trainer import trace_loss, use_bf16

    ts = TraceSet(tiny_traces)
    model = KVPPolicy.random_init(ts.shape, seed=0)
    seen = []
    model.out.register_forward_hook(lambda m, i, o: seen.append(o.dtype))  # the last matmul
    cfg = FitConfig(traces=str(tiny_traces), out="", precision="bf16", samples=4)
    loss, _ = trace_loss(model, ts.load(ts.split("train")[0], 1), slice(2, 4), cfg, torch.device("cpu"),
                         torch.Generator().manual_seed(0))
    loss.backward()
    assert seen == [torch.bfloat16] and torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert use_bf16("auto", torch.device("cuda")) and not use_bf16("auto", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision"):
        use_bf16("fp8", torch.device("cpu"))
    out = fit(FitConfig(traces=str(tiny_traces), out=str(tmp_path / "bf16"), steps=3, batch=2, samples=4,
                        warmup=1, eval_every=3, precision="bf16"), progress=False)
    policy = KVPPolicy.load(out, expect=ts.shape)
    assert all(p.dtype == torch.float32 for p in policy.parameters())


def test_layer_range_and_lr_schedule(tiny_traces, tmp_path):
    assert list(parse_layers("1-2", 3)) == [1, 2] and list(parse_layers("all", 3)) == [0, 1, 2]
    with pytest.raises(ValueError):
        parse_layers("2-5", 3)
    out = fit(FitConfig(traces=str(tiny_traces), out=str(tmp_path / "c"), layers="1", steps=5, batch=1,
                        samples=2, warmup=2, lr=1e-2, min_lr=1e-4, eval_every=100), progress=False)
    rows = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines() if "lr" in l]
    lrs = [r["lr"] for r in rows]
    assert lrs[0] < lrs[1] and lrs[-1] < max(lrs)  # warm-up, then cosine decay
    # only layer 1's heads moved: compare with the same seed's initial weights
    torch.manual_seed(0)
    from kvp_vllm.policy import PolicyConfig
    init = KVPPolicy(PolicyConfig.small(TraceSet(tiny_traces).shape))
    trained = KVPPolicy.load(out)
    w0, w1 = init.key_proj.weight, trained.key_proj.weight  # [G=6, d, k]
    assert torch.equal(w0[:2], w1[:2]) and torch.equal(w0[4:], w1[4:]) and not torch.equal(w0[2:4], w1[2:4])


def test_cli_bad_inputs(tiny_traces, tmp_path, capsys):
    wrong = KVPPolicy.random_init(ModelShape(30, 3, 64, "SmolLM2-135M-Instruct"))
    wrong.save(tmp_path / "wrong")
    rc = cli.main(["evaluate", "--traces", str(tiny_traces), "--checkpoint", str(tmp_path / "wrong")])
    assert rc == 2 and "does not fit" in capsys.readouterr().err
    rc = cli.main(["fit", "--traces", str(tiny_traces), "--out", str(tmp_path / "o"), "--init",
                   str(tmp_path / "wrong"), "--steps", "1"])
    assert rc == 2 and not (tmp_path / "o" / "policy.safetensors").exists()
    rc = cli.main(["fit", "--traces", str(tmp_path / "none"), "--out", str(tmp_path / "o2")])
    assert rc == 2 and "not a trace folder" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    rc = cli.main(["collect", "--model", str(tmp_path / "missing-model"), "--out", str(tmp_path / "t")])
    assert rc == 2 and "unknown model" in capsys.readouterr().err and not (tmp_path / "t").exists()
    rc = cli.main(["fit", "--traces", str(tiny_traces), "--out", str(tmp_path / "o3"), "--budget-weighting", "lin"])
    assert rc == 2 and "budget weighting" in capsys.readouterr().err and not (tmp_path / "o3").exists()


def test_fit_with_log_budget_weighting(tiny_traces, tmp_path):
    """--budget-weighting log trains and selects on the log-weighted cost, recorded in the checkpoint."""
    out = fit(FitConfig(traces=str(tiny_traces), out=str(tmp_path / "ckpt"), steps=3, batch=2, samples=4,
                        warmup=1, eval_every=3, budget_weighting="log"), progress=False)
    extra = json.loads((out / "config.json").read_text())["extra"]
    assert extra["fit_config"]["budget_weighting"] == "log"
    vals = [json.loads(l)["val_cost"] for l in (out / "train_log.jsonl").read_text().splitlines() if "val_cost" in l]
    assert len(vals) == 2 and all(v >= 1.0 - 1e-6 for v in vals)


def test_cli_evaluate_table(tiny_traces, tmp_path):
    KVPPolicy.random_init(TraceSet(tiny_traces).shape).save(tmp_path / "p")
    out = tmp_path / "res" / "cost.json"
    assert cli.main(["evaluate", "--traces", str(tiny_traces), "--checkpoint", str(tmp_path / "p"),
                     "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    assert res["overall"]["oracle"] == pytest.approx(1.0, abs=1e-5)
    # every rule of the scorer registry's baseline list, KVP and the oracle, each with its definition
    assert set(res["overall"]) == {"kvp", "oracle", *BASELINE_RULES}
    assert res["rule_definitions"] == {r: rule_definition(r) for r in res["overall"]}
    for rule in ("kvp", *BASELINE_RULES):
        assert res["overall"][rule] >= 1.0 - 1e-6 and len(res["per_layer"][rule]) == 3
    assert "| kvp |" in out.with_suffix(".md").read_text()
    # --lengths keeps only the traces collected at those target lengths (the generalisation runs)
    assert cli.main(["evaluate", "--traces", str(tiny_traces), "--split", "all", "--lengths", "576",
                     "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    assert res["traces"] == 8 and res["lengths"] == [576]
    assert all(n <= 576 for n in res["prompt_tokens"])
    assert cli.main(["evaluate", "--traces", str(tiny_traces), "--lengths", "4096"]) == 2


@pytest.mark.timeout(180)
def test_torchrun_two_process_gloo(tiny_traces, tmp_path):
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           "-m", "kvp_vllm.training.cli", "fit", "--traces", str(tiny_traces), "--out", str(out),
           "--steps", "3", "--batch", "4", "--samples", "2", "--warmup", "1", "--eval-every", "3",
           "--device", "cpu", "--no-progress"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    extra = json.loads((out / "config.json").read_text())["extra"]
    assert extra["world_size"] == 2
    KVPPolicy.load(out, expect=TraceSet(tiny_traces).shape)


def test_shipped_smollm2_policy_loads():
    """The committed policy fits SmolLM2-135M-Instruct (30 layers x 3 KV heads, head_dim 64)."""
    from pathlib import Path

    import kvp_vllm
    folder = Path(kvp_vllm.__file__).parent / "checkpoints" / "SmolLM2-135M-Instruct"
    policy = KVPPolicy.load(folder, expect=ModelShape(30, 3, 64, "SmolLM2-135M-Instruct"))
    assert policy.config.model_name == "SmolLM2-135M-Instruct"
    extra = json.loads((folder / "config.json").read_text())["extra"]
    assert "kvp-train" in extra["command"]
    # its training log: validation cost fell from the start (its init) to the exported best
    vals = [json.loads(l)["val_cost"] for l in (folder / "train_log.jsonl").read_text().splitlines()
            if "val_cost" in l]
    assert 1.0 <= extra["best_val_normalised_cost"] == min(vals) < vals[0]
    with pytest.raises(CheckpointError):
        KVPPolicy.load(folder, expect=ModelShape(3, 2, 16, "tiny-llama"))


def test_recency_diagnostic_script(tiny_traces, tmp_path):
    """benchmarks/recency_kept.py: the oracle keeps the most future attention, StreamingLLM keeps only
    recent tokens (past its 4 sinks), every share is a fraction."""
    KVPPolicy.random_init(TraceSet(tiny_traces).shape).save(tmp_path / "p")
    out = tmp_path / "recency.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "recency_kept.py"
    proc = subprocess.run([sys.executable, str(script), "--traces", str(tiny_traces), "--checkpoint",
                           str(tmp_path / "p"), "--budgets", "64,128", "--recent", "128", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    cell = {(r["rule"], r["budget"]): r for r in res["rows"]}
    assert res["traces"] == 16 and all(n > 128 for n in res["prompt_tokens"])
    for b in (64, 128):
        assert all(cell[("oracle", b)]["kept_mass"] >= cell[(r, b)]["kept_mass"] - 1e-9
                   for r in ("kvp", "snapkv", "tova", "streaming", "keydiff", "lagkv"))
        assert cell[("streaming", b)]["recent_share"] == pytest.approx((b - 4) / b)
        assert all(0.0 <= r["recent_share"] <= 1.0 and 0.0 <= r["kept_mass"] <= 1.0 + 1e-6 for r in res["rows"])
    assert cell[("oracle", 128)]["kept_mass"] >= cell[("oracle", 64)]["kept_mass"]


def test_recency_diagnostic_refuses_unknown_rules(tmp_path):
    """--rules names rules of the scorer registry (default_rules); a misspelt one is an error, not
    silently left out of the table."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "recency_kept.py"
    proc = subprocess.run([sys.executable, str(script), "--traces", str(tmp_path / "none"), "--checkpoint",
                           str(tmp_path / "none"), "--rules", "kvp,tovaa", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown rule 'tovaa'" in proc.stderr, proc.stderr[-2000:]
    assert all(r in proc.stderr for r in BASELINE_RULES) and not (tmp_path / "r.json").exists()
