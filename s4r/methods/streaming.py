"""`streaming`: StreamingLLM (Xiao et al., 2023) - the attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from s4r.layers.full import StagingLayer
from s4r.methods.scorer import ScorerMethod, keep_top, protect_first


def streaming_scores(tokens: int, budget: int, sinks: int) -> torch.Tensor:
    """[T] scores of StreamingLLM: the first `sinks` always kept, then the later the better."""
    return protect_first(torch.arange(tokens, dtype=torch.float32), sinks, budget)


def streaming_indices(tokens: int, budget: int, sinks: int) -> torch.Tensor:
    """Positions [K] StreamingLLM keeps of a `tokens`-long prompt: the first `sinks`, then the most recent
    ones up to `budget` in all (every token when the budget covers the prompt)."""
    return keep_top(streaming_scores(tokens, budget, sinks), budget)


@dataclass
class StreamingMethod(ScorerMethod):
    """Keep `sinks` first tokens and the most recent ones, the same tokens for every head and layer."""

    name: str = "streaming"
    sinks: int = 4

    def score(self, i: int, layer: StagingLayer, budget: int) -> torch.Tensor:
        return streaming_scores(layer.logical, budget, self.sinks).to(layer.keys_view.device)

    def report(self, kept: int) -> dict[str, Any]:
        sinks = min(self.sinks, kept)
        return {"sinks": sinks, "recent": kept - sinks}
