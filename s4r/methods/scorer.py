"""The evicting methods' base, as kvpress's `ScorerPress`: a method writes only how it scores tokens.

Budget (`eviction_budget`: the prompt tokens that fit 1/ratio of the cache with `reserve` new tokens),
the choice of the best-scored tokens per KV head, the storage (`EvictedLayer`) and the report are
written here once. A score of +inf keeps a token whatever the others score (sinks, an observation
window); a subclass gives them to at most `budget` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from s4r.hf.cache import CompressedCache
from s4r.layers.eviction import EvictedLayer, eviction_budget
from s4r.layers.full import StagingLayer
from s4r.methods.base import CompressContext, OwnSettings


def keep_top(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Positions (ascending) of the `budget` best `scores` along the last axis: [K] for scores [T] (the
    same tokens for every head), [H, K] for [H, T]; every position when the budget covers them."""
    total = scores.shape[-1]
    if budget >= total:
        return torch.arange(total, device=scores.device).expand(*scores.shape[:-1], total)
    return torch.topk(scores, budget, dim=-1, sorted=False).indices.sort(dim=-1).values


def protect_first(scores: torch.Tensor, count: int, budget: int) -> torch.Tensor:
    """`scores` (a copy) with the first `count` tokens (the attention sinks) always kept, within `budget`."""
    kept = scores.float().clone()
    kept[..., : min(count, budget)] = float("inf")
    return kept


@dataclass
class ScorerMethod(OwnSettings):
    """Keep, per layer (and KV head), the `floor(T / ratio) - reserve` prompt tokens `score` rates best."""

    name: str = "scorer"
    query_window: int = 0
    reserve: int = 64
    ratio: float | None = None  # None: the compression context's ratio
    layerwise: ClassVar[bool] = True
    ALIASES: ClassVar[dict[str, str]] = {"buffer_tokens": "reserve"}

    def score(self, i: int, layer: StagingLayer, budget: int) -> torch.Tensor:
        """How much each prompt token of layer `i` is worth keeping: [T] for every head, or [H, T]."""
        raise NotImplementedError

    def prepare(self, cache: CompressedCache, ctx: CompressContext) -> None:
        """Work `score` needs over the whole staged cache first (kvzip re-reads the prompt)."""

    def report(self, kept: int) -> dict[str, Any]:
        """What this method chose, besides the kept token count and the reserve."""
        return {}

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        tokens = cache.logical_length()
        budget = eviction_budget(cache.shape, tokens, self.ratio or ctx.ratio, self.reserve)
        self.prepare(cache, ctx)
        cache.compress(lambda i, layer: EvictedLayer.from_staged(layer, keep_top(self.score(i, layer, budget),
                                                                                 budget)))
        kept = min(budget, tokens)
        return {"kept_tokens": kept, "reserve": self.reserve, **self.report(kept)}
