"""What a benchmark run measures: :class:`BenchConfig`, its presets and defaults, and length parsing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from s4r.bench.tasks import DEFAULT_BOOK, TASKS
from s4r.methods import METHODS
from s4r.validation import check_ratio

__all__ = ["DEFAULT_LENGTHS", "DEFAULT_METHODS", "DEFAULT_RATIOS", "QUICK_METHODS", "QUICK_TASKS",
           "BenchConfig", "parse_lengths"]

# every registered method, full (the reference of every comparison) first
DEFAULT_METHODS: tuple[str, ...] = ("full", *(m for m in METHODS if m != "full"))
# the CI smoke test leaves kvzip out: its scoring re-reads every context (about one more prefill each)
QUICK_METHODS: tuple[str, ...] = tuple(m for m in DEFAULT_METHODS if m != "kvzip")
DEFAULT_RATIOS: tuple[float, ...] = (2.5, 5.0)
DEFAULT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192)
# perplexity needs a context long enough for compression to matter; shorter lengths are speed-only
PERPLEXITY_MIN_LENGTH = 4096
RANDOM_WEIGHTS_LENGTHS: tuple[int, ...] = (32768, 65536, 131072)
QUICK_TASKS: tuple[str, ...] = ("niah_single_noise", "niah_multikey", "variable_tracking")
# tokens kept free besides ANSWER_HEADROOM for the chat template's opening (system prompt) and rounding
LENGTH_MARGIN = 16
FULL_RATIO = 1.0


@dataclass
class BenchConfig:
    """What to run. `lengths` are context lengths in tokens for accuracy and speed.

    `perplexity_lengths` None means the `lengths` of at least PERPLEXITY_MIN_LENGTH tokens (or the
    longest one when all are shorter). `overrides` maps a method name to its `config_overrides`.
    `full` is always run: it is the reference of every comparison.
    """

    methods: tuple[str, ...] = DEFAULT_METHODS
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    perplexity_lengths: tuple[int, ...] | None = None
    tasks: tuple[str, ...] = tuple(TASKS)
    samples: int = 5
    seed: int = 0
    # the cap of an answer; each sample gets only what its reference answer needs (answer_budget)
    max_new_tokens: int = 32
    # the book the book-haystack tasks draw from: tune on TUNING_BOOK, report on HELDOUT_BOOK
    book: str = DEFAULT_BOOK
    continuation_tokens: int = 256
    decode_steps: int = 64
    warmup_steps: int = 4
    accuracy: bool = True
    perplexity: bool = True
    speed: bool = True
    chunk_size: int = 512
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    quick: bool = False
    # ratios of one method instead of `ratios` (`--methods s4r@2.5,s4r@5,kvzip@5`): the costly methods
    # run only where they matter
    method_ratios: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def quick_preset(cls, **changes: Any) -> BenchConfig:
        """The CI smoke test: 2k tokens, one sample of three tasks, a short continuation; every method but
        kvzip (QUICK_METHODS)."""
        base = cls(methods=QUICK_METHODS, lengths=(2048,), perplexity_lengths=(2048,), tasks=QUICK_TASKS,
                   samples=1, max_new_tokens=16, continuation_tokens=48, decode_steps=32, warmup_steps=2,
                   quick=True)
        return replace(base, **changes)

    def validate(self) -> None:
        """Raise ValueError for settings no run can satisfy."""
        if not self.ratios:
            raise ValueError("ratios: give at least one")
        for r in (*self.ratios, *(r for rs in self.method_ratios.values() for r in rs)):
            check_ratio(r, ValueError, name="ratio", upper=None)
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise ValueError("context lengths must be at least 64 tokens")
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if self.samples < 1 or self.max_new_tokens < 1 or self.decode_steps < 1 or self.warmup_steps < 0:
            raise ValueError("samples, max_new_tokens and decode_steps must be positive, warmup_steps >= 0")
        if self.continuation_tokens < 2:
            raise ValueError("the perplexity continuation needs at least 2 tokens")
        if not (self.accuracy or self.perplexity or self.speed):
            raise ValueError("nothing to run: accuracy, perplexity and speed are all off")

    def ppl_lengths(self) -> tuple[int, ...]:
        """Context lengths of the perplexity measurement (empty when perplexity is off)."""
        if not self.perplexity:
            return ()
        if self.perplexity_lengths is not None:
            return tuple(sorted(set(self.perplexity_lengths)))
        long = tuple(n for n in sorted(set(self.lengths)) if n >= PERPLEXITY_MIN_LENGTH)
        return long or (max(self.lengths),)

    def context_lengths(self) -> tuple[int, ...]:
        """Lengths of the context phase: speed lengths and perplexity lengths together."""
        speed = tuple(self.lengths) if self.speed else ()
        return tuple(sorted(set(speed) | set(self.ppl_lengths())))

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (the report's ``config``)."""
        return {"methods": list(self.methods), "ratios": list(self.ratios), "lengths": list(self.lengths),
                "perplexity_lengths": list(self.ppl_lengths()), "tasks": list(self.tasks),
                "samples": self.samples, "seed": self.seed, "max_new_tokens": self.max_new_tokens,
                "book": self.book,
                "continuation_tokens": self.continuation_tokens, "decode_steps": self.decode_steps,
                "warmup_steps": self.warmup_steps, "accuracy": self.accuracy, "perplexity": self.perplexity,
                "speed": self.speed, "chunk_size": self.chunk_size, "overrides": self.overrides,
                "quick": self.quick, "method_ratios": {m: list(r) for m, r in self.method_ratios.items()}}


def parse_lengths(values: Sequence[str]) -> tuple[int, ...]:
    """'2k', '4K', '8192', '128k' -> token counts (k = 1024)."""
    out = []
    for raw in values:
        text = raw.strip().lower()
        if not text:
            continue
        mult = 1024 if text.endswith("k") else 1
        number = text[:-1] if text.endswith("k") else text
        try:
            value = float(number) * mult
        except ValueError:
            raise ValueError(f"'{raw}' is not a length (use tokens like 8192 or 8k)") from None
        if not value.is_integer() or value < 1:
            raise ValueError(f"'{raw}' is not a whole number of tokens")
        out.append(int(value))
    return tuple(out)
