import torch

# One thread per process: on the shared 2-core CI machine two threads were 5-8x slower under load.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: runs SmolLM2-135M (CPU, about a minute)")
