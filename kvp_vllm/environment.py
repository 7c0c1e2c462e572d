"""What a result was computed on. fp32 CPU runs are deterministic on one kind of machine, but the last
digits move with the CPU's vector instructions: stage 7's traces collected again on an AMD AVX2 machine
differed from the first collection's in the sixth significant digit, and the fit from them gave other
weights. Traces, policies and evaluation results record this so that a rebuild can tell why it
differs."""

from __future__ import annotations

import platform

import torch


def numerics_environment() -> dict:
    """Versions and CPU features that decide the last digits of a CPU result."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
