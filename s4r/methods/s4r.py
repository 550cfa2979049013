"""`s4r`: selective sampling, subspaces and sparse reconstruction (also `s4r-fast`, `s4r-paper`, `svd`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape, allocate_ranks, group_shape, solve_ranks
from s4r.core.compress import compress_layer, fit_layer_bases
from s4r.hf.cache import CompressedCache
from s4r.layers.full import staged_tensors
from s4r.methods.base import CompressContext


def energy_ranks(cfg: S4RConfig) -> bool:
    """Whether ranks are spread over layers by energy (which needs every layer's spectrum first)."""
    return cfg.rank_alloc == "energy" and cfg.rank_k is None


def plan_ranks(shape: KVShape, cfg: S4RConfig, tokens: int,
               energies: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> list[tuple[int, int]]:
    """Per-layer (rank_k, rank_v) for `tokens` tokens: by energy (`energies()`: per-layer K/V energy per
    basis column, only asked for then), else the solver's one pair for every layer."""
    if energy_ranks(cfg):
        return allocate_ranks(shape, cfg, tokens, energies())
    plan = solve_ranks(shape, cfg, tokens)
    return [(plan.rank_k, plan.rank_v)] * shape.layers


@dataclass
class S4RMethod:
    """S4R with the given settings; ranks come from the budget solver unless fixed in the config."""

    config: S4RConfig = field(default_factory=S4RConfig)
    name: str = "s4r"

    @classmethod
    def settings(cls) -> frozenset[str]:
        """The override keys it takes: the fields of `S4RConfig`."""
        return frozenset(f.name for f in fields(S4RConfig))

    # the preset a ratio turns into settings; the named variants below differ only in this
    preset: ClassVar[Callable[[float], S4RConfig]] = staticmethod(S4RConfig)

    @classmethod
    def defaults(cls, ratio: float) -> S4RConfig:
        """The settings before overrides."""
        return cls.preset(ratio)

    @classmethod
    def build(cls, ratio: float, overrides: dict[str, Any] | None = None) -> S4RMethod:
        """This method for `ratio` with the overrides that name S4R settings (others are ignored)."""
        own = {k: v for k, v in (overrides or {}).items() if k in cls.settings()}
        return cls(cls.defaults(ratio).with_overrides(own))

    @property
    def query_window(self) -> int:
        return self.config.query_window

    @property
    def layerwise(self) -> bool:
        """Per-layer unless ranks are spread over layers by energy (that needs every layer's spectrum)."""
        return not energy_ranks(self.config)

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        cfg = self.config
        bases = [None] * len(cache.layers)

        def energies() -> list[tuple[torch.Tensor, torch.Tensor]]:
            # full-width bases of every layer; compress_layer reuses them at the chosen ranks
            width = group_shape(cache.shape, cfg.granularity)[1]
            bases[:] = [fit_layer_bases(*staged_tensors(layer)[:2], cfg, ctx.rope, width, width)
                        for layer in cache.layers]
            return [(b.energy_k, b.energy_v) for b in bases]

        ranks = plan_ranks(cache.shape, cfg, cache.logical_length(), energies)
        cache.compress(lambda i, layer: compress_layer(
            *staged_tensors(layer), cfg, ranks[i][0], ranks[i][1], ctx.rope, bases=bases[i]))
        return {"rank_k": [r[0] for r in ranks], "rank_v": [r[1] for r in ranks],
                "granularity": cfg.granularity}


@dataclass
class S4RPaperMethod(S4RMethod):
    """S4R with the paper's literal settings (`S4RConfig.paper`)."""

    name: str = "s4r-paper"
    preset: ClassVar[Callable[[float], S4RConfig]] = staticmethod(S4RConfig.paper)


@dataclass
class S4RFastMethod(S4RMethod):
    """S4R with post-RoPE keys attended in latent space (`S4RConfig.fast`): a faster step, less faithful."""

    name: str = "s4r-fast"
    preset: ClassVar[Callable[[float], S4RConfig]] = staticmethod(S4RConfig.fast)
