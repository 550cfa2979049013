"""An independent copy of a compressed cache, for one request's conversation over a held document."""

from __future__ import annotations

import torch

from s4r.core.rope import RopeFn
from s4r.hf.cache import CompressedCache
from s4r.runtime.persist import LAYER_KINDS


def fork_cache(cache: CompressedCache, rope: RopeFn | None) -> CompressedCache:
    """A copy of `cache` that shares no tensor with it: appending to one never changes the other.

    Each layer is rebuilt from a clone of the state it saves itself with (`s4r.runtime.persist`), so a
    fork is exactly what loading the document's saved file would give, selection state included.
    """
    other = CompressedCache(len(cache.layers), cache.shape)
    with torch.inference_mode():
        for i, layer in enumerate(cache.layers):
            kind = LAYER_KINDS.get(layer.kind)
            if kind is not type(layer):
                raise TypeError(f"cannot fork a cache layer of type {type(layer).__name__}")
            state = {key: value.clone() for key, value in layer.state().items()}
            other.layers[i] = kind.from_state(state, layer.meta_state(), rope=rope)
    return other
