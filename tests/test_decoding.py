"""Decoding defaults and short documents in the library: repetition penalty, loop guard, why an answer
stopped, and a cache kept uncompressed when the ratio cannot pay for itself (tiny random models)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from s4r.core.budget import KVShape
from s4r.errors import BudgetError
from s4r.hf.generation import apply_repetition_penalty, loops, repeating_period
from s4r.methods import make_method
from s4r.runtime.ratio_limits import max_ratio, method_max_ratio
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

FOX = "The quick brown fox jumps over the lazy dog. "
# SmolLM2-135M: 30 layers, 3 KV heads of 64, 9 query heads, bf16
SMOLLM2 = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype_bytes=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded() -> SimpleNamespace:
    return SimpleNamespace(model=tiny_model("llama"), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=4096)


# -- repetition penalty -------------------------------------------------------------------------------------

def test_penalty_lowers_seen_tokens_whatever_their_sign() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, others alone
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is not modified
    assert apply_repetition_penalty(logits, [0, 1], 1.0) is logits  # 1 = off


def test_penalty_changes_a_greedy_answer_and_is_off_by_default(loaded: SimpleNamespace) -> None:
    session = Session(loaded, method="full")
    session.ingest(FOX * 20)
    plain, _ = session.ask("hello?", max_new_tokens=60)
    session.clear()
    again, _ = session.ask("hello?", max_new_tokens=60, repeat_penalty=1.0)
    session.clear()
    penalized, _ = session.ask("hello?", max_new_tokens=60, repeat_penalty=1.3)
    assert plain == again  # the library's default is plain decoding (what the bench measures)
    assert penalized != plain


# -- loop guard ----------------------------------------------------------------------------------------------

def test_repeating_period_finds_back_to_back_blocks() -> None:
    sentence = list(range(30))
    assert repeating_period([7, 8] + sentence * 2) == 30
    assert repeating_period(list(range(100))) == 0
    assert repeating_period([5] * 47) == 0  # too short a run to call it a loop
    assert repeating_period([5] * 48) == 1
    assert repeating_period([1, 2, 3] * 16) == 3
    assert repeating_period(sentence + [99] + sentence) == 0  # not back to back


def test_loops_catches_near_repeats_and_leaves_prose_alone() -> None:
    prose = list(range(200))
    assert not loops(prose)
    line = list(range(1000, 1020))  # a 20-token sentence
    # said again with one word changed in between: not back to back, but its last 16 tokens recur
    assert loops(line + [1] + line[:3] + [5] + line[4:])
    assert not loops(line + [1] + line[:15])  # 15 tokens said again: not yet
    phrase = list(range(2000, 2008))  # an 8-token phrase in three different sentences
    assert not loops([1] + phrase + [2, 3] + phrase)
    assert loops([1] + phrase + [2, 3] + phrase + [4, 5, 6] + phrase)


def test_loop_guard_stops_a_looping_answer(loaded: SimpleNamespace) -> None:
    session = Session(loaded, method="full")
    session.ingest(FOX * 3)
    looping, free = session.ask("hello?", max_new_tokens=300)
    assert free.stop_reason == "max_new_tokens"
    session.clear()
    guarded, stats = session.ask("hello?", max_new_tokens=300, loop_guard=True)
    assert stats.stop_reason == "loop"
    assert stats.generated_tokens < free.generated_tokens
    assert looping.startswith(guarded)  # the same answer, stopped once it repeats itself


# -- stop reasons --------------------------------------------------------------------------------------------

def test_stop_reason_tells_the_token_limit_from_the_context_limit(loaded: SimpleNamespace) -> None:
    session = Session(loaded, method="full")
    session.ingest(FOX * 3)
    _, stats = session.ask("hi", max_new_tokens=5)
    assert stats.stop_reason == "max_new_tokens" and stats.generated_tokens == 5
    small = SimpleNamespace(**{**vars(loaded), "context_length": 700})
    session = Session(small, method="full")
    session.ingest(FOX * 3)  # ~140 tokens + headroom: less room than the 600 tokens asked for
    _, stats = session.ask("hi", max_new_tokens=600)
    assert stats.stop_reason == "context"
    assert session.logical_length >= 699


# -- short documents -----------------------------------------------------------------------------------------

def test_short_document_is_kept_uncompressed_not_refused(loaded: SimpleNamespace) -> None:
    session = Session(loaded, method="s4r", ratio=5)
    session.ingest(FOX * 3)
    assert session.method == "full"
    assert "too few for s4r to reach ratio 5" in session.uncompressed_reason
    assert session.memory().ratio == pytest.approx(1.0)
    answer, stats = session.ask("hi", max_new_tokens=4)
    assert stats.generated_tokens == 4


def test_long_document_is_compressed(loaded: SimpleNamespace) -> None:
    session = Session(loaded, method="s4r", ratio=2)
    session.ingest(FOX * 70)
    assert session.method == "s4r" and session.uncompressed_reason is None
    assert session.memory().ratio >= 2
    assert session.cache.rebuilt_share() is None  # no step yet
    session.ask("hi", max_new_tokens=3)
    share = session.cache.rebuilt_share()
    assert share is not None and 0.0 < share <= 1.0
    full = Session(loaded, method="full")
    full.ingest(FOX * 70)
    full.ask("hi", max_new_tokens=1)
    assert full.cache.rebuilt_share() is None  # nothing is rebuilt from an exact cache


def test_benchmark_forks_still_refuse_an_unreachable_ratio(loaded: SimpleNamespace) -> None:
    """The bench must not measure `full` under another name: a fork raises instead of falling back."""
    base = Session(loaded, method="full")
    base.ingest(FOX * 3, compress=False)
    with pytest.raises(BudgetError):
        base.fork(method="s4r", ratio=5)


# -- ratios that can never be reached ------------------------------------------------------------------------

def test_max_ratio_of_each_kind_of_method() -> None:
    s4r = method_max_ratio(make_method("s4r", 5), SMOLLM2, 8192)
    # per token at least the 1-column int8 band and its scale (K and V) plus 1% exact outliers: ~20 of 768 B
    assert 30 < s4r < 45
    paper = method_max_ratio(make_method("s4r-paper", 5), SMOLLM2, 8192)
    assert paper > 50
    assert method_max_ratio(make_method("streaming", 5), SMOLLM2, 8192) == pytest.approx(8192 / 65)
    assert math.isinf(method_max_ratio(make_method("full", 5), SMOLLM2, 8192))


def test_max_ratio_is_a_real_bound(loaded: SimpleNamespace) -> None:
    """Tight from both sides: 5% under the bound the longest document compresses and keeps the ratio,
    5% over it even the longest document cannot."""
    best = max_ratio(loaded, "s4r")
    below = Session(loaded, method="s4r", ratio=best * 0.95, truncate="head")
    below.ingest(FOX * 100)  # fills the 4096-token context but for the answer headroom
    assert below.method == "s4r" and below.cache.is_compressed()
    assert below.memory().ratio >= best * 0.95
    above = Session(loaded, method="s4r", ratio=best * 1.05, truncate="head")
    above.ingest(FOX * 100)
    assert above.method == "full"  # not reachable even with the longest document


def test_truncation_is_counted(loaded: SimpleNamespace) -> None:
    small = SimpleNamespace(**{**vars(loaded), "context_length": 1024})
    session = Session(small, method="full", truncate="middle")
    stats = session.ingest(FOX * 40)  # 1,800 characters = tokens
    assert stats.dropped_tokens == 40 * len(FOX) - session.document_tokens > 0
    fits = Session(small, method="full", truncate="head").ingest(FOX * 2)
    assert fits.dropped_tokens == 0
