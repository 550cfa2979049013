"""`s4r`: selective sampling, subspaces and sparse reconstruction (also `s4r-paper` and `svd`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..budget import allocate_ranks, group_shape, solve_ranks
from ..cache import CompressedCache, staged_tensors
from ..compress import compress_layer, fit_layer_bases
from ..config import S4RConfig
from .base import CompressContext


@dataclass
class S4RMethod:
    """S4R with the given settings; ranks come from the budget solver unless fixed in the config."""

    config: S4RConfig = field(default_factory=S4RConfig)
    name: str = "s4r"

    @property
    def query_window(self) -> int:
        return self.config.query_window

    @property
    def layerwise(self) -> bool:
        """Per-layer unless ranks are spread over layers by energy (that needs every layer's spectrum)."""
        return not (self.config.rank_alloc == "energy" and self.config.rank_k is None)

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        cfg = self.config
        tokens = cache.logical_length()
        if cfg.rank_alloc == "energy" and cfg.rank_k is None:
            width = group_shape(cache.shape, cfg.granularity)[1]
            bases = [fit_layer_bases(*staged_tensors(layer)[:2], cfg, ctx.rope, width, width)
                     for layer in cache.layers]
            ranks = allocate_ranks(cache.shape, cfg, tokens, [(b.energy_k, b.energy_v) for b in bases])
        else:
            plan = solve_ranks(cache.shape, cfg, tokens)
            ranks = [(plan.rank_k, plan.rank_v)] * len(cache.layers)
            bases = [None] * len(cache.layers)
        cache.compress(lambda i, layer: compress_layer(
            *staged_tensors(layer), cfg, ranks[i][0], ranks[i][1], ctx.rope, bases=bases[i]))
        return {"rank_k": [r[0] for r in ranks], "rank_v": [r[1] for r in ranks],
                "granularity": cfg.granularity}
