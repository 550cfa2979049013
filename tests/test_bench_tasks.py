"""Tests for the RULER-style accuracy tasks and their scoring (no model: stand-in token counters)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from s4r import books
from s4r.bench import scoring, tasks
from s4r.bench.scoring import perplexity_text, score, string_match_all, string_match_part
from s4r.bench.tasks import (
    NEEDLE_TASKS,
    TASKS,
    Sample,
    fit_to_tokens,
    load_book,
    make_sample,
    make_samples,
    needle_sample,
)
from s4r.bench.tracking_tasks import FWE_INTRO, variable_tracking
from s4r.errors import S4RError


def count_regex(text: str) -> int:
    """Stand-in tokenizer: words and single punctuation marks, roughly like a BPE on English."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def count_chars(text: str) -> int:
    """Stand-in tokenizer: four characters per token."""
    return (len(text) + 3) // 4


NEEDLE_RE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")


def needles(context: str) -> list[tuple[str, str]]:
    return NEEDLE_RE.findall(context)


# -- generation ------------------------------------------------------------------------------------


def test_task_list() -> None:
    assert TASKS == [
        "niah_single_noise",
        "niah_single_book",
        "niah_multikey",
        "niah_multivalue",
        "niah_multiquery",
        "variable_tracking",
        "frequent_words",
    ]
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("qa_squad", 1000, 0, count_regex)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic(task: str) -> None:
    a = make_sample(task, 2000, 11, count_regex, depth=0.4)
    b = make_sample(task, 2000, 11, count_regex, depth=0.4)
    c = make_sample(task, 2000, 12, count_regex, depth=0.4)
    assert a == b
    assert a.context != c.context and a.answers != c.answers
    assert isinstance(a, Sample) and a.task == task and a.metric in ("all", "part")
    assert a.question.endswith("?") or a.question.endswith(".")
    assert a.answers and all(isinstance(x, str) and x for x in a.answers)


@pytest.mark.parametrize("counter", [count_regex, count_chars])
@pytest.mark.parametrize("length", [2048, 4096, 8192])
@pytest.mark.parametrize("task", TASKS)
def test_hits_target_length(task: str, length: int, counter) -> None:
    sample = make_sample(task, length, 3, counter)
    n = counter(sample.context)
    assert 0.95 * length <= n <= length  # never over: callers budget the model's context on it


@pytest.mark.parametrize("task", [t for t in TASKS if t != "variable_tracking" and t != "frequent_words"])
def test_answers_in_context(task: str) -> None:
    sample = make_sample(task, 3000, 5, count_regex)
    found = needles(sample.context)
    for answer in sample.answers:
        assert answer in sample.context
        # Each answer sits in a well-formed needle of a key the question asks about.
        keys = [k for k, v in found if v == answer]
        assert len(keys) == 1 and keys[0] in sample.question and keys[0] in sample.answer_prefix


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.05, 0.25, 0.5, 0.75, 0.95])
def test_needle_depth(task: str, depth: float) -> None:
    for seed in range(3):
        sample = make_sample(task, 2048, seed, count_regex, depth=depth)
        assert sample.depth == depth
        pos = sample.context.find(sample.answers[0]) / len(sample.context)
        assert abs(pos - depth) < 0.05


def test_single_and_multikey_needles() -> None:
    single = make_sample("niah_single_book", 2000, 1, count_regex, depth=0.5)
    assert len(needles(single.context)) == 1 and len(single.answers) == 1
    noise = make_sample("niah_single_noise", 2000, 1, count_regex, depth=0.5)
    assert noise.context.count("The grass is green.") > 50
    multi = make_sample("niah_multikey", 2000, 1, count_regex, depth=0.5)
    found = needles(multi.context)
    assert len(found) == 4 and len(multi.answers) == 1
    keys = [k for k, _ in found]
    assert len(set(keys)) == 4
    # Distractor keys share no word with each other (nor with the queried key).
    words = [w for k in keys for w in k.split("-")]
    assert len(set(words)) == len(words)
    asked = [k for k in keys if k in multi.question]
    assert len(asked) == 1 and dict(found)[asked[0]] == multi.answers[0]


def test_multivalue_and_multiquery() -> None:
    mv = make_sample("niah_multivalue", 3000, 2, count_regex)
    found = needles(mv.context)
    assert mv.metric == "all" and mv.depth is None
    assert len(found) == 4 and len({k for k, _ in found}) == 1
    assert sorted(mv.answers) == sorted(v for _, v in found)
    mq = make_sample("niah_multiquery", 3000, 2, count_regex)
    found = needles(mq.context)
    assert mq.metric == "all" and len(found) == 4 and len(mq.answers) == 4
    for key, value in found:
        assert key in mq.question and value in mq.answers


