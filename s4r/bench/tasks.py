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

import random
from collections.abc import Callable

from s4r.bench.haystack import DEFAULT_BOOK, HELDOUT_BOOK, TUNING_BOOK, book_sentences, fit_to_tokens
from s4r.bench.needle_tasks import niah
from s4r.bench.sample import Sample
from s4r.bench.tracking_tasks import frequent_words, variable_tracking
from s4r.books import load_book

# re-exported: callers take the books, the sample type and the length fitting from here
__all__ = [
    "DEFAULT_BOOK",
    "HELDOUT_BOOK",
    "NEEDLE_TASKS",
    "TASKS",
    "TASK_SETS",
    "TUNING_BOOK",
    "Sample",
    "answer_budget",
    "book_sentences",
    "fit_to_tokens",
    "load_book",
    "make_sample",
    "make_samples",
    "needle_sample",
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

# named task selections (`s4r bench --tasks needles`); `needles` are the runs that chose the defaults
TASK_SETS: dict[str, tuple[str, ...]] = {
    "needles": ("niah_single_book", "niah_multikey", "niah_multivalue"),
}


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
        return niah(task, "noise", context_tokens, rng, count_tokens, depth)
    if task == "niah_single_book":
        return niah(task, book, context_tokens, rng, count_tokens, depth)
    if task == "niah_multikey":
        return niah(task, book, context_tokens, rng, count_tokens, depth, num_keys=4)
    if task == "niah_multivalue":
        return niah(task, book, context_tokens, rng, count_tokens, None, num_values=4)
    if task == "niah_multiquery":
        return niah(task, book, context_tokens, rng, count_tokens, None, num_keys=4, num_queries=4)
    if task == "variable_tracking":
        return variable_tracking(context_tokens, rng, count_tokens)
    return frequent_words(context_tokens, rng, count_tokens)


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
    return niah(task, haystack, context_tokens, rng, count_tokens, depth)
