"""Trace collection (`kvp-train collect`): run a Hugging Face causal LM on prompts plus its own greedy
answer, and store per layer and KV head what training and evaluation need:

  keys, values   [kv_heads, n, d]    post-RoPE, of the n prompt tokens (bf16)
  importance     [kv_heads, n]       future importance c_i = sum over the answer's queries of the max over
                                     the KV head's GQA query group of the causal softmax attention (fp32),
                                     computed here so the answer queries need not be stored
  window_queries [q_heads, W, d]     post-RoPE queries of the last W prompt tokens (bf16), only so the
                                     query-aware baselines (TOVA, SnapKV) can be evaluated on the traces

With `decode_tokens` G > 0 the model first writes G tokens of its own (greedy, EOS banned, the long-
generation harness's `greedy_continuation`) and the trace's "prompt" is the prompt plus those G tokens:
the cache a server re-compacts in the middle of a long generation, whose future is more of the
model's own text.

`future` picks the answer whose queries define the importance: "greedy" (the model's own answer, the
paper's setting) or "reference" (teacher-forced on the harness task's reference continuation: the
held-out essay text of ppl_essay, the canonical answer of a QA task; the answer the harness scores,
so the target is what perplexity measures; chat tasks have none and are refused).

`compress_at` picks where the stored cache ends: "prompt" (the whole prompt, question included: the
query-aware protocol) or "context" (the harness task's context alone: the query-agnostic protocol, a
document compressed before its question is known). With "context" the question is fed after the cache
and its queries count in the importance beside the answer's (the harness's query-agnostic oracle);
chat tasks have no context/question split and are refused.

Layout: <out>/manifest.json and <out>/layer_LL/shard_SSSSS.safetensors (one file per layer and shard of
traces; tensor names "<trace_id>.<field>"), so training can stream one layer's data. Each shard's files
are written under temporary names, renamed, and only then recorded (with sha256 and size) in the
manifest, itself replaced atomically: an interrupted run resumes at the first unrecorded shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..assets import sha256_file
from ..environment import numerics_environment
from ..importance import future_importance
from ..policy import ModelShape
from . import prompts

MANIFEST = "manifest.json"
TRACE_FORMAT = 1
FIELDS = ("keys", "values", "importance", "window_queries")
FUTURES = ("greedy", "reference")
COMPRESS_POINTS = ("prompt", "context")


class TraceError(ValueError):
    """A trace folder is missing, corrupt, incomplete, or from another model."""


@dataclass
class CollectConfig:
    model: str = "smollm2"
    lengths: Sequence[int] = (512, 1024, 1536, 2048)
    num_traces: int = 160
    answer_tokens: int = 48
    window: int = 64                     # queries kept for TOVA/SnapKV evaluation
    decode_tokens: int = 0               # own greedy tokens appended to the prompt (mid-generation cache)
    future: str = "greedy"               # whose queries define importance: FUTURES
    compress_at: str = "prompt"          # where the stored cache ends: COMPRESS_POINTS
    tasks: Sequence[str] = prompts.DEFAULT_MIX
    seed: int = prompts.TRAIN_SEED_BASE  # trace i uses seed + i
    traces_per_shard: int = 8
    max_disk_gb: float = 10.0
    dtype: str = "auto"                  # auto: bfloat16 on GPU, float32 on CPU (faster there)
    device: str = "cpu"


def resolve_model(name: str) -> Path:
    """'smollm2', a tiny test model name, or a local Hugging Face model folder."""
    from ..assets import TINY_SHAPES, smollm2_path, tiny_model_path

    if name.lower() in ("smollm2", "smollm2-135m-instruct", "smollm2-135m"):
        return smollm2_path()
    if name in TINY_SHAPES:
        return tiny_model_path(name)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise TraceError(f"unknown model {name!r}: not 'smollm2', not a tiny test model "
                         f"({', '.join(TINY_SHAPES)}), and not a folder with a config.json")
    return path


def load_model(path: Path, dtype: str = "auto", device: str = "cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure here means "not a usable model folder"
        raise TraceError(f"{path} is not a Hugging Face model folder: {e}") from e
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not tokenizer("a b c", add_special_tokens=False)["input_ids"]:
            raise ValueError("empty vocabulary")  # transformers builds one from a folder without files
    except Exception:  # noqa: BLE001 - test models are saved without a tokenizer
        tokenizer = prompts.ByteTokenizer(config.vocab_size)
    name = Path(getattr(config, "name_or_path", "") or path.name).name or path.name
    name = name[:-5] if name.endswith("-bf16") else name
    return model, tokenizer, ModelShape.from_hf_config(config, name)


def plan(cfg: CollectConfig) -> List[dict]:
    """The deterministic list of traces: id, task, target length, seed."""
    out = []
    for i in range(cfg.num_traces):
        length = cfg.lengths[i % len(cfg.lengths)]
        task = cfg.tasks[(i // len(cfg.lengths)) % len(cfg.tasks)]
        out.append({"id": f"t{i:05d}", "task": task, "target_tokens": int(length), "seed": cfg.seed + i})
    return out


@torch.no_grad()
def collect_one(model, tokenizer, item: dict, answer_tokens: int, window: int, decode_tokens: int = 0,
                reference: Optional[Sequence[int]] = None, question: Sequence[int] = ()) -> dict:
    """One trace: prefill the prompt (capturing the last `window` queries), feed `question` (if any),
    decode greedily (or feed the first `answer_tokens` of `reference`, teacher-forced), capturing the
    queries of every token after the prompt, then compute the future importance per layer. With
    `decode_tokens`, the model's own greedy continuation of that many tokens is appended to the prompt
    first."""
    from ..capture import forward_capture

    ids = item.get("prompt_ids") or prompts.prompt_ids(tokenizer, item["task"], item["target_tokens"],
                                                        item["seed"])
    eos = getattr(tokenizer, "eos_token_id", None)
    generated: List[int] = []
    if decode_tokens:
        from ..eval.longgen import greedy_continuation

        generated = greedy_continuation(model, ids, decode_tokens, banned=[] if eos is None else [eos])
        ids = list(ids) + generated
    n = len(ids)
    device = next(model.parameters()).device
    pre = forward_capture(model, torch.tensor([ids], device=device), query_last=window)
    keys = [k.clone() for k in pre.keys]        # prompt keys/values (the cache grows in place later)
    values = [v.clone() for v in pre.values]
    wq = [q.clone() for q in pre.queries]
    answer, answer_q = [], [[] for _ in keys]
    cache, logits = pre.cache, pre.logits
    if question:  # teacher-forced in one forward; its queries are part of the future
        step = forward_capture(model, torch.tensor([list(question)], device=device), cache=cache,
                               query_last=len(question))
        for l, q in enumerate(step.queries):
            answer_q[l].append(q)
        cache, logits = step.cache, step.logits
    for i in range(answer_tokens if reference is None else min(answer_tokens, len(reference))):
        tok = int(logits[0, -1].float().argmax()) if reference is None else int(reference[i])
        answer.append(tok)
        step = forward_capture(model, torch.tensor([[tok]], device=device), cache=cache,
                               query_last=1)
        for l, q in enumerate(step.queries):
            answer_q[l].append(q)
        cache, logits = step.cache, step.logits
        if eos is not None and tok == eos:
            break
    full_keys = step.keys
    out = {"n_prompt": n, "n_answer": len(answer), "answer": answer, "generated": generated,
           "layers": []}
    for l in range(len(keys)):
        q = torch.cat(answer_q[l], dim=1)  # [q_heads, F, d]
        c = future_importance(q, full_keys[l], n)
        out["layers"].append({"keys": keys[l].to(torch.bfloat16).cpu(),
                              "values": values[l].to(torch.bfloat16).cpu(), "importance": c.float().cpu(),
                              "window_queries": wq[l].to(torch.bfloat16).cpu()})
    return out


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _config_key(cfg: dict) -> dict:
    """Settings that must match to resume into an existing folder."""
    key = {k: cfg.get(k) for k in ("lengths", "answer_tokens", "window", "tasks", "seed", "traces_per_shard")}
    # folders from before these settings existed: 0, greedy and prompt
    return {**key, "decode_tokens": cfg.get("decode_tokens", 0), "future": cfg.get("future", "greedy"),
            "compress_at": cfg.get("compress_at", "prompt")}


def _check_harness_prompt_only(cfg: CollectConfig, option: str, default: str, lacks: str, why: str) -> None:
    """An option that needs a harness task's own prompt: no chat task, no model-written text after it."""
    if cfg.decode_tokens:
        raise TraceError(f"{option} needs --decode-tokens 0: {why}")
    chat = sorted(set(cfg.tasks) & set(prompts.CHAT_TASKS))
    if chat:
        raise TraceError(f"{option}: {', '.join(chat)} has no {lacks}; drop it from --tasks or collect it "
                         f"with {default}")


