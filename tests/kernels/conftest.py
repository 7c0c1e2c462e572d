"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter: the variable must
be set before triton is imported anywhere in the test process."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def seed(request):
    """A fresh seed per test run (printed on failure through the test id / assertion messages).
    Set KVP_TEST_SEED to replay one."""
    value = int(os.environ.get("KVP_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(value)
    random.seed(value)
    request.node.user_properties.append(("seed", value))
    return value
