"""`s4r`: selective sampling, subspaces and sparse reconstruction (also `s4r-paper` and `svd`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..budget import solve_ranks
from ..cache import S4RCache, staged_tensors
from ..compress import compress_layer
from ..config import S4RConfig
from .base import CompressContext


@dataclass
class S4RMethod:
    """S4R with the given settings; ranks come from the budget solver unless fixed in the config."""

    config: S4RConfig = field(default_factory=S4RConfig)
    name: str = "s4r"
    # exactness checks: reconstruct every stored token at each step
    reconstruct_all: bool = False

    @property
    def query_window(self) -> int:
        return self.config.query_window

    def compress(self, cache: S4RCache, ctx: CompressContext) -> dict:
        cfg = self.config
        plan = solve_ranks(cache.shape, cfg, cache.logical_length())
        cache.compress(lambda i, layer: compress_layer(
            *staged_tensors(layer), cfg, plan.rank_k, plan.rank_v, ctx.rope,
            reconstruct_all=self.reconstruct_all))
        return {"rank_k": plan.rank_k, "rank_v": plan.rank_v, "granularity": cfg.granularity}
