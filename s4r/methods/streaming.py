"""`streaming`: StreamingLLM (Xiao et al., 2023) - the attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache import CompressedCache
from ..config import S4RConfig
from ..eviction import EvictedLayer, eviction_budget
from .base import CompressContext


def streaming_indices(tokens: int, budget: int, sinks: int) -> torch.Tensor:
    """Positions [K] StreamingLLM keeps of a `tokens`-long prompt: the first `sinks`, then the most recent
    ones up to `budget` in all (every token when the budget covers the prompt)."""
    if budget >= tokens:
        return torch.arange(tokens)
    s = min(sinks, budget)
    return torch.cat([torch.arange(s), torch.arange(tokens - (budget - s), tokens)])


@dataclass
class StreamingMethod:
    """Keep `sinks` first tokens and the most recent ones, the same tokens for every head and layer.

    The budget is `floor(T / ratio) - reserve` tokens (see `eviction_budget`); `ratio` None takes the
    ratio of the compression context.
    """

    name: str = "streaming"
    query_window: int = 0  # needs no queries
    layerwise: ClassVar[bool] = True
    sinks: int = 4
    reserve: int = 64
    ratio: float | None = None

    @classmethod
    def from_config(cls, cfg: S4RConfig) -> StreamingMethod:
        """Take the settings S4R shares with it (sinks, buffer_tokens as the reserve, ratio)."""
        return cls(sinks=cfg.sinks, reserve=cfg.buffer_tokens, ratio=cfg.ratio)

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        tokens = cache.logical_length()
        budget = eviction_budget(cache.shape, tokens, self.ratio or ctx.ratio, self.reserve)
        idx = streaming_indices(tokens, budget, self.sinks)
        cache.compress(lambda i, layer: EvictedLayer.from_staged(layer, idx))
        sinks = min(self.sinks, idx.numel())
        return {"kept_tokens": idx.numel(), "sinks": sinks, "recent": idx.numel() - sinks,
                "reserve": self.reserve}
