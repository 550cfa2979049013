"""Haystacks for the accuracy tasks: book sentences or RULER's noise, facts inserted at chosen depths, and
texts grown to a token length with as few tokenizer calls as possible."""

from __future__ import annotations

import bisect
import functools
import random
import re
from collections.abc import Callable, Sequence

from s4r.books import DEFAULT_BOOK, load_book

__all__ = ["DEFAULT_BOOK", "HELDOUT_BOOK", "NOISE", "TUNING_BOOK", "Haystack", "book_sentences",
           "fit_to_tokens", "insert_facts", "noise_units"]

# defaults are tuned on one book and reported on another that tuning never used
TUNING_BOOK = DEFAULT_BOOK
HELDOUT_BOOK = "romeo-and-juliet"

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


# A sentence: text up to a terminator (plus closing quotes/brackets), then its trailing whitespace.
_SENTENCE_RE = re.compile(r"[^.!?]*[.!?]+[\"'’”)\]_]*\s*|[^.!?]+$")


@functools.lru_cache(maxsize=4)
def book_sentences(name: str = DEFAULT_BOOK) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Split a book into sentences that concatenate back to it exactly.

    Returns the sentences, their cumulative character offsets (len + 1 entries) and the indices
    of sentences that open a paragraph (the places a haystack may start).
    """
    pieces: list[str] = []
    for para in load_book(name).split("\n\n"):
        # Sentences are found per paragraph so a heading without a full stop never swallows the
        # next paragraph; the paragraph break rides on its last sentence.
        found = [m.group(0) for m in _SENTENCE_RE.finditer(para) if m.group(0)]
        found[-1] = found[-1].rstrip() + "\n\n"
        pieces.extend(found)
    pieces[-1] = pieces[-1].rstrip()
    sentences = tuple(pieces)
    offsets = [0]
    for s in sentences:
        offsets.append(offsets[-1] + len(s))
    starts = tuple(i for i in range(len(sentences)) if i == 0 or sentences[i - 1].endswith("\n\n"))
    return sentences, tuple(offsets), starts


def _book_units(name: str, start: int, n_chars: int) -> list[str]:
    """Sentences of a book from sentence ``start`` covering ``n_chars`` characters.

    The last sentence is cut after the first word that reaches ``n_chars``: like RULER's
    token-level truncation, this lets the length fit closely even when one sentence is 5% of a
    short context. Wraps around to the beginning of the book (after a paragraph break) when it
    runs out, so any length can be served.
    """
    sentences, offsets, _ = book_sentences(name)
    out: list[str] = []
    need = n_chars
    i = start
    while need > 0:
        # First sentence index j with offsets[j] - offsets[i] >= need, i.e. enough characters.
        j = bisect.bisect_left(offsets, offsets[i] + need, lo=i + 1)
        if j <= len(sentences):
            out.extend(sentences[i:j])
            break
        out.extend(sentences[i:])
        need -= offsets[-1] - offsets[i]
        if out and not out[-1].endswith("\n\n"):
            out[-1] = out[-1].rstrip() + "\n\n"
        i = 0
    excess = sum(map(len, out)) - n_chars
    if excess > 0:
        cut = out[-1].find(" ", len(out[-1]) - excess)
        if cut != -1:
            out[-1] = out[-1][:cut]
    return out


def fit_to_tokens(
    build: Callable[[int], str],
    target: int,
    count_tokens: Callable[[str], int],
    probe: int,
    tolerance: float = 0.015,
    max_calls: int = 8,
) -> tuple[str, int]:
    """Return the longest ``build(n)`` found with at most ``target`` tokens, and its token count.

    ``build`` must grow monotonically with ``n`` (sentences, characters, words...), and ``probe``
    is a small ``n`` used to measure tokens per unit. Tokenising a long text is the expensive
    step, so the size is predicted from a linear model ``tokens = fixed + n * per_unit`` fitted on
    ``build(0)`` and the probe, then corrected by interpolation inside a shrinking bracket; it
    usually takes one or two full-length counts. The result never exceeds ``target`` (so a
    caller's context budget holds) and stops as soon as it is within ``tolerance`` below it.
    Raises ``ValueError`` when even ``build(0)`` exceeds the target.
    """
    measured: dict[int, tuple[str, int]] = {}
    counts: dict[str, int] = {}  # by text: neighbouring n often build the same text (one long sentence)

    def measure(n: int) -> int:
        text = build(n)
        if text not in counts:
            counts[text] = count_tokens(text)
        measured[n] = (text, counts[text])
        return counts[text]

    if measure(0) > target:
        fixed = measured[0][1]
        raise ValueError(f"target of {target} tokens is below the task's fixed part ({fixed} tokens)")
    lo, hi = 0, None  # largest n known to fit, smallest n known not to
    last = [0]
    aim = target * (1 - tolerance / 2)
    n = max(1, probe)
    # Bounded by tokenizer calls (the cost) and, as a backstop, by iterations.
    for _ in range(64):
        if len(counts) > max_calls + 2:
            break
        t = measure(n)
        if hi is None and measured[n][0] == measured[last[-1]][0]:
            break  # the text stopped growing (end of a book): nothing longer exists
        last.append(n)
        if t <= target:
            lo = max(lo, n)
            if t >= target * (1 - tolerance):
                break
        else:
            hi = n if hi is None else min(hi, n)
        # Interpolate between the bracket ends when both are known, else extrapolate from the
        # two latest points: counts are close to linear in n, so this lands in one or two steps.
        a, b = (lo, hi) if hi is not None else (last[-2], last[-1])
        ta, tb = measured[a][1], measured[b][1]
        slope = (tb - ta) / (b - a) if tb != ta and a != b else max(tb, 1) / max(b, 1)
        n = round(b + (aim - tb) / slope)
        if hi is not None and not lo < n < hi:
            n = (lo + hi) // 2
        n = max(n, lo + 1)
        if n in measured or (hi is not None and n >= hi):
            break
    return measured[lo]


def insert_facts(units: Sequence[str], facts: Sequence[tuple[float, str]]) -> str:
    """Join haystack ``units`` with each fact placed at the unit boundary nearest its depth.

    Depth is measured in characters of the haystack, so 0.5 means half the text comes before
    the fact. Facts landing on the same boundary keep their given order.
    """
    offsets = [0]
    for u in units:
        offsets.append(offsets[-1] + len(u))
    total = offsets[-1]
    at: dict[int, list[str]] = {}
    for depth, fact in facts:
        pos = depth * total
        k = bisect.bisect_left(offsets, pos)
        if k > 0 and (k == len(offsets) or pos - offsets[k - 1] <= offsets[k] - pos):
            k -= 1
        at.setdefault(k, []).append(fact)
    parts: list[str] = []
    for k in range(len(units) + 1):
        for fact in at.get(k, ()):
            if parts and not parts[-1][-1:].isspace():
                parts.append(" ")
            parts.append(fact + " ")
        if k < len(units):
            parts.append(units[k])
    return "".join(parts).rstrip()


_NOISE_SENTENCES = tuple(s.strip() + " " for s in re.findall(r"[^.]+\.", NOISE))


def noise_units(n: int) -> list[str]:
    """The first ``n`` sentences of RULER's repeated noise haystack."""
    return [_NOISE_SENTENCES[i % len(_NOISE_SENTENCES)] for i in range(n)]


class Haystack:
    """A growable haystack: noise sentences or a book from a seeded starting paragraph."""

    def __init__(self, kind: str, rng: random.Random, target_tokens: int):
        self.kind = kind
        if kind == "noise":
            self.probe = 40  # sentences
            self.start = 0
            return
        self.book = DEFAULT_BOOK if kind == "book" else kind
        sentences, offsets, starts = book_sentences(self.book)
        self.probe = 4000  # characters
        # Start at a random paragraph past the front matter (title pages, contents: the first
        # tenth), early enough that the haystack rarely wraps around (English prose runs about 4
        # characters per token; 5 leaves margin).
        first, room = offsets[-1] // 10, offsets[-1] - int(target_tokens * 5)
        eligible = [s for s in starts if first <= offsets[s] <= room] or [0]
        self.start = rng.choice(eligible)

    def units(self, n: int) -> list[str]:
        """Haystack pieces for size ``n`` (sentences for noise, characters for a book)."""
        if self.kind == "noise":
            return noise_units(n)
        return _book_units(self.book, self.start, n) if n > 0 else []
