import pytest

from kvp_vllm.training.collect import CollectConfig, collect


@pytest.fixture(scope="session")
def tiny_traces(tmp_path_factory):
    """A small tiny-llama trace folder shared by the training tests (16 traces: 12 train, 2 val, 2 test)."""
    out = tmp_path_factory.mktemp("traces") / "tiny"
    cfg = CollectConfig(model="tiny-llama", lengths=(64, 96), num_traces=16, answer_tokens=6, window=16,
                        traces_per_shard=4)
    collect(cfg, out, progress=False)
    return out
