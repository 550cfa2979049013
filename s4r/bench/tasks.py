"""RULER-style synthetic accuracy tasks, generated locally and deterministically.

Each task builds a long document (the *context*) of a requested token length with facts hidden in
it, a question asked after the document, and the reference answers. The definitions follow RULER
(Hsieh et al., 2024): needle-in-a-haystack variants, variable tracking and frequent-word
extraction, with sizes scaled to small models (word keys instead of UUIDs, four needles at most,
explicit questions).

Everything is drawn from a ``random.Random`` seeded with a string built from the task name and the
seed (string seeds go through SHA-512, so they are stable across runs, machines and Python hash
randomisation), hence the same ``(task, context_tokens, seed)`` always gives byte-identical
samples for a given ``count_tokens``.

``context_tokens`` is the length of :attr:`Sample.context` alone (instructions + haystack + facts);
the question and the answer prefix come on top (a few dozen tokens), so callers must leave room
for them and for the generated answer under the model's context length.
"""

from __future__ import annotations

import bisect
import functools
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from s4r.books import BOOKS_ENV, SHIPPED_DIR, book_text
from s4r.books import strip_gutenberg as strip_gutenberg  # re-exported: moved to s4r.books
from s4r.errors import S4RError as S4RError  # re-exported: what load_book raises

__all__ = [
    "TASKS",
    "TASK_SETS",
    "NEEDLE_TASKS",
    "answer_budget",
    "Sample",
    "books_dir",
    "load_book",
    "make_sample",
    "make_samples",
    "needle_sample",
    "fit_to_tokens",
    "book_sentences",
]

TASKS: list[str] = [
    "niah_single_noise",
    "niah_single_book",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "frequent_words",
]

# Tasks whose single queried needle sits at a chosen depth; make_samples spreads their depths.
NEEDLE_TASKS: tuple[str, ...] = ("niah_single_noise", "niah_single_book", "niah_multikey")

DEFAULT_BOOK = "pride-and-prejudice"
# defaults are tuned on one book and reported on another that tuning never used
TUNING_BOOK = DEFAULT_BOOK
HELDOUT_BOOK = "romeo-and-juliet"
# named task selections (`s4r bench --tasks needles`); `needles` are the runs that chose the defaults
TASK_SETS: dict[str, tuple[str, ...]] = {
    "needles": ("niah_single_book", "niah_multikey", "niah_multivalue"),
}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards.\n\n"
)
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words.\n\n"
)

# Keys are adjective-noun pairs: a 135M model copies real words far more reliably than UUIDs.
_ADJECTIVES_TEXT = """
gentle silent amber brave calm clever crimson distant eager fancy golden hidden humble icy
jolly lively lucky mellow misty noble olive polite proud quiet rapid rusty shiny silver sleepy
smooth sunny swift tidy velvet vivid wandering warm wild windy wooden yellow zesty ancient bold
cosy dusty frozen hollow marble scarlet
"""
_ADJECTIVES = tuple(_ADJECTIVES_TEXT.split())
_NOUNS_TEXT = """
harbor meadow lantern river castle falcon garden island kettle ladder mirror needle orchard
pebble quarry rabbit saddle tunnel valley walnut anchor basket candle dragon engine feather
glacier hammer jacket kitten lemon magnet nutmeg oyster parrot pillow rocket salmon teapot
violin wagon window bridge canyon forest helmet marker otter pepper thimble
"""
_NOUNS = tuple(_NOUNS_TEXT.split())

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass
class Sample:
    """One generated benchmark item.

    ``context`` is the long document (to prefill, and compress), ``question`` is asked after it,
    and ``answer_prefix`` (possibly empty) primes the model's answer. ``metric`` names the RULER
    scoring: ``"all"`` (string_match_all) or ``"part"`` (string_match_part). ``depth`` is where the
    queried needle sits in the document (0 = start, 1 = end) for needle tasks, else ``None``.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    metric: str
    depth: float | None
    answer_prefix: str


# --------------------------------------------------------------------------------------------
# Books
# --------------------------------------------------------------------------------------------


def books_dir() -> Path:
    """Return the folder books are read from first: ``$S4R_BOOKS_DIR`` when set, else the books shipped
    inside the package (``s4r/data``). See :mod:`s4r.books`; nothing outside the repository is needed."""
    env = os.environ.get(BOOKS_ENV)
    return Path(env).expanduser() if env else SHIPPED_DIR


@functools.lru_cache(maxsize=4)
def load_book(name: str = DEFAULT_BOOK) -> str:
    """Load a book (shipped, or from ``$S4R_BOOKS_DIR``) as clean prose: Gutenberg header/footer
    removed, paragraphs unwrapped, illustration captions dropped (see :func:`s4r.books.book_text`).
    ``name`` is the file stem, e.g. ``"romeo-and-juliet"``."""
    return book_text(name)


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


# --------------------------------------------------------------------------------------------
# Length fitting
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Haystacks with inserted facts
# --------------------------------------------------------------------------------------------


def _insert(units: Sequence[str], facts: Sequence[tuple[float, str]]) -> str:
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


def _noise_units(n: int) -> list[str]:
    """The first ``n`` sentences of RULER's repeated noise haystack."""
    return [_NOISE_SENTENCES[i % len(_NOISE_SENTENCES)] for i in range(n)]


