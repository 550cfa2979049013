"""RULER's variable tracking (multi-hop tracing) and frequent-words extraction (aggregation) tasks."""

from __future__ import annotations

import random
from collections.abc import Callable

from s4r.bench.haystack import NOISE, fit_to_tokens, insert_facts, noise_units
from s4r.bench.needle_tasks import random_numbers
from s4r.bench.sample import Sample

__all__ = ["FWE_INTRO", "VT_INTRO", "frequent_words", "variable_tracking"]

VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words.\n\n"
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


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


def variable_tracking(
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
    values = random_numbers(rng, num_chains, digits=5)
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
        lambda n: VT_INTRO + insert_facts(noise_units(n), facts), context_tokens, count_tokens, 40
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


def frequent_words(
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
