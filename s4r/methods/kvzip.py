"""`kvzip`: query-agnostic eviction by context-reconstruction scores (KVzip, arXiv 2505.23416).

Per KV head, keep the prompt tokens the "repeat the context" queries attend to most (see
`s4r.kvzip_scoring`), the attention sinks always among them; the budget is the evicting methods'
`floor(T / ratio) - reserve` tokens. Simplifications against the paper: the same budget for every head
and layer (KVzip may spread it unevenly), and the chunked scoring without the earlier repeated chunks.
Scoring runs the model once more over the context, which `compress_seconds` includes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache import CompressedCache
from ..config import S4RConfig
from ..errors import S4RError
from ..eviction import EvictedLayer, eviction_budget
from ..kvzip_scoring import kvzip_scores
from .base import CompressContext

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


def kvzip_indices(scores: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    """Positions [H, K] (ascending) kept per head: the first `sinks`, then the best scores."""
    heads, total = scores.shape
    if budget >= total:
        return torch.arange(total, device=scores.device).expand(heads, total)
    s = min(sinks, budget)
    ranked = scores.clone()
    ranked[:, :s] = float("inf")
    return torch.topk(ranked, budget, dim=-1, sorted=False).indices.sort(dim=-1).values


@dataclass
class KVzipMethod:
    """KVzip eviction; needs the model and the prompt's token ids in the compression context."""

    name: str = "kvzip"
    query_window: int = 0
    sinks: int = 4
    reserve: int = 64
    ratio: float | None = None
    chunk_tokens: int = 512

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        if ctx.model is None or ctx.ids is None or ctx.tokenizer is None:
            raise S4RError("kvzip scores by re-reading the prompt: it needs the model, tokenizer and ids")
        tokens = cache.logical_length()
        if len(ctx.ids) != tokens:
            raise S4RError(f"kvzip got {len(ctx.ids)} prompt ids for a {tokens}-token cache")
        budget = eviction_budget(cache.shape, tokens, self.ratio or ctx.ratio, self.reserve)
        repeat = ctx.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)
        scores = kvzip_scores(ctx.model, cache, ctx.ids, repeat, self.chunk_tokens)
        cache.compress(lambda i, layer: EvictedLayer.from_staged(
            layer, kvzip_indices(scores[i], budget, self.sinks)))
        return {"kept_tokens": min(budget, tokens), "reserve": self.reserve,
                "chunk_tokens": self.chunk_tokens}


def build(ratio: float, overrides: dict[str, Any] | None = None) -> KVzipMethod:
    """The `kvzip` method for `ratio`; reads `sinks` and `buffer_tokens` (its reserve) from the overrides."""
    cfg = S4RConfig(ratio=ratio).with_overrides(overrides)
    return KVzipMethod(sinks=cfg.sinks, reserve=cfg.buffer_tokens, ratio=cfg.ratio)
