"""`snapkv`: SnapKV (Li et al., 2024) - keep, per KV head, the prompt tokens the last queries attend to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from s4r.core.selection import pool_scores
from s4r.layers.full import StagingLayer
from s4r.methods.scorer import ScorerMethod, keep_top


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


def snapkv_token_scores(keys: torch.Tensor, queries: torch.Tensor, budget: int, *, kernel: int = 7,
                        pool: str = "avg", scaling: float | None = None) -> torch.Tensor:
    """[H, T] scores of SnapKV: the observation window's pooled votes for the tokens before it, the W window
    tokens themselves always kept (only the last `budget` of them when the budget is smaller)."""
    heads, total, dim = keys.shape
    window = min(queries.shape[1], total)
    if budget <= window:  # the last tokens only: their positions rank them
        return torch.arange(total, device=keys.device, dtype=torch.float32).expand(heads, total)
    votes = snapkv_scores(keys, queries[:, -window:], dim**-0.5 if scaling is None else scaling)
    forced = torch.full((heads, window), float("inf"), device=keys.device)
    return torch.cat([pool_scores(votes, kernel, pool), forced], dim=-1)


def snapkv_indices(keys: torch.Tensor, queries: torch.Tensor, budget: int, *, kernel: int = 7,
                   pool: str = "avg", scaling: float | None = None) -> torch.Tensor:
    """Positions [H, K] (ascending) SnapKV keeps per KV head: the top `budget - W` pooled votes of the
    tokens before the window, then the W window tokens themselves (only the last `budget` of them
    when the budget is smaller than the window)."""
    return keep_top(snapkv_token_scores(keys, queries, budget, kernel=kernel, pool=pool, scaling=scaling),
                    budget)


@dataclass
class SnapKVMethod(ScorerMethod):
    """SnapKV with an observation window of `query_window` recorded last queries; the budget is
    `floor(T / ratio) - reserve` tokens per head (see `eviction_budget`), window included.

    `scaling` is the attention scale of the votes (None: head_dim ** -0.5, as most models use).
    """

    name: str = "snapkv"
    query_window: int = 32
    kernel: int = 7
    pool: Literal["avg", "max"] = "max"  # max pooling, as S4R's selection (the paper's is "avg")
    scaling: float | None = None
    ALIASES: ClassVar[dict[str, str]] = {"buffer_tokens": "reserve", "pool_kernel": "kernel"}

    def score(self, i: int, layer: StagingLayer, budget: int) -> torch.Tensor:
        if layer.queries is None:
            raise ValueError("snapkv needs the prompt's last queries: prefill with a query window")
        queries = layer.queries[0, :, -self.query_window :]
        return snapkv_token_scores(layer.keys_view[0], queries, budget, kernel=self.kernel, pool=self.pool,
                                   scaling=self.scaling)

    def report(self, kept: int) -> dict[str, Any]:
        return {"window": self.query_window}
