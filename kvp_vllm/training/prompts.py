"""Prompts for trace collection (`kvp-train collect`).

Training traces come from the evaluation harness's own RULER-style generators (`kvp_vllm.eval.tasks`:
needles in three haystacks, multi-key/value/query, variable tracking, common/frequent words, essay
continuation), plus two open-ended kinds the harness cannot score by exact match: questions about essay
text and long multi-turn conversations. Every prompt is a pure function of (task, target length, seed);
training uses seeds from `TRAIN_SEED_BASE` upwards, evaluation's samples use seeds below it, so a trace
prompt never equals an evaluation prompt.
"""

from __future__ import annotations

import random
from typing import List, Tuple

from ..eval import tasks as harness

TRAIN_SEED_BASE = harness.EVAL_SEED_LIMIT  # trace i uses seed + i >= this; evaluation stays below

CHARS_PER_TOKEN = 4.2  # rough size of a chat prompt before tokenising (trimmed to the target after)


def _essay_text(rng: random.Random, n_chars: int) -> str:
    """A contiguous run of essay sentences from a seeded start, about n_chars long."""
    sents = harness.essay_sentences()
    i, out, total = rng.randrange(len(sents)), [], 0
    while total < n_chars:
        out.append(sents[i % len(sents)])
        total += len(out[-1]) + 1
        i += 1
    return " ".join(out)


def essay_qa(rng: random.Random, n_chars: int) -> List[dict]:
    q = rng.choice(["Summarize the text above in three sentences.",
                    "What is the main argument of the text above?",
                    "List the key ideas of the text above.",
                    "What advice does the author give in the text above?"])
    return [{"role": "user", "content": f"{_essay_text(rng, n_chars)}\n\n{q}"}]


def conversation(rng: random.Random, n_chars: int) -> List[dict]:
    """A long chat about essay passages, ending in a question about the whole conversation."""
    name = rng.choice(harness.word_list("noun")).capitalize()
    msgs = [{"role": "user", "content": f"Hi, my name is {name}. I want to talk about some essays."},
            {"role": "assistant", "content": f"Nice to meet you, {name}. Which essay?"}]
    total = 0
    while total < n_chars:
        passage, reply = _essay_text(rng, 400), _essay_text(rng, 250)
        msgs.append({"role": "user", "content": f"What do you think about this: {passage}"})
        msgs.append({"role": "assistant", "content": reply})
        total += len(passage) + len(reply) + 60
    msgs.append({"role": "user", "content": rng.choice(["What is my name?", "Summarize our conversation.",
                                                        "Which of the ideas above do you like most?"])})
    return msgs


CHAT_TASKS = {"essay_qa": essay_qa, "conversation": conversation}
TASKS = tuple(harness.TASKS) + tuple(CHAT_TASKS)
DEFAULT_MIX = ("niah_single_repeat", "essay_qa", "niah_multikey", "conversation", "vt", "cwe",
               "niah_single_essay", "niah_multivalue", "ppl_essay", "niah_multiquery", "niah_single_words",
               "fwe")


def check_tasks(names) -> None:
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown prompt task {unknown[0]!r}; known: {', '.join(TASKS)}")


class ByteTokenizer:
    """Stand-in tokenizer for test models saved without one: UTF-8 bytes folded into the vocabulary.
    Callable like a Hugging Face tokenizer (no chat template), so the harness generators accept it."""

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [b % (self.vocab_size - 2) + 2 for b in text.encode()]}

    def encode_messages(self, messages: List[dict]) -> List[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return [1] + self(text)["input_ids"]

    def decode(self, ids) -> str:
        return bytes((i - 2) % 256 for i in ids if i >= 2).decode(errors="replace")


def _encode_chat(tokenizer, messages: List[dict], target_tokens: int) -> List[int]:
    """Token ids of the chat prompt, trimmed (from the middle of the context) to at most target_tokens."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = tokenizer.encode_messages(messages)
    else:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        ids = list(ids)
    if len(ids) > target_tokens:  # keep the head (system/template) and the tail (the question)
        head, tail = target_tokens // 8, target_tokens - target_tokens // 8
        ids = ids[:head] + ids[-tail:]
    return ids


def prompt_ids(tokenizer, task: str, target_tokens: int, seed: int) -> List[int]:
    """The prompt of one trace. Harness tasks: the harness's sample at `seed` (its prompt leaves room
    for the task's answer within target_tokens); chat tasks: trimmed to target_tokens."""
    check_tasks([task])
    if task in CHAT_TASKS:
        rng = random.Random(f"{task}:{target_tokens}:{seed}")
        messages = CHAT_TASKS[task](rng, int(target_tokens * CHARS_PER_TOKEN))
        return _encode_chat(tokenizer, messages, target_tokens)
    return harness.make_sample(task, tokenizer, target_tokens, index=0, seed=seed).prompt_ids


def _harness_sample(tokenizer, task: str, target_tokens: int, seed: int, what: str):
    """The harness's sample behind `prompt_ids` of a harness task; chat tasks have no `what`."""
    check_tasks([task])
    if task in CHAT_TASKS:
        raise ValueError(f"{task} has no {what}")
    return harness.make_sample(task, tokenizer, target_tokens, index=0, seed=seed)


def context_and_question_ids(tokenizer, task: str, target_tokens: int, seed: int) -> Tuple[List[int], List[int]]:
    """`prompt_ids` of a harness task split where the query-agnostic protocol compresses: (context,
    question). Chat tasks have no such split."""
    sample = _harness_sample(tokenizer, task, target_tokens, seed, "context/question split")
    return list(sample.context_ids), list(sample.question_ids)


def reference_ids(tokenizer, task: str, target_tokens: int, seed: int) -> List[int]:
    """The reference continuation of a harness task's prompt (`prompt_ids` with the same arguments):
    the held-out text of a perplexity task, the canonical answer of a QA task. Chat tasks have none."""
    return list(_harness_sample(tokenizer, task, target_tokens, seed, "reference continuation").gold_ids)