def resolve_variables(context: str) -> dict[str, str]:
    """Follow every ``VAR X = ...`` chain of a context to the number each variable holds."""
    bound: dict[str, str] = {}
    for name, ref, number in re.findall(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))", context):
        bound[name] = number or bound[ref]  # chains appear in order, so the source is known
    return bound


@pytest.mark.parametrize("seed", range(5))
def test_variable_tracking_answers(seed: int) -> None:
    sample = make_sample("variable_tracking", 2048, seed, count_regex)
    value = re.search(r"value (\d+)", sample.question).group(1)
    bound = resolve_variables(sample.context)
    assert sorted(sample.answers) == sorted(k for k, v in bound.items() if v == value)
    assert len(sample.answers) == 5 and f"{len(sample.answers)} variables" in sample.answer_prefix


def test_variable_tracking_with_distractor_chains() -> None:
    rng = random.Random("vt-test")
    sample = variable_tracking(2048, rng, count_regex, num_chains=3, num_hops=2)
    value = re.search(r"value (\d+)", sample.question).group(1)
    bound = resolve_variables(sample.context)
    assert len(bound) == 9 and len(set(bound.values())) == 3
    assert sorted(sample.answers) == sorted(k for k, v in bound.items() if v == value)


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("seed", range(3))
def test_frequent_words_top3(seed: int, length: int) -> None:
    sample = make_sample("frequent_words", length, seed, count_regex)
    words = sample.context[len(FWE_INTRO) :].split()
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in words)
    ranked = Counter(words).most_common()
    assert [w for w, _ in ranked[:3]] == sample.answers
    assert ranked[2][1] > ranked[3][1]  # a clear top three, no tie with the fourth


def test_make_samples_depths() -> None:
    samples = make_samples("niah_single_noise", 1024, 5, 0, count_regex)
    assert [s.depth for s in samples] == pytest.approx([0.05, 0.275, 0.5, 0.725, 0.95])
    assert len({s.answers[0] for s in samples}) == 5
    assert make_samples("niah_single_noise", 1024, 5, 0, count_regex) == samples
    others = make_samples("frequent_words", 1024, 3, 0, count_regex)
    assert all(s.depth is None for s in others) and len({s.context for s in others}) == 3
    assert make_samples("frequent_words", 1024, 0, 0, count_regex) == []


@pytest.mark.parametrize("haystack", ["book", "noise", "romeo-and-juliet"])
def test_needle_sample(haystack: str) -> None:
    sample = needle_sample(2048, 0.3, 4, count_regex, haystack=haystack)
    assert sample.task == ("niah_single_noise" if haystack == "noise" else "niah_single_book")
    assert sample.depth == 0.3 and len(needles(sample.context)) == 1
    assert abs(sample.context.find(sample.answers[0]) / len(sample.context) - 0.3) < 0.05
    assert 0.95 * 2048 <= count_regex(sample.context) <= 2048
    if haystack == "romeo-and-juliet":
        assert "Romeo" in sample.context or "ROMEO" in sample.context
    assert needle_sample(2048, 0.3, 4, count_regex, haystack=haystack) == sample
    if haystack != "romeo-and-juliet":
        assert make_sample(sample.task, 2048, 4, count_regex, depth=0.3) == sample


def test_long_haystack_wraps_around_the_book() -> None:
    # Romeo and Juliet is ~50k tokens: a longer haystack must still be served, and fit.
    sample = needle_sample(60_000, 0.5, 0, count_chars, haystack="romeo-and-juliet")
    assert 0.95 * 60_000 <= count_chars(sample.context) <= 60_000


def test_book_is_clean() -> None:
    book = load_book()
    assert "*** START OF" not in book and "*** END OF" not in book
    assert "Project Gutenberg" not in book[-5000:]
    assert "[Illustration" not in book and "\n]" not in book and "Copyright 1894" not in book
    assert "It is a truth universally acknowledged" in book
    sentences, offsets, starts = tasks.book_sentences()
    assert "".join(sentences) == book and offsets[-1] == len(book)
    assert all(i == 0 or sentences[i - 1].endswith("\n\n") for i in starts)