def collect(cfg: CollectConfig, out: str | os.PathLike, progress: bool = True) -> Path:
    """Collect (or resume) a trace folder. Returns the folder."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    if cfg.answer_tokens < 1 or cfg.num_traces < 1 or min(cfg.lengths) < 32 or cfg.decode_tokens < 0:
        raise TraceError("need answer_tokens >= 1, num_traces >= 1, every length >= 32 and decode_tokens >= 0")
    if cfg.seed < prompts.TRAIN_SEED_BASE:
        raise TraceError(f"--seed must be at least {prompts.TRAIN_SEED_BASE}: smaller seeds are the "
                         f"evaluation harness's, and training on its samples would leak them")
    try:
        prompts.check_tasks(cfg.tasks)
    except ValueError as e:
        raise TraceError(str(e)) from None
    if cfg.future not in FUTURES:
        raise TraceError(f"unknown future {cfg.future!r}; choose one of {', '.join(FUTURES)}")
    if cfg.future == "reference":
        _check_harness_prompt_only(cfg, "--future reference", "--future greedy", "reference continuation",
                                   "after the model's own text there is no reference continuation")
    if cfg.compress_at not in COMPRESS_POINTS:
        raise TraceError(f"unknown compress_at {cfg.compress_at!r}; choose one of {', '.join(COMPRESS_POINTS)}")
    if cfg.compress_at == "context":
        _check_harness_prompt_only(cfg, "--compress-at context", "--compress-at prompt", "context/question split",
                                   "the question follows the context, not the model's own text")
    model_path = resolve_model(cfg.model)  # fails before anything is written
    out = Path(out).expanduser()
    manifest_path = out / MANIFEST
    cfg_dict = {k: (list(v) if isinstance(v, (tuple, list)) else v) for k, v in asdict(cfg).items()}
    model, tokenizer, shape = load_model(model_path, cfg.dtype, cfg.device)
    # Every prompt is built before anything is written: a task that cannot fit its length fails now.
    items = plan(cfg)
    for item in items:
        try:
            if cfg.compress_at == "context":
                item["prompt_ids"], item["question_ids"] = prompts.context_and_question_ids(
                    tokenizer, item["task"], item["target_tokens"], item["seed"])
            else:
                item["prompt_ids"] = prompts.prompt_ids(tokenizer, item["task"], item["target_tokens"],
                                                        item["seed"])
            if cfg.future == "reference":
                item["reference_ids"] = prompts.reference_ids(tokenizer, item["task"], item["target_tokens"],
                                                              item["seed"])
        except ValueError as e:  # the harness's TaskError included
            raise TraceError(f"cannot build the {item['task']} prompt at {item['target_tokens']} "
                             f"tokens: {e}") from None
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("shape") != asdict(shape) and \
                (manifest["shape"]["num_layers"], manifest["shape"]["num_kv_heads"],
                 manifest["shape"]["head_dim"]) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
            raise TraceError(f"{out} holds traces of {manifest['shape'].get('model_name')!r}, not of "
                             f"{shape.model_name!r}: use another --out folder")
        if _config_key(manifest["config"]) != _config_key(cfg_dict):
            raise TraceError(f"{out} was collected with other settings {_config_key(manifest['config'])}; "
                             f"resume with the same settings or use another --out folder")
        manifest["config"]["num_traces"] = max(cfg.num_traces, manifest["config"]["num_traces"])
    else:
        out.mkdir(parents=True, exist_ok=True)
        if any(out.iterdir()):
            raise TraceError(f"{out} is not empty and has no {MANIFEST}; refusing to write into it")
        manifest = {"format": TRACE_FORMAT, "model": shape.model_name, "model_path": str(model_path),
                    "shape": asdict(shape), "config": cfg_dict,
                    "prompt_generator": "kvp_vllm.training.prompts (eval harness tasks + essay_qa, "
                                        "conversation)",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "shards": [], "traces": {}}
        _write_json_atomic(manifest_path, manifest)
    per = cfg.traces_per_shard
    shards = [items[i:i + per] for i in range(0, len(items), per)]
    done = {s["shard"] for s in manifest["shards"]}
    used = sum(f["bytes"] for s in manifest["shards"] for f in s["files"].values())
    bar = tqdm(total=len(items), initial=sum(len(shards[i]) for i in done if i < len(shards)),
               desc="traces", unit="trace", disable=not progress)
    for s, batch in enumerate(shards):
        if s in done:
            continue
        if used > cfg.max_disk_gb * 2**30:
            bar.write(f"[kvp-train] stopping: {used / 2**30:.2f} GB written, limit {cfg.max_disk_gb} GB")
            break
        traces = []
        for item in batch:
            traces.append((item, collect_one(model, tokenizer, item, cfg.answer_tokens, cfg.window,
                                                 cfg.decode_tokens, item.get("reference_ids"),
                                                 item.get("question_ids", ()))))
            bar.update(1)
        files, staged = {}, []
        try:
            for l in range(shape.num_layers):
                layer_dir = out / f"layer_{l:02d}"
                layer_dir.mkdir(exist_ok=True)
                tensors = {f"{item['id']}.{k}": tr["layers"][l][k].contiguous()
                           for item, tr in traces for k in FIELDS}
                fd, tmp = tempfile.mkstemp(dir=layer_dir, prefix=".shard-", suffix=".tmp")
                os.close(fd)
                # one metadata key: safetensors writes several in hash order, and the file's sha256
                # is the content digest a rebuild compares (the layer is in the path)
                save_file(tensors, tmp, metadata={"format": "kvp-traces"})
                staged.append((Path(tmp), layer_dir / f"shard_{s:05d}.safetensors"))
            for tmp, final in staged:
                os.replace(tmp, final)
                files[str(int(final.parent.name[6:]))] = {"name": f"{final.parent.name}/{final.name}",
                                                         "sha256": sha256_file(final),
                                                         "bytes": final.stat().st_size}
        finally:
            for tmp, _ in staged:
                if tmp.exists():
                    tmp.unlink()
        for item, tr in traces:
            meta = {k: v for k, v in item.items() if k not in ("prompt_ids", "reference_ids", "question_ids")}
            manifest["traces"][item["id"]] = {**meta, "shard": s, "n_prompt": tr["n_prompt"],
                                              "n_answer": tr["n_answer"], "answer_ids": tr["answer"],
                                              "answer": tokenizer.decode(tr["answer"]),
                                              **({"question_ids": item["question_ids"]} if "question_ids" in item else {}),
                                              **({"generated_ids": tr["generated"]} if tr["generated"] else {})}
        manifest["shards"].append({"shard": s, "traces": [it["id"] for it, _ in traces], "files": files,
                                   "environment": numerics_environment()})
        used += sum(f["bytes"] for f in files.values())
        manifest["bytes"] = used
        _write_json_atomic(manifest_path, manifest)
    bar.close()
    return out


# ---------------------------------------------------------------------------------------------
# Reading traces


class TraceSet:
    """A collected trace folder, read lazily (one layer's shard at a time, memory-mapped)."""

    def __init__(self, folder: str | os.PathLike, verify: bool = True):
        self.folder = Path(folder).expanduser()
        path = self.folder / MANIFEST
        if not path.is_file():
            raise TraceError(f"{self.folder} is not a trace folder (no {MANIFEST}); run `kvp-train "
                             f"collect` first")
        try:
            self.manifest = json.loads(path.read_text())
            s = self.manifest["shape"]
            self.shape = ModelShape(s["num_layers"], s["num_kv_heads"], s["head_dim"], s["model_name"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise TraceError(f"{path} is not a valid trace manifest: {e}") from e
        if self.manifest.get("format") != TRACE_FORMAT:
            raise TraceError(f"{path}: trace format {self.manifest.get('format')!r}, expected {TRACE_FORMAT}")
        if not self.manifest["shards"]:
            raise TraceError(f"{self.folder} holds no complete shard yet")
        self.verify = verify
        self._verified: set = set()
        self._handles: Dict[str, object] = {}
        self._shard_of = {tid: meta["shard"] for tid, meta in self.manifest["traces"].items()}
        self._files = {s["shard"]: s["files"] for s in self.manifest["shards"]}
        self.trace_ids = sorted(tid for tid in self._shard_of if self._shard_of[tid] in self._files)

    def check_model(self, shape: ModelShape) -> None:
        got = (self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim)
        want = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        if got != want:
            raise TraceError(f"traces in {self.folder} come from {self.shape.model_name!r} "
                             f"(layers, kv_heads, head_dim)={got}, but the policy/model is "
                             f"{shape.model_name!r} {want}")

    def meta(self, tid: str) -> dict:
        return self.manifest["traces"][tid]

    def _open(self, layer: int, shard: int):
        from safetensors import SafetensorError, safe_open

        info = self._files[shard].get(str(layer))
        if info is None:
            raise TraceError(f"shard {shard} of {self.folder} has no file for layer {layer}")
        path = self.folder / info["name"]
        key = info["name"]
        if key in self._handles:
            return self._handles[key]
        if not path.is_file():
            raise TraceError(f"trace shard {path} is missing")
        size = path.stat().st_size
        if size == 0 or size != info["bytes"]:
            raise TraceError(f"trace shard {path} is empty or truncated ({size} bytes, "
                             f"manifest says {info['bytes']})")
        if self.verify and key not in self._verified:
            if sha256_file(path) != info["sha256"]:
                raise TraceError(f"trace shard {path} is corrupt (sha256 does not match the manifest)")
            self._verified.add(key)
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, Exception) as e:  # noqa: BLE001
            raise TraceError(f"trace shard {path} cannot be read: {e}") from e
        self._handles[key] = handle
        return handle

    def load(self, tid: str, layer: int, fields: Sequence[str] = FIELDS) -> Dict[str, torch.Tensor]:
        handle = self._open(layer, self._shard_of[tid])
        try:
            return {f: handle.get_tensor(f"{tid}.{f}") for f in fields}
        except Exception as e:  # noqa: BLE001
            raise TraceError(f"trace {tid} layer {layer} cannot be read from {self.folder}: {e}") from e

    @property
    def content_sha256(self) -> str:
        """One digest of the complete shards' files (from the manifest's sha256s): equal digests, equal
        traces. A fit records it, so a rebuild can check its traces before training on them."""
        shas = sorted(f["sha256"] for s in self.manifest["shards"] for f in s["files"].values())
        return hashlib.sha256("\n".join(shas).encode()).hexdigest()

    def split(self, name: str) -> List[str]:
        """Deterministic split by trace index: every 8th trace (index % 8 == 0) is 'test', index % 8
        == 4 is 'val' (model selection), the rest 'train'."""
        def which(tid):
            i = int(tid[1:])
            return "test" if i % 8 == 0 else "val" if i % 8 == 4 else "train"
        if name == "all":
            return list(self.trace_ids)
        return [t for t in self.trace_ids if which(t) == name]


class TraceUnion:
    """Several trace folders of one model read as one set (`kvp-train fit --traces A,B`): e.g. a
    needle-heavy 1K-4K collection beside 8K essay continuations, each collected with its own settings.
    Trace ids are `<folder index>/<id>`; every folder keeps its own train/val/test split."""

    def __init__(self, sets: Sequence[TraceSet]):
        if len(sets) < 2:
            raise TraceError("a union needs at least two trace folders")
        first = sets[0]
        for other in sets[1:]:
            other.check_model(first.shape)  # same layers, KV heads and head_dim, or a clear error
            if other.shape.model_name != first.shape.model_name:
                raise TraceError(f"{other.folder} holds traces of {other.shape.model_name!r}, "
                                 f"{first.folder} of {first.shape.model_name!r}: one model per set")
        self.sets = list(sets)
        self.shape = first.shape
        self.folder = ",".join(str(t.folder) for t in self.sets)
        self.manifest = {"config": [t.manifest["config"] for t in self.sets],
                         "model_path": first.manifest.get("model_path")}
        self.trace_ids = [f"{i}/{tid}" for i, t in enumerate(self.sets) for tid in t.trace_ids]
        self.content_sha256 = ",".join(t.content_sha256 for t in self.sets)  # like `folder`: one per set

    def _resolve(self, tid: str):
        i, _, inner = tid.partition("/")
        if not i.isdigit() or int(i) >= len(self.sets) or not inner:
            raise TraceError(f"{tid!r} is not a trace id of this union (expected <folder index>/<id>)")
        return self.sets[int(i)], inner

    def meta(self, tid: str) -> dict:
        ts, inner = self._resolve(tid)
        return ts.meta(inner)

    def load(self, tid: str, layer: int, fields: Sequence[str] = FIELDS) -> Dict[str, torch.Tensor]:
        ts, inner = self._resolve(tid)
        return ts.load(inner, layer, fields)

    def split(self, name: str) -> List[str]:
        return [f"{i}/{tid}" for i, t in enumerate(self.sets) for tid in t.split(name)]


def open_traces(spec: str | os.PathLike, verify: bool = True):
    """One trace folder (TraceSet) or several, comma separated (TraceUnion)."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise TraceError("no trace folder given")
    if len(parts) == 1:
        return TraceSet(parts[0], verify=verify)
    if len(set(parts)) != len(parts):
        raise TraceError(f"a trace folder is listed twice in {spec!r}")
    return TraceUnion([TraceSet(p, verify=verify) for p in parts])