class _Haystack:
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
            return _noise_units(n)
        return _book_units(self.book, self.start, n) if n > 0 else []


# --------------------------------------------------------------------------------------------
# Random material
# --------------------------------------------------------------------------------------------


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` adjective-noun keys sharing no word, so no key is a near-copy of another."""
    adjectives = rng.sample(_ADJECTIVES, n)
    nouns = rng.sample(_NOUNS, n)
    return [f"{a}-{b}" for a, b in zip(adjectives, nouns, strict=True)]


def _numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    """``n`` distinct numbers of exactly ``digits`` digits (same length, so none contains another)."""
    values = rng.sample(range(10 ** (digits - 1), 10**digits), n)
    return [str(v) for v in values]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _spread_depths(rng: random.Random, n: int, lo: float = 0.05, hi: float = 0.95) -> list[float]:
    """``n`` depths, one in each of ``n`` equal slices of [lo, hi], jittered within the slice."""
    width = (hi - lo) / n
    return [lo + width * (i + rng.uniform(0.15, 0.85)) for i in range(n)]


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


def _niah(
    task: str,
    haystack: str,
    context_tokens: int,
    rng: random.Random,
    count_tokens: Callable[[str], int],
    depth: float | None,
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
) -> Sample:
    """RULER's needle-in-a-haystack family.

    ``num_keys`` keys each get ``num_values`` numbers; the first ``num_queries`` keys are asked
    for. With one queried key and one value, the queried needle sits at ``depth`` and the other
    (distractor) needles at random depths; otherwise all needles are spread evenly over the
    document in random order and the sample's depth is ``None``.
    """
    keys = _keys(rng, num_keys)
    values = _numbers(rng, num_keys * num_values)
    needles = [(keys[k], values[k * num_values + v]) for k in range(num_keys) for v in range(num_values)]
    queried = keys[:num_queries]
    answers = [value for key, value in needles if key in queried]

    single = num_queries == 1 and num_values == 1
    if single:
        if depth is None:
            depth = rng.uniform(0.05, 0.95)
        others = [rng.uniform(0.05, 0.95) for _ in needles[1:]]
        facts = [(depth, _needle(*needles[0]))] + [
            (d, _needle(*nv)) for d, nv in zip(others, needles[1:], strict=True)
        ]
    else:
        depth = None
        order = list(range(len(needles)))
        rng.shuffle(order)
        depths = _spread_depths(rng, len(needles))
        facts = [(depths[i], _needle(*needles[j])) for i, j in enumerate(order)]
    facts.sort(key=lambda f: f[0])

    hay = _Haystack(haystack, rng, context_tokens)
    context, _ = fit_to_tokens(
        lambda n: NIAH_INTRO + _insert(hay.units(n), facts), context_tokens, count_tokens, hay.probe
    )
    if single:
        question = f"What is the special magic number for {queried[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {queried[0]} mentioned in the provided text is"
    else:
        who = _join_keys(queried)
        question = f"What are all the special magic numbers for {who} mentioned in the provided text?"
        prefix = f"The special magic numbers for {who} mentioned in the provided text are"
    return Sample(
        task=task,
        context=context,
        question=question,
        answers=answers,
        # RULER scores every niah task with string_match_all (the same as "part" for one answer).
        metric="all",
        depth=depth,
        answer_prefix=prefix,
    )


def _variable_name(rng: random.Random, taken: set[str], forbidden: str) -> str:
    """A fresh five-capital-letter variable name that scoring cannot find by accident.

    Scoring is a case-insensitive substring match, so a name spelling a word of the surrounding
    text ("GRASS", "THERE") would be credited whenever the model echoed that text.
    """
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken and name.lower() not in forbidden:
            taken.add(name)
            return name


def _variable_tracking(
    context_tokens: int,
    rng: random.Random,
    count_tokens: Callable[[str], int],
    num_chains: int = 1,
    num_hops: int = 4,
) -> Sample:
    """RULER's variable tracking: assignment chains ``VAR B = VAR A`` hidden in noise.

    Each chain starts with ``VAR X1 = <5-digit value>`` and copies it ``num_hops`` times; the
    statements of a chain appear in order at random places. The question asks for every variable
    holding the first chain's value, so the answers are its ``num_hops + 1`` variables; extra
    chains (other values) are distractors.
    """
    values = _numbers(rng, num_chains, digits=5)
    forbidden = (VT_INTRO + NOISE).lower() + " variables assigned value according chain text above"
    taken: set[str] = set()
    chains = [[_variable_name(rng, taken, forbidden) for _ in range(num_hops + 1)] for _ in values]
    facts: list[tuple[float, str]] = []
    for names, value in zip(chains, values, strict=True):
        statements = [f"VAR {names[0]} = {value}."] + [
            f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))
        ]
        depths = sorted(rng.uniform(0.02, 0.98) for _ in statements)
        facts += list(zip(depths, statements, strict=True))
    facts.sort(key=lambda f: f[0])

    context, _ = fit_to_tokens(
        lambda n: VT_INTRO + _insert(_noise_units(n), facts), context_tokens, count_tokens, 40
    )
    value = values[0]
    answers = chains[0]
    return Sample(
        task="variable_tracking",
        context=context,
        question=f"Find all variables that are assigned the value {value} in the text above.",
        answers=list(answers),
        metric="all",
        depth=None,
        answer_prefix=(
            "According to the chain(s) of variable assignment in the text above, "
            f"{len(answers)} variables are assigned the value {value}, they are:"
        ),
    )


def _coded_words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct made-up six-letter words (three consonant-vowel syllables, e.g. ``bafoku``).

    Pronounceable nonsense tokenises into a few pieces like real words, yet carries no meaning a
    model could lean on; equal lengths mean no word contains another.
    """
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _zipf_counts(total: int, alpha: float) -> list[int]:
    """Word counts summing to ``total`` with count(rank r) proportional to ``1 / r**alpha``.

    RULER samples word ranks from a Zipf law; here the expected counts are used directly
    (largest-remainder rounding), so the top three are strictly ahead of the rest by design
    rather than by luck. The vocabulary stops where the expected count drops below one.
    """
    norm = sum(1 / r**alpha for r in range(1, 10_000))
    vocab = max(8, int((total / norm) ** (1 / alpha)))
    weights = [1 / r**alpha for r in range(1, vocab + 1)]
    scale = total / sum(weights)
    raw = [w * scale for w in weights]
    counts = [int(x) for x in raw]
    by_remainder = sorted(range(vocab), key=lambda i: (counts[i] - raw[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return [c for c in counts if c > 0]


def _frequent_words(
    context_tokens: int, rng: random.Random, count_tokens: Callable[[str], int], alpha: float = 2.0
) -> Sample:
    """RULER's frequent-words extraction ("fwe"): find the 3 most frequent coded words."""
    pool = _coded_words(rng, 400)
    # One seed-dependent shuffle per length, drawn up front, so build(n) is a pure function of n.
    shuffle_seed = rng.getrandbits(64)

    def build(n: int) -> str:
        if n == 0:
            return FWE_INTRO.rstrip()
        counts = _zipf_counts(n, alpha)
        words = [pool[r] for r, c in enumerate(counts) for _ in range(c)]
        random.Random(shuffle_seed ^ n).shuffle(words)
        return FWE_INTRO + " ".join(words)

    context, _ = fit_to_tokens(build, context_tokens, count_tokens, 200)
    words = context[len(FWE_INTRO) :].split()
    tally: dict[str, int] = {}
    for w in words:
        tally[w] = tally.get(w, 0) + 1
    ranked = sorted(tally, key=lambda w: (-tally[w], w))
    if len(ranked) > 3 and tally[ranked[2]] == tally[ranked[3]]:
        raise ValueError(f"frequent_words: context of {context_tokens} tokens is too short for a clear top 3")
    return Sample(
        task="frequent_words",
        context=context,
        question=(
            "What are the three most frequently appeared words in the above coded text? "
            "Do not provide any explanation."
        ),
        answers=ranked[:3],
        metric="all",
        depth=None,
        answer_prefix="According to the coded text above, the three most frequently appeared words are:",
    )


def make_sample(
    task: str,
    context_tokens: int,
    seed: int,
    count_tokens: Callable[[str], int],
    depth: float | None = None,
    book: str = DEFAULT_BOOK,
) -> Sample:
    """Generate one sample of ``task`` whose context is about ``context_tokens`` tokens long.

    ``count_tokens`` is the caller's tokenizer length (the context lands within ~1.5% below the
    target for it). ``depth`` places the queried needle for the tasks in :data:`NEEDLE_TASKS`
    (random when ``None``) and is ignored by the others. The same arguments always give the
    same sample. ``book`` is the haystack of the book tasks; another book than the default also draws
    other keys and numbers (a stream of its own), so tuning and held-out samples share nothing.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    stream = task if book == DEFAULT_BOOK else f"{task}:{book}"
    rng = random.Random(f"s4r-bench:{stream}:{seed}")
    if task == "niah_single_noise":
        return _niah(task, "noise", context_tokens, rng, count_tokens, depth)
    if task == "niah_single_book":
        return _niah(task, book, context_tokens, rng, count_tokens, depth)
    if task == "niah_multikey":
        return _niah(task, book, context_tokens, rng, count_tokens, depth, num_keys=4)
    if task == "niah_multivalue":
        return _niah(task, book, context_tokens, rng, count_tokens, None, num_values=4)
    if task == "niah_multiquery":
        return _niah(task, book, context_tokens, rng, count_tokens, None, num_keys=4, num_queries=4)
    if task == "variable_tracking":
        return _variable_tracking(context_tokens, rng, count_tokens)
    return _frequent_words(context_tokens, rng, count_tokens)


def make_samples(
    task: str, context_tokens: int, n: int, seed: int, count_tokens: Callable[[str], int],
    book: str = DEFAULT_BOOK,
) -> list[Sample]:
    """Generate ``n`` samples of ``task``; needle tasks get depths spread evenly over [0.05, 0.95].

    Sample ``i`` uses seed ``seed * 1_000_003 + i`` (and, for needle tasks, the ``i``-th depth of
    an even grid, so the whole set depends on ``n``).
    """
    if n < 1:
        return []
    out = []
    for i in range(n):
        depth = None
        if task in NEEDLE_TASKS:
            depth = 0.5 if n == 1 else 0.05 + 0.9 * i / (n - 1)
        out.append(make_sample(task, context_tokens, seed * 1_000_003 + i, count_tokens, depth, book))
    return out


def answer_budget(sample: Sample, count_tokens: Callable[[str], int], cap: int) -> int:
    """New tokens an answer to ``sample`` needs: its references listed as the model would (", "-joined,
    after a space) plus a few tokens of slack, at most ``cap``. Scoring only looks for the references,
    so longer answers cost decode time and change no score."""
    return max(1, min(cap, count_tokens(" " + ", ".join(sample.answers) + ".") + 4))


def needle_sample(
    context_tokens: int,
    depth: float,
    seed: int,
    count_tokens: Callable[[str], int],
    haystack: str = "book",
) -> Sample:
    """One single-needle sample: ``haystack`` is ``"book"`` (Pride and Prejudice), ``"noise"``,
    or the stem of another book (e.g. ``"romeo-and-juliet"``). With ``"book"`` or
    ``"noise"`` it equals ``make_sample`` of the matching ``niah_single_*`` task."""
    task = "niah_single_noise" if haystack == "noise" else "niah_single_book"
    # Same stream as make_sample for the built-in haystacks; other books get their own.
    stream = task if haystack in ("book", "noise") else f"{task}:{haystack}"
    rng = random.Random(f"s4r-bench:{stream}:{seed}")
    return _niah(task, haystack, context_tokens, rng, count_tokens, depth)
