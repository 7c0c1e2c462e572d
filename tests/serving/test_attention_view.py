"""The attention view of compacted rows (attention_view.py), the runner guard and the CLI's runner
settings: GPU-independent parts of GPU eviction, checked on CPU tensors with a stand-in runner."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvp_vllm.serving.attention_view import AttentionView

BS = 16


def runner(rows, seq_lens):
    """The model-runner buffers the view touches, as vLLM lays them out (max_num_reqs rows)."""
    table = torch.tensor(rows, dtype=torch.int32)
    block_table = SimpleNamespace(block_table=SimpleNamespace(gpu=table))
    lens = torch.zeros(table.shape[0], dtype=torch.int32)
    lens[:len(seq_lens)] = torch.tensor(seq_lens)
    return SimpleNamespace(input_batch=SimpleNamespace(block_table=[block_table]),
                           seq_lens=lens.clone(), optimistic_seq_lens_cpu=lens.clone())


def test_shifted_rows_start_at_their_first_kept_block_and_lengths_drop():
    r = runner([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0], [30, 31, 32, 33, 0], [0] * 5],
               [70, 40, 50])
    view = AttentionView(r, BS)
    view.apply(np.array([2, 0, 1]), 3)
    assert r.seq_lens[:3].tolist() == [70 - 2 * BS, 40, 50 - BS]
    assert r.optimistic_seq_lens_cpu[:3].tolist() == [70 - 2 * BS, 40, 50 - BS]
    table = view.device_tensor(4)
    assert table[0, :3].tolist() == [12, 13, 14]
    assert table[1].tolist() == [20, 21, 22, 0, 0]
    assert table[2, :3].tolist() == [31, 32, 33]
    # vLLM's own table is logical (the slot mapping reads it): untouched
    assert r.input_batch.block_table[0].block_table.gpu[0].tolist() == [10, 11, 12, 13, 14]


def test_the_view_is_one_persistent_buffer_and_dummy_runs_see_it_unshifted():
    """CUDA graphs capture the address attention reads: every call returns the same storage; a call
    that is not the real step's metadata build (dummy / capture run) gets the logical rows."""
    r = runner([[10, 11, 12], [20, 21, 22]], [40, 40])
    view = AttentionView(r, BS)
    before = view.device_tensor(2)
    assert before.tolist() == [[10, 11, 12], [20, 21, 22]]
    view.apply(np.array([1, 0]), 2)
    shifted = view.device_tensor(2)
    assert shifted.data_ptr() == before.data_ptr()
    assert shifted[0, :2].tolist() == [11, 12]
    again = view.device_tensor(2)  # e.g. a dummy run after the step
    assert again.data_ptr() == before.data_ptr() and again[0].tolist() == [10, 11, 12]


def test_offsets_apply_once_per_step():
    """vLLM recomputes seq_lens in every _prepare_inputs: the view lowers them once per step."""
    r = runner([[1, 2, 3, 4]], [60])
    view = AttentionView(r, BS)
    for _ in range(3):
        r.seq_lens[0] = 60            # what _prepare_inputs writes each step
        r.optimistic_seq_lens_cpu[0] = 60
        view.apply(np.array([2]), 1)
        assert int(r.seq_lens[0]) == 60 - 2 * BS
        assert int(r.optimistic_seq_lens_cpu[0]) == 60 - 2 * BS


def test_no_shift_leaves_lengths_alone():
    r = runner([[1, 2]], [20])
    view = AttentionView(r, BS)
    view.apply(np.array([0]), 1)
    assert int(r.seq_lens[0]) == 20 and view.device_tensor(1).tolist() == [[1, 2]]


# -- runner guard and CLI ---------------------------------------------------------------------------

def _vllm_config(v2: bool, async_scheduling=False):
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"])
    return SimpleNamespace(
        use_v2_model_runner=v2, speculative_config=None, kv_transfer_config=None,
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        parallel_config=SimpleNamespace(world_size=1, data_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf, is_multimodal_model=False))


@pytest.fixture
def cuda_platform(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *a: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *a: True)


def test_the_guard_refuses_model_runner_v2_on_cuda(cuda_platform):
    from kvp_vllm.serving.plugin import check_supported

    check_supported(_vllm_config(v2=False))  # the V1 runner passes
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_supported(_vllm_config(v2=True))


def test_the_guard_refuses_async_scheduling():
    from kvp_vllm.serving.plugin import check_supported

    with pytest.raises(ValueError, match="drop --async-scheduling"):
        check_supported(_vllm_config(v2=False, async_scheduling=True))


def test_cli_selects_the_v1_runner_and_synchronous_scheduling():
    from kvp_vllm.serving.cli import CLIError, runner_settings

    env = {}
    argv = runner_settings(["serve", "m", "--kv-eviction", "kvp"], env)
    assert argv[-1] == "--no-async-scheduling" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert runner_settings(["serve", "m", "--no-async-scheduling"], {}) == ["serve", "m", "--no-async-scheduling"]
    with pytest.raises(CLIError, match="drop --async-scheduling"):
        runner_settings(["serve", "m", "--async-scheduling"], {})
    with pytest.raises(CLIError, match="VLLM_USE_V2_MODEL_RUNNER"):
        runner_settings(["serve", "m"], {"VLLM_USE_V2_MODEL_RUNNER": "1"})
