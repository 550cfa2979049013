"""RULER's needle-in-a-haystack tasks: magic numbers for word keys hidden in a haystack."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from s4r.bench.haystack import Haystack, fit_to_tokens, insert_facts
from s4r.bench.sample import Sample

__all__ = ["NIAH_INTRO", "needle_keys", "needle_question", "niah", "quiz_document", "random_numbers"]

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards.\n\n"
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


def needle_keys(rng: random.Random, n: int) -> list[str]:
    """``n`` adjective-noun keys sharing no word, so no key is a near-copy of another."""
    adjectives = rng.sample(_ADJECTIVES, n)
    nouns = rng.sample(_NOUNS, n)
    return [f"{a}-{b}" for a, b in zip(adjectives, nouns, strict=True)]


def random_numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    """``n`` distinct numbers of exactly ``digits`` digits (same length, so none contains another)."""
    values = rng.sample(range(10 ** (digits - 1), 10**digits), n)
    return [str(v) for v in values]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _spread_depths(rng: random.Random, n: int, lo: float = 0.05, hi: float = 0.95) -> list[float]:
    """``n`` depths, one in each of ``n`` equal slices of [lo, hi], jittered within the slice."""
    width = (hi - lo) / n
    return [lo + width * (i + rng.uniform(0.15, 0.85)) for i in range(n)]


def needle_question(key: str) -> tuple[str, str]:
    """(question, answer prefix) asking for one key's number."""
    return (f"What is the special magic number for {key} mentioned in the provided text?",
            f"The special magic number for {key} mentioned in the provided text is")


def quiz_document(needles: Sequence[tuple[str, str]], haystack: str, context_tokens: int, rng: random.Random,
                  count_tokens: Callable[[str], int]) -> str:
    """A haystack of about ``context_tokens`` tokens with the (key, number) ``needles`` spread evenly over
    it in the given order (a document of a multi-question chat, `research.long_chat`)."""
    depths = _spread_depths(rng, len(needles))
    facts = [(d, _needle(key, value)) for d, (key, value) in zip(depths, needles, strict=True)]
    hay = Haystack(haystack, rng, context_tokens)
    context, _ = fit_to_tokens(
        lambda n: NIAH_INTRO + insert_facts(hay.units(n), facts), context_tokens, count_tokens, hay.probe
    )
    return context


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def niah(
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
    keys = needle_keys(rng, num_keys)
    values = random_numbers(rng, num_keys * num_values)
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

    hay = Haystack(haystack, rng, context_tokens)
    context, _ = fit_to_tokens(
        lambda n: NIAH_INTRO + insert_facts(hay.units(n), facts), context_tokens, count_tokens, hay.probe
    )
    if single:
        question, prefix = needle_question(queried[0])
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
