"""Texts and arithmetic of the perplexity gap: NLL of a continuation read through a (compressed) cache.

The benchmark prefills a book passage once, forks it into every method, then feeds the passage's
continuation token by token through each fork (teacher forcing, exactly as decoding would read it) and
averages the negative log-likelihood of each next token. The gap to the full cache is the damage done by
compression.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from s4r.bench.haystack import DEFAULT_BOOK, fit_to_tokens
from s4r.bench.scoring import perplexity_text
from s4r.books import load_book

__all__ = ["NLLMeter", "context_and_continuation", "token_nll"]


def token_nll(logits: torch.Tensor, target: int) -> float:
    """Negative log-likelihood (nats) of token `target` under next-token `logits` [vocab]."""
    # fp32 log-softmax: bf16 logits lose the small probabilities the NLL is about
    return float(F.cross_entropy(logits.float().unsqueeze(0), torch.tensor([target], device=logits.device)))


@dataclass
class NLLMeter:
    """Running mean of per-token NLLs."""

    total: float = 0.0
    count: int = 0

    def add(self, nll: float) -> None:
        self.total += nll
        self.count += 1

    @property
    def mean(self) -> float:
        """Mean NLL in nats per token (NaN before any token)."""
        return self.total / self.count if self.count else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean) if self.count else math.nan


def _repeated_book(tokens: int, continuation_tokens: int, count_tokens: Callable[[str], int],
                   book: str = DEFAULT_BOOK) -> tuple[str, str]:
    """A context of about `tokens` tokens cut from the book read over and over, and the text after it.

    Only for speed runs longer than the book: what the text says does not matter there (the weights are
    often random), only its length does.
    """
    text = load_book(book)

    def build(first: int) -> Callable[[int], str]:
        def passage(n: int) -> str:
            if n <= 0:
                return ""
            reps = (first + n) // len(text) + 1
            return (text * reps)[first : first + n]

        return passage

    context, _ = fit_to_tokens(build(0), tokens, count_tokens, probe=4000)
    continuation, _ = fit_to_tokens(build(len(context) % len(text)), continuation_tokens, count_tokens,
                                    probe=400)
    return context, continuation


def context_and_continuation(tokens: int, continuation_tokens: int,
                             count_tokens: Callable[[str], int]) -> tuple[str, str, bool]:
    """(context, continuation, natural) for a perplexity or speed run at `tokens` context tokens.

    `natural` is True for consecutive book text (what perplexity needs); past the end of the book the
    text is the book repeated, good for timing only, and `natural` is False.
    """
    try:
        context, continuation = perplexity_text(tokens, count_tokens, continuation_tokens=continuation_tokens)
        return context, continuation, True
    except ValueError:
        context, continuation = _repeated_book(tokens, continuation_tokens, count_tokens)
        return context, continuation, False
