"""Synthetic model folders for speed measurements: a real architecture's config.json served by vLLM with
`--load-format dummy` (random weights; throughput, memory and latency do not depend on weight values),
a word-level tokenizer built on the spot (no hub access: "w0".."w{V-1}", whitespace pre-tokenizer, one
token per vocabulary id), and a KVP policy of the model's shape with random weights.

    write_model(folder, "llama-3.1-8b")   # Llama-3.1-8B's shape (32 layers, 8 KV heads, head_dim 128)
    write_model(folder, "tiny")           # the same fields at toy sizes, for the CPU rehearsal
    write_policy(folder / "policy", folder)

Prompts for such a model are lists of random token ids (`random_prompt`); no accuracy can be measured.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List

#: Llama-3.1-8B's config.json without rope_scaling (plain RoPE; speed is the same) and with head_dim
#: spelled out. max_position_embeddings is the real one (131072), so 32K prompts fit.
LLAMA_31_8B: Dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "head_dim": 128,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",  # as released (transformers 5 warns about Mistral regexes
                                            # when a local config has no version)
    "use_cache": True,
    "vocab_size": 128256,
}

#: The same fields at toy sizes (GQA 4:2, head_dim 64): the CPU rehearsal of the 8B flow.
TINY = dict(LLAMA_31_8B, hidden_size=256, head_dim=64, intermediate_size=512, num_attention_heads=4,
            num_hidden_layers=2, num_key_value_heads=2, vocab_size=2048, bos_token_id=2046,
            eos_token_id=2047, max_position_embeddings=8192)

SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "tiny": TINY}


def model_config(name: str, **overrides) -> Dict:
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SHAPES)}")
    cfg = dict(SHAPES[name], **overrides)
    cfg["_name_or_path"] = f"synthetic-{name}"
    return cfg


def write_tokenizer(folder: Path, vocab_size: int, bos_id: int, eos_id: int, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json of a word-level tokenizer with exactly vocab_size tokens
    ("w<id>"), loadable offline by transformers' AutoTokenizer (PreTrainedTokenizerFast) and vLLM."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # words come back space-separated ("w5 w17"), one word per token, so streamed chunks are never empty
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": f"w{bos_id}", "eos_token": f"w{eos_id}", "unk_token": "w0",
        "model_max_length": max_length, "clean_up_tokenization_spaces": False,
    }, indent=1))


def write_model(folder: Path, name: str = "llama-3.1-8b", **overrides) -> Path:
    """A model folder (config.json, generation_config.json, tokenizer) for `--load-format dummy`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model_config(name, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}))
    write_tokenizer(folder, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"],
                    cfg["max_position_embeddings"])
    return folder


def write_policy(folder: Path, model_folder: Path, reference: bool = True, seed: int = 0) -> Path:
    """A KVP policy of the model's shape with random weights (reference widths by default: the
    paper's 256-wide paths, the size whose selection cost the GPU benchmark measures)."""
    from kvp_vllm.policy import KVPPolicy, ModelShape

    cfg = json.loads((Path(model_folder) / "config.json").read_text())
    shape = ModelShape(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"],
                       head_dim=cfg["head_dim"], model_name=cfg["_name_or_path"])
    KVPPolicy.random_init(shape, seed=seed, reference=reference).save(folder)
    return Path(folder)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> List[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]
