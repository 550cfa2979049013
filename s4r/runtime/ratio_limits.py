"""The highest compression ratio a method can ever reach on a model, to refuse hopeless ratios up front.

A short document may not pay for a method's fixed costs (sinks, bases, the new-token buffer), and the
session then keeps it uncompressed. But some ratios cannot be reached at any length the model accepts
(int8 coefficients and 5% exact outliers cap S4R near 15x on SmolLM2): those are refused before the
document is read, instead of after a long ingest.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape, lowrank_layer_bytes
from s4r.methods import make_method

__all__ = ["max_ratio", "method_max_ratio"]


def method_max_ratio(method: Any, shape: KVShape, tokens: int) -> float:
    """The best ratio ``method`` reaches for a ``tokens``-long prompt; ``inf`` when it has no limit
    (``full`` ignores the ratio) or is of a kind this module does not know."""
    own = getattr(method, "max_ratio", None)
    if callable(own):  # a method that knows its own limit (quant) says it
        return own(shape, tokens)
    cfg = getattr(method, "config", None)
    if isinstance(cfg, S4RConfig):
        stored = max(tokens - cfg.sinks, 0)
        rank_k = cfg.rank_k if cfg.rank_k is not None else 1
        rank_v = cfg.rank_v if cfg.rank_v is not None else 1
        smallest = lowrank_layer_bytes(shape, cfg, rank_k, rank_v, stored, cfg.buffer_tokens)
        return shape.full_bytes_per_token() * tokens / smallest
    reserve = getattr(method, "reserve", None)
    if isinstance(reserve, int):
        # an evicting method keeps floor(tokens / ratio) - reserve prompt tokens, at least one
        return tokens / (reserve + 1)
    return math.inf


def max_ratio(loaded: Any, method: str, overrides: dict[str, Any] | None = None) -> float:
    """The highest ratio ``method`` can reach on a loaded model (``s4r.models.loading.LoadedModel``) with a
    document filling its whole context."""
    model = loaded.model
    dtype = loaded.dtype if isinstance(loaded.dtype, torch.dtype) else next(model.parameters()).dtype
    shape = KVShape.from_config(model.config, torch.empty(0, dtype=dtype).element_size())
    return method_max_ratio(make_method(method, 2.0, overrides), shape, int(loaded.context_length))
