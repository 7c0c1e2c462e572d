import pytest

from kvp_vllm.training.collect import CollectConfig, collect

# Harness tasks that fit a byte-tokenized 512-token prompt, and the chat kinds.
TINY_TASKS = ("niah_single_repeat", "essay_qa", "niah_single_words", "conversation")


@pytest.fixture(scope="session")
def tiny_traces(tmp_path_factory):
    """A small tiny-llama trace folder shared by the training tests (16 traces: 12 train, 2 val, 2 test).
    Tiny models tokenize bytes, so the harness's needle prompts need ~500 tokens."""
    out = tmp_path_factory.mktemp("traces") / "tiny"
    cfg = CollectConfig(model="tiny-llama", lengths=(512, 576), num_traces=16, answer_tokens=6, window=16,
                        traces_per_shard=4, tasks=TINY_TASKS)
    collect(cfg, out, progress=False)
    return out
