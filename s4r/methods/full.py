"""`full`: the uncompressed cache, the reference every method is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from s4r.hf.cache import CompressedCache
from s4r.layers.full import FullLayer
from s4r.methods.base import CompressContext, OwnSettings


@dataclass
class FullMethod(OwnSettings):
    """Keep every key and value in the model's dtype (no settings: the ratio is always 1)."""

    name: str = "full"
    query_window: ClassVar[int] = 0
    layerwise: ClassVar[bool] = True

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        cache.compress(lambda i, layer: FullLayer.from_staged(layer))
        return {}
