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


DEFAULT_SEED = 1234


@pytest.fixture
def seed(request):
    """A fixed seed (DEFAULT_SEED) so a run is reproducible; KVP_TEST_SEED=N runs other inputs
    (KVP_TEST_SEED=random draws a fresh one). The value is in the assertion messages and the test's
    user properties."""
    env = os.environ.get("KVP_TEST_SEED", "")
    value = (random.SystemRandom().randrange(2**31) if env == "random"
             else int(env) if env else DEFAULT_SEED)
    torch.manual_seed(value)
    random.seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
