"""What a compression method is: a dataclass that turns a staged (full) cache into its stored form."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..cache import CompressedCache
from ..rope import RopeFn


@dataclass(frozen=True)
class CompressContext:
    """What a method may use besides the staged cache."""

    rope: RopeFn | None
    ratio: float
    # what methods that re-run the model need (kvzip): the model, its tokenizer and the prompt's ids
    model: Any = None
    tokenizer: Any = None
    ids: Sequence[int] | None = None


class Method(Protocol):
    """A KV-cache method: `query_window` tells the prefill how many last queries to keep for it."""

    name: str
    query_window: int
    # optional: True when `compress` only needs the token count before building each layer from that
    # layer alone, so a layer-wise ingest can compress every layer as soon as it is complete (a method
    # without it is given the whole staged cache after a token-chunked prefill)
    layerwise: bool

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        """Compress `cache` in place after prefill; return what it chose (ranks, kept tokens...)."""
        ...
