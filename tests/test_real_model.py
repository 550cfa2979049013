"""S4R on the embedded SmolLM2-135M: a needle in a real book survives compression."""

from __future__ import annotations

import pytest

from s4r.bench.scoring import score
from s4r.bench.tasks import make_samples
from s4r.errors import CacheFileError
from s4r.runtime.session import Session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def needle(smollm2):
    tok = smollm2.tokenizer
    # the 5th of the 10 needles (depth 0.45) BENCHMARKS.md reports; the full cache answers it
    samples = make_samples("niah_single_book", 4000, 10, 0,
                           lambda s: len(tok.encode(s, add_special_tokens=False)))
    return samples[4]


@pytest.fixture(scope="module")
def staged(smollm2, needle):
    session = Session(smollm2, method="full")
    session.ingest(needle.context, compress=False)
    return session


def test_needle_answered_at_ratio_2_5(staged, needle):
    session = staged.fork(method="s4r", ratio=2.5)
    answer, stats = session.ask(needle.question, max_new_tokens=16, prime=needle.answer_prefix)
    assert score(needle, answer) == 100, answer
    assert stats.memory.ratio >= 2.5
    assert 3800 < staged.document_tokens < 4100


def test_full_cache_answers_too(staged, needle):
    answer, stats = staged.fork(method="full", ratio=1.0).ask(
        needle.question, max_new_tokens=16, prime=needle.answer_prefix)
    assert score(needle, answer) == 100, answer
    assert stats.memory.ratio == 1.0


def test_save_load_clear_round_trip(smollm2, staged, needle, tmp_path):
    """The answer after a load is the answer the session gave before (and the needle, so a load that lost
    the document would fail); clear gives it again."""
    session = staged.fork(method="s4r", ratio=2.5)
    path = tmp_path / "book.s4r"
    session.save(path)
    at_save = session.memory()
    first, _ = session.ask(needle.question, max_new_tokens=12, prime=needle.answer_prefix)
    session.clear()
    again, _ = session.ask(needle.question, max_new_tokens=12, prime=needle.answer_prefix)
    loaded = Session.load(path, smollm2, method="s4r", ratio=2.5)
    assert loaded.document_tokens == session.document_tokens
    assert loaded.memory() == at_save
    third, _ = loaded.ask(needle.question, max_new_tokens=12, prime=needle.answer_prefix)
    assert first == again == third
    assert score(needle, third) == 100, third
    with pytest.raises(CacheFileError, match="ratio"):
        Session.load(path, smollm2, method="s4r", ratio=5)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CacheFileError):
        Session.load(path, smollm2, method="s4r", ratio=2.5)


def test_an_eviction_chat_saves_and_loads_to_the_same_answer(smollm2, staged, needle, tmp_path):
    session = staged.fork(method="snapkv", ratio=2.5)
    path = tmp_path / "snapkv.s4r"
    session.save(path)
    before, _ = session.ask(needle.question, max_new_tokens=12, prime=needle.answer_prefix)
    after, _ = Session.load(path, smollm2).ask(needle.question, max_new_tokens=12, prime=needle.answer_prefix)
    assert after == before


def test_second_turn_and_ratio_after_long_answer(staged, needle):
    session = staged.fork(method="s4r", ratio=5)
    before = session.memory()
    session.ask("Summarize the text in one paragraph.", max_new_tokens=200)
    session.ask("And who is the main character?", max_new_tokens=60)
    after = session.memory()
    assert after.tokens > before.tokens + 60
    assert after.ratio >= 5
