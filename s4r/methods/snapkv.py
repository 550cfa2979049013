"""`snapkv`: SnapKV (Li et al., 2024) - keep, per KV head, the prompt tokens the last queries attend to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..cache import CompressedCache
from ..config import S4RConfig
from ..eviction import EvictedLayer, eviction_budget
from ..selection import pool_scores
from .base import CompressContext


def snapkv_scores(keys: torch.Tensor, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """Votes [H, T - W] of the observation window for every earlier prompt token.

    keys [H, T, d] and queries [Hq, W, d] post-RoPE, the queries being those of the last W prompt
    tokens. Each window query's softmax over the whole prompt (causal inside the window) is summed
    over the window and over the query heads that share a KV head.
    """
    heads, total, _ = keys.shape
    q_heads, window, dim = queries.shape
    n_rep = q_heads // heads
    prefix = total - window
    # window query j sits at position prefix + j and must not see the window tokens after it
    future = torch.arange(total, device=keys.device).unsqueeze(0) > (
        prefix + torch.arange(window, device=keys.device).unsqueeze(1))
    votes = []
    # one KV head at a time bounds the [n_rep * W, T] logits for long prompts
    for h in range(heads):
        q = queries[h * n_rep : (h + 1) * n_rep].reshape(n_rep * window, dim).float()
        logits = torch.matmul(q, keys[h].float().t()).mul_(scaling).view(n_rep, window, total)
        probs = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1)
        votes.append(probs[..., :prefix].sum(dim=(0, 1)))
    return torch.stack(votes)


def snapkv_indices(keys: torch.Tensor, queries: torch.Tensor, budget: int, *, kernel: int = 7,
                   pool: str = "avg", scaling: float | None = None) -> torch.Tensor:
    """Positions [H, K] (ascending) SnapKV keeps per KV head: the top `budget - W` pooled votes of the
    tokens before the window, then the W window tokens themselves (only the last `budget` of them
    when the budget is smaller than the window)."""
    heads, total, dim = keys.shape
    window = min(queries.shape[1], total)
    if budget >= total:
        return torch.arange(total, device=keys.device).expand(heads, total)
    if budget <= window:
        return torch.arange(total - budget, total, device=keys.device).expand(heads, budget)
    scores = snapkv_scores(keys, queries[:, -window:], dim**-0.5 if scaling is None else scaling)
    scores = pool_scores(scores, kernel, pool)
    top = torch.topk(scores, budget - window, dim=-1, sorted=False).indices.sort(dim=-1).values
    tail = torch.arange(total - window, total, device=keys.device).expand(heads, window)
    return torch.cat([top, tail], dim=-1)


@dataclass
class SnapKVMethod:
    """SnapKV with an observation window of `query_window` recorded last queries; the budget is
    `floor(T / ratio) - reserve` tokens per head (see `eviction_budget`), window included.

    `scaling` is the attention scale of the votes (None: head_dim ** -0.5, as most models use).
    """

    name: str = "snapkv"
    query_window: int = 32
    kernel: int = 7
    pool: Literal["avg", "max"] = "avg"
    reserve: int = 64
    ratio: float | None = None
    scaling: float | None = None
    layerwise: ClassVar[bool] = True

    @classmethod
    def from_config(cls, cfg: S4RConfig) -> SnapKVMethod:
        """Take the settings S4R shares with it (query window, pooling, buffer_tokens as the reserve)."""
        return cls(query_window=cfg.query_window, kernel=cfg.pool_kernel, pool=cfg.pool,
                   reserve=cfg.buffer_tokens, ratio=cfg.ratio)

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        tokens = cache.logical_length()
        budget = eviction_budget(cache.shape, tokens, self.ratio or ctx.ratio, self.reserve)

        def build(i: int, layer) -> EvictedLayer:
            if layer.queries is None:
                raise ValueError("snapkv needs the prompt's last queries: prefill with a query window")
            queries = layer.queries[0, :, -self.query_window :]
            idx = snapkv_indices(layer.keys_view[0], queries, budget, kernel=self.kernel, pool=self.pool,
                                 scaling=self.scaling)
            return EvictedLayer.from_staged(layer, idx)

        cache.compress(build)
        return {"kept_tokens": min(budget, tokens), "window": self.query_window, "reserve": self.reserve}
