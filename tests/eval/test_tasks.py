"""Task generators: deterministic per seed, expected answers really in the context, lengths hit target."""

import pytest

from kvp_vllm.eval.tasks import TASKS, TaskError, make_sample, parse_length, score_answers


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvp_vllm.assets import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path(verify=False))


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [1024, 2048])
def test_length_determinism_answers(tokenizer, task, length):
    s = make_sample(task, tokenizer, length, index=3, seed=7)
    again = make_sample(task, tokenizer, length, index=3, seed=7)
    assert s.prompt_ids == again.prompt_ids and s.answers == again.answers and s.gold_ids == again.gold_ids
    other = make_sample(task, tokenizer, length, index=4, seed=7)
    assert other.prompt_ids != s.prompt_ids
    other_seed = make_sample(task, tokenizer, length, index=3, seed=8)
    assert other_seed.prompt_ids != s.prompt_ids
    total = len(s.prompt_ids) + (s.max_new_tokens if s.kind == "qa" else len(s.gold_ids))
    # RULER counts prompt + answer: fits the target, and fills it (the last filler unit may not fit)
    assert length - 100 <= total <= length, total
    assert len(s.context_ids) > 0.8 * len(s.prompt_ids)
    if s.kind == "qa":
        context = tokenizer.decode(s.context_ids)
        assert s.answers
        for a in s.answers:
            assert a in context, (task, a)
        # the canonical gold answer scores as correct
        assert score_answers(tokenizer.decode(s.gold_ids), s.answers) == (True, 1.0)
    else:
        assert len(s.gold_ids) > 0


def test_8k_fits(tokenizer):
    s = make_sample("niah_single_essay", tokenizer, 8192, index=0)
    assert 8192 - 100 <= len(s.prompt_ids) + s.max_new_tokens <= 8192


def test_chat_template_and_split(tokenizer):
    s = make_sample("niah_single_repeat", tokenizer, 1024, index=0)
    text = tokenizer.decode(s.prompt_ids)
    assert text.startswith("<|im_start|>system")
    q = tokenizer.decode(s.question_ids)
    assert "What is the special magic number" in q and "<|im_start|>assistant" in q
    assert "What is the special magic number" not in tokenizer.decode(s.context_ids)


def test_multi_needle_answers(tokenizer):
    mv = make_sample("niah_multivalue", tokenizer, 1024, 0)
    assert len(mv.answers) == 4 and len(set(mv.answers)) == 4
    mq = make_sample("niah_multiquery", tokenizer, 1024, 0)
    assert len(mq.answers) == 2
    mk = make_sample("niah_multikey", tokenizer, 1024, 0)
    ctx = tokenizer.decode(mk.context_ids)
    assert ctx.count("One of the special magic numbers for") == 4
    vt = make_sample("vt", tokenizer, 1024, 0)
    assert len(vt.answers) == 5


def test_fwe_counts_are_strict(tokenizer):
    s = make_sample("fwe", tokenizer, 2048, 1)
    words = tokenizer.decode(s.context_ids).split("\n", 3)[-1].split()
    counts = {a: words.count(a) for a in s.answers}
    others = [words.count(w) for w in set(words) if w not in s.answers and w.isalpha() and len(w) == 5]
    assert min(counts.values()) > max(others)


def test_scoring():
    assert score_answers("The numbers are 123 and 456.", ["123", "456"]) == (True, 1.0)
    assert score_answers("The number is 123.", ["123", "456"]) == (False, 0.5)
    assert score_answers("ABCDE", ["abcde"]) == (True, 1.0)


def test_bad_task_and_length(tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", tokenizer, 1024, 0)
    with pytest.raises(TaskError):
        parse_length("two thousand")
    assert parse_length("2K") == 2048 and parse_length("4096") == 4096


def test_a_tokenizer_without_ids_fails_instead_of_looping():
    class Empty:  # what transformers builds from a model folder without tokenizer files
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": []}

    with pytest.raises(TaskError, match="no ids"):
        make_sample("niah_single_repeat", Empty(), 1024, 0)
