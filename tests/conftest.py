"""Shared fixtures. Real-model fixtures load SmolLM2 once per session (converted once into the cache)."""

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvp_vllm.assets import smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)
