"""The real model on the GPU runner: SmolLM2-135M-Instruct with the shipped KVP policy, bf16, FULL
CUDA graphs. Pass-key prompts are answered with KVP at budget 128 about as often as with the full
cache, and the served tokens are greedy under a transformers replay of the kept tokens."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_helpers import BLOCK, DEVICE, ON_CPU, close_engine, make_engine  # noqa: E402

if not (torch.cuda.is_available() or ON_CPU):
    pytest.skip("the GPU suite needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)
BUDGET = 128
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def pass_key_prompts(n=4, seed=0):
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        text = (FILLER * rng.randint(12, 20) + f"The pass key is {key}. Remember it. {key} is the pass "
                f"key. " + FILLER * rng.randint(16, 24) + "What is the pass key? The pass key is")
        items.append((text, key))
    return items


@pytest.fixture(scope="module")
def smol(smollm2_folder):
    from kvp_vllm.serving.config import shipped_checkpoint

    llm = make_engine(str(smollm2_folder), "kvp", BUDGET, 64,
                      checkpoint=str(shipped_checkpoint("SmolLM2-135M-Instruct")), dtype="bfloat16",
                      block_size=BLOCK, max_model_len=4096, num_gpu_blocks_override=8192 // BLOCK,
                      max_num_seqs=8, enable_prefix_caching=False,
                      compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                          "cudagraph_capture_sizes": [1, 2, 4, 8]})
    yield llm
    close_engine(llm)


def test_smollm2_kvp_answers_pass_keys_and_replays(smol, smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvp_vllm.serving.replay import hf_replay, record_compactions

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    items = [(tok(text).input_ids, key) for text, key in pass_key_prompts()]

    def answers(budget):
        params = SamplingParams(max_tokens=8, temperature=0, detokenize=False,
                                extra_args={"kv_budget": budget})
        outs = smol.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in items], params,
                             use_tqdm=False)
        return [tok.decode(o.outputs[0].token_ids) for o in outs]

    full = sum(key in a for a, (_, key) in zip(answers("none"), items))
    with record_compactions(smol) as history:
        kvp = sum(key in a for a, (_, key) in zip(answers(BUDGET), items))
    assert full >= 3, f"the full cache answers {full}/4: the task measures nothing"
    assert kvp >= full - 1, f"KVP at budget {BUDGET}: {kvp}/4, full cache {full}/4"
    assert len(history) == len(items), "every request was compacted"

    ids = items[0][0]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, detokenize=False,
                            extra_args={"kv_budget": BUDGET})
    with record_compactions(smol) as history:
        got = list(smol.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                 use_tqdm=False)[0].outputs[0].token_ids)
    (record,) = history.values()
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.bfloat16).to(DEVICE).eval()
    _, lp, best = hf_replay(model, ids, len(got), record, forced=got)
    gaps = [b - x for x, b in zip(lp, best)]
    assert sum(gaps) / len(gaps) < 0.05, gaps
