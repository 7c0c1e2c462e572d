"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

triton.jit picks the interpreter when a kernel is *defined*, and the interpreter checks the variable
again when it runs, so TRITON_INTERPRET=1 is set while our kernel modules are imported and, through an
autouse fixture, during each test of this folder — and nowhere else, so it does not leak into the other
tests of the same pytest run (or into the vLLM servers they start).
"""

import os
import random

import pytest
import torch

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import kvp_vllm.kernels.compact  # noqa: E402,F401
    import kvp_vllm.kernels.score_select  # noqa: E402,F401
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture
def seed(request):
    """A fresh seed per test run (printed on failure through the test id / assertion messages).
    Set KVP_TEST_SEED to replay one."""
    value = int(os.environ.get("KVP_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(value)
    random.seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
