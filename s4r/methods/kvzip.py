"""`kvzip`: query-agnostic eviction by context-reconstruction scores (KVzip, arXiv 2505.23416).

Per KV head, keep the prompt tokens the "repeat the context" queries attend to most (see
`s4r.kvzip_scoring`), the attention sinks always among them; the budget is the evicting methods'
`floor(T / ratio) - reserve` tokens. Simplifications against the paper: the same budget for every head
and layer (KVzip may spread it unevenly), and the chunked scoring without the earlier repeated chunks.
Scoring runs the model once more over the context, which `compress_seconds` includes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..cache import CompressedCache
from ..errors import S4RError
from ..kvzip_scoring import kvzip_scores
from ..layers import StagingLayer
from .base import CompressContext
from .scorer import ScorerMethod, keep_top, protect_first

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


def kvzip_indices(scores: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    """Positions [H, K] (ascending) kept per head: the first `sinks`, then the best scores."""
    return keep_top(protect_first(scores, sinks, budget), budget)


@dataclass
class KVzipMethod(ScorerMethod):
    """KVzip eviction; needs the model and the prompt's token ids in the compression context."""

    name: str = "kvzip"
    sinks: int = 4
    chunk_tokens: int = 512
    layerwise: ClassVar[bool] = False  # scoring re-reads the prompt through every layer
    _scores: list[torch.Tensor] | None = field(default=None, init=False, repr=False)

    def prepare(self, cache: CompressedCache, ctx: CompressContext) -> None:
        if ctx.model is None or ctx.ids is None or ctx.tokenizer is None:
            raise S4RError("kvzip scores by re-reading the prompt: it needs the model, tokenizer and ids")
        tokens = cache.logical_length()
        if len(ctx.ids) != tokens:
            raise S4RError(f"kvzip got {len(ctx.ids)} prompt ids for a {tokens}-token cache")
        repeat = ctx.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)
        self._scores = kvzip_scores(ctx.model, cache, ctx.ids, repeat, self.chunk_tokens)

    def score(self, i: int, layer: StagingLayer, budget: int) -> torch.Tensor:
        return protect_first(self._scores[i], self.sinks, budget)

    def report(self, kept: int) -> dict[str, Any]:
        self._scores = None  # [layers, H, T] floats: not kept past the compression
        return {"chunk_tokens": self.chunk_tokens}
