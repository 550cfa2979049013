"""Scoring for the accuracy tasks (RULER's string matching) and text for the perplexity gap."""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Callable, Sequence

from s4r.bench.haystack import DEFAULT_BOOK, book_sentences, fit_to_tokens
from s4r.bench.sample import Sample
from s4r.books import load_book

__all__ = ["string_match_all", "string_match_part", "score", "perplexity_text"]

# About 40k characters into the cleaned Pride and Prejudice: past the preface and the list of
# illustrations, in the second chapter of the novel itself, so the text is plain narrative.
DEFAULT_PERPLEXITY_OFFSET = 40_000


def _found(pred: str, refs: Sequence[str]) -> list[bool]:
    if not refs:
        raise ValueError("no reference answers to score against")
    low = pred.lower()
    return [ref.lower() in low for ref in refs]


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """RULER's string_match_all: percentage of the references found in ``pred``.

    A reference counts when it occurs anywhere in the prediction as a case-insensitive substring;
    the result is in [0, 100].
    """
    found = _found(pred, refs)
    return 100.0 * sum(found) / len(found)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """RULER's string_match_part: 100 if any reference occurs in ``pred`` (case-insensitive), else 0."""
    return 100.0 if any(_found(pred, refs)) else 0.0


def score(sample: Sample, pred: str) -> float:
    """Score a model's answer to ``sample`` with the sample's metric, in [0, 100]."""
    if sample.metric == "all":
        return string_match_all(pred, sample.answers)
    if sample.metric == "part":
        return string_match_part(pred, sample.answers)
    raise ValueError(f"unknown metric {sample.metric!r} (expected 'all' or 'part')")


@functools.lru_cache(maxsize=4)
def _word_ends(book: str) -> tuple[int, ...]:
    """Character offsets where the words of a cleaned book end (the places text may be cut)."""
    return tuple(m.end() for m in re.finditer(r"\S+", load_book(book)))


def perplexity_text(
    tokens_needed: int,
    count_tokens: Callable[[str], int],
    offset_chars: int = DEFAULT_PERPLEXITY_OFFSET,
    continuation_tokens: int = 256,
    book: str = DEFAULT_BOOK,
) -> tuple[str, str]:
    """Return ``(context, continuation)``: consecutive passages of a shared book.

    The context starts at the first paragraph at or after ``offset_chars`` (cleaned text, see
    :func:`s4r.bench.tasks.load_book`) and holds about ``tokens_needed`` tokens (at most that,
    within ~1.5%); the continuation is the text right after it, about ``continuation_tokens``
    tokens. Both are cut between words, and the whitespace between them starts the
    continuation, as a tokenizer would attach it to the following word. Perplexity of the
    continuation given a full versus a compressed cache of the context measures the damage done
    by compression. Raises ``ValueError`` when the book is too short from that offset.
    """
    text = load_book(book)
    ends = _word_ends(book)
    _, offsets, starts = book_sentences(book)
    k = bisect.bisect_left([offsets[s] for s in starts], offset_chars)
    if k == len(starts):
        raise ValueError(f"offset {offset_chars} is past the end of {book!r} ({len(text)} characters)")
    start = offsets[starts[k]]

    def passage(first: int) -> Callable[[int], str]:
        # Whole words from character `first` covering n characters, stopping at the end of the
        # book (never wrapping: a repeated passage would make the continuation easy to predict).
        def build(n: int) -> str:
            if n <= 0:
                return ""
            i = bisect.bisect_left(ends, first + n)
            return text[first : ends[i] if i < len(ends) else len(text)]

        return build

    context, n_context = fit_to_tokens(passage(start), tokens_needed, count_tokens, probe=4000)
    end = start + len(context)
    continuation, n_cont = fit_to_tokens(passage(end), continuation_tokens, count_tokens, probe=400)
    if n_context < 0.9 * tokens_needed or n_cont < 0.9 * continuation_tokens:
        raise ValueError(
            f"{book!r} has too little text after offset {offset_chars} for a {tokens_needed}-token "
            f"context and a {continuation_tokens}-token continuation; use a smaller offset or length"
        )
    return context, continuation