def test_books_dir_from_env(tmp_path, monkeypatch) -> None:
    text = (
        "header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nHello\nthere.\n\n"
        "[Illustration: a [_Copyright_]\n\ncaption]\n\nBye.\n*** END OF X ***\nlicense"
    )
    (tmp_path / "tiny-test-book.txt").write_text("\ufeff" + text, encoding="utf-8")
    monkeypatch.setenv("S4R_BOOKS_DIR", str(tmp_path))
    assert books.books_dir() == tmp_path
    try:
        assert load_book("tiny-test-book") == "Hello there.\n\nBye."
    finally:
        load_book.cache_clear()
        tasks.book_sentences.cache_clear()
    with pytest.raises(S4RError):
        load_book("no-such-book")


def test_fit_to_tokens_bounds() -> None:
    def build(n: int) -> str:
        return "head " + "word " * n

    text, n = fit_to_tokens(build, 1000, count_regex, probe=10)
    assert n == count_regex(text) and 985 <= n <= 1000
    with pytest.raises(ValueError, match="fixed part"):
        fit_to_tokens(lambda n: "a b c d e " + "x " * n, 3, count_regex, probe=10)
    with pytest.raises(ValueError):
        make_sample("niah_single_book", 10, 0, count_regex)


# -- scoring ---------------------------------------------------------------------------------------


def test_string_match() -> None:
    refs = ["1234567", "Gentle-Harbor", "abc"]
    assert string_match_all("1234567, gentle-harbor and ABC", refs) == 100.0
    assert string_match_all("the number is 1234567", refs) == pytest.approx(100 / 3)
    assert string_match_all("GENTLE-HARBOR 1234567", refs) == pytest.approx(200 / 3)
    assert string_match_all("nothing here", refs) == 0.0
    assert string_match_all("123456", ["1234567"]) == 0.0  # a prefix is not a match
    assert string_match_part("it is abc", refs) == 100.0
    assert string_match_part("it is ABC", refs) == 100.0
    assert string_match_part("it is 765", refs) == 0.0
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_score_uses_sample_metric() -> None:
    base = dict(task="t", context="c", question="q", depth=None, answer_prefix="")
    all_ = Sample(answers=["a1", "b2"], metric="all", **base)
    part = Sample(answers=["a1", "b2"], metric="part", **base)
    assert score(all_, "A1 only") == 50.0 and score(part, "A1 only") == 100.0
    assert score(all_, "b2 a1") == 100.0 and score(part, "none") == 0.0
    with pytest.raises(ValueError):
        score(Sample(answers=["x"], metric="f1", **base), "x")


@pytest.mark.parametrize("task", TASKS)
def test_reference_answer_scores_full(task: str) -> None:
    sample = make_sample(task, 1024, 9, count_regex)
    pred = " " + ", ".join(sample.answers).upper() + "."
    assert score(sample, pred) == 100.0
    assert score(sample, "I don't know.") == 0.0
    # The question and prefix alone never give credit (e.g. a variable name that spells a word).
    assert score(sample, sample.question + " " + sample.answer_prefix) == 0.0


# -- perplexity text -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [512, 2048, 8192])
def test_perplexity_text(tokens: int) -> None:
    context, continuation = perplexity_text(tokens, count_regex)
    assert 0.95 * tokens <= count_regex(context) <= tokens
    assert 0.95 * 256 <= count_regex(continuation) <= 256
    assert (context + continuation) in load_book()  # consecutive text of the book
    assert not context[-1].isspace() and continuation[0].isspace()
    assert perplexity_text(tokens, count_regex) == (context, continuation)
    other, _ = perplexity_text(tokens, count_regex, offset_chars=200_000)
    assert other != context


def test_perplexity_text_too_long() -> None:
    with pytest.raises(ValueError, match="too little text"):
        perplexity_text(100_000, count_regex, offset_chars=len(load_book()) - 2000)
    with pytest.raises(ValueError, match="past the end"):
        perplexity_text(1000, count_regex, offset_chars=10**9)


# -- with the real tokenizer -----------------------------------------------------------------------


def _cached_smollm2_tokenizer():
    """The embedded SmolLM2 tokenizer if its converted folder is already cached, else None (never fetches)."""
    from tokenizers import Tokenizer

    from s4r.models.loading import models_dir

    path = models_dir() / "smollm2-135m" / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def test_real_tokenizer_lengths() -> None:
    tokenizer = _cached_smollm2_tokenizer()
    if tokenizer is None:
        pytest.skip("the converted SmolLM2 folder is not cached yet")

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    for task in TASKS:
        sample = make_sample(task, 4096, 0, count)
        assert 0.95 * 4096 <= count(sample.context) <= 4096
    context, continuation = scoring.perplexity_text(2048, count)
    assert 0.95 * 2048 <= count(context) <= 2048
