"""`full`: the uncompressed cache, the reference every method is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..cache import S4RCache
from .base import CompressContext


@dataclass
class FullMethod:
    """Keep every key and value in the model's dtype."""

    name: str = "full"
    query_window: int = 0
    layerwise: ClassVar[bool] = True

    def compress(self, cache: S4RCache, ctx: CompressContext) -> dict:
        for layer in cache.layers:
            layer.query_window, layer.queries = 0, None
        return {}
