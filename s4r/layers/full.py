"""Per-layer cache storage: full precision (reference and prefill staging); S4R low-rank in lowrank.py.

Each layer keeps its logical length (positions the model has seen) apart from what it stores, and
reports `nbytes()` of everything it keeps.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.cache_utils import CacheLayerMixin

from s4r.hf.attention import KEY_BUCKET, causal_attention, handoff
from s4r.kernels import exact_attention, jit
from s4r.kernels.scratch import thread_scratch


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Sum of the sizes of the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class CacheLayer(CacheLayerMixin):
    """What every s4r cache layer shares: lengths, bytes, and the attention hand-off."""

    is_sliding = False
    is_croppable = True
    # whether plain attention over the keys `update` returns is this layer's own attention (all its keys,
    # exact): only then may `s4r_attention` fall back to it when the hand-off misses
    exact_fallback = False

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = True
        self.logical = 0

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is built eagerly
        self.is_initialized = True

    def get_seq_length(self) -> int:
        """Logical length: the positions seen so far (what position ids continue from)."""
        return self.logical

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Stored length plus the query (what a dense mask would span)."""
        return self.stored_length() + query_length, 0

    def stored_length(self) -> int:
        """Tokens held in any form (sinks, coefficients, buffer)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of every tensor the layer keeps."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """Attention output [B, Hq, q, d] of `query` over this layer's context."""
        raise NotImplementedError

    def truncate(self, logical: int) -> None:
        """Forget every token at or past position `logical`."""
        raise NotImplementedError

    # --- persistence (as mlx-lm's caches: `s4r.runtime.persist` writes whatever layers a cache holds) ---
    # the name a saved file gives this kind of layer
    kind: ClassVar[str] = ""

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors `from_state` rebuilds this layer from (parts the layer does not have are left out)."""
        raise NotImplementedError

    def meta_state(self) -> dict[str, Any]:
        """The JSON-able settings and counts `from_state` needs besides the tensors."""
        return {}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], meta: dict[str, Any], *, rope=None) -> CacheLayer:
        """The layer `state()` and `meta_state()` describe (`rope`: the model's rotary embedding)."""
        raise NotImplementedError

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: a negative count removes that many tokens, a positive one is a length."""
        self.truncate(self.logical + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove)


class FullLayer(CacheLayer):
    """Uncompressed keys/values (post-RoPE), grown in amortized steps instead of a copy per token: the
    `full` method's layer, and the base of the prefill's `StagingLayer`."""

    exact_fallback = True

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._handed: torch.Tensor | None = None  # the keys the last update returned
        self._finite = 0  # rows of the buffers known to hold finite values (tokens, kept or forgotten)

    @classmethod
    def from_staged(cls, layer: FullLayer) -> FullLayer:
        """The same keys and values as `layer` (its storage, not a copy), without its recorded queries."""
        full = cls()
        full._k, full._v, full.logical, full._finite = layer._k, layer._v, layer.logical, layer._finite
        return full

    @property
    def keys_view(self) -> torch.Tensor:
        return self._k[:, :, : self.logical]

    @property
    def values_view(self) -> torch.Tensor:
        return self._v[:, :, : self.logical]

    def update(self, key_states, value_states, *args, **kwargs):
        n, q = self.logical, key_states.shape[-2]
        if self._k is None or n + q > self._k.shape[-2]:
            cap = max(n + q, 2 * (0 if self._k is None else self._k.shape[-2]), 256)
            shape = (*key_states.shape[:2], cap, key_states.shape[-1])
            k = key_states.new_empty(shape)
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if n:
                k[:, :, :n] = self._k[:, :, :n]
                v[:, :, :n] = self._v[:, :, :n]
            self._k, self._v = k, v
            self._finite = n  # the new buffer's spare rows are uninitialized
        self._k[:, :, n : n + q] = key_states
        self._v[:, :, n : n + q] = value_states
        self.logical = n + q
        self._finite = max(self._finite, n + q)
        keys = self._handed = self.keys_view
        handoff(self, keys)  # the attention function gets no handle on the cache: name this layer to it
        return keys, self.values_view

    def attend(self, query, key, value, scaling):
        if key is self._handed and exact_attention.fusable(query, key):
            try:
                return exact_attention.fused_decode_attention(query, key, value, scaling, thread_scratch(0))
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here: the eager path
                jit.mark_failed(exc)
        return causal_attention(query, key, value, scaling, room=self._room(key))

    def _room(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers from the front of `key` (the keys this layer handed over, else None) up to the
        next KEY_BUCKET boundary within their capacity, every row finite: spare rows are zeroed the first
        time a bucket reaches them (zeroing the whole capacity would make it all resident memory)."""
        if key is not self._handed:
            return None
        width = min(self._k.shape[-2], -(-key.shape[-2] // KEY_BUCKET) * KEY_BUCKET)
        if width > self._finite:
            self._k[:, :, self._finite : width].zero_()
            self._v[:, :, self._finite : width].zero_()
            self._finite = width
        return self._k[:, :, :width], self._v[:, :, :width]

    def stored_length(self) -> int:
        return self.logical

    def nbytes(self) -> int:
        """Bytes of the stored tokens (growth slack is allocator headroom, not cache content)."""
        if self._k is None:
            return 0
        return tensor_bytes(self.keys_view, self.values_view)

    def truncate(self, logical: int) -> None:
        self.logical = max(0, min(self.logical, logical))

    kind = "full"

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self._k is None else {"k": self.keys_view, "v": self.values_view}

    @classmethod
    def from_state(cls, state, meta, *, rope=None) -> FullLayer:
        layer = cls(**meta)
        if "k" in state:
            layer._k, layer._v, layer.logical = state["k"], state["v"], state["k"].shape[-2]
            layer._finite = layer.logical
        return layer


class StagingLayer(FullLayer):
    """The prefill's uncompressed layer, which a method then compresses.

    While `query_window` > 0 it also keeps the last queries, which S4R and SnapKV need at compression.
    """

    def __init__(self, query_window: int = 0) -> None:
        super().__init__()
        self.query_window = query_window
        self.queries: torch.Tensor | None = None

    @property
    def exact_fallback(self) -> bool:
        """Plain attention is exact, but only this layer's own attention records the queries."""
        return not self.query_window

    def attend(self, query, key, value, scaling):
        if self.query_window:
            recent = query if self.queries is None else torch.cat([self.queries, query], dim=2)
            self.queries = recent[:, :, -self.query_window :].clone()
        return causal_attention(query, key, value, scaling)

    def truncate(self, logical: int) -> None:
        if self.queries is not None and logical < self.logical:
            # the recorded queries are those of the last tokens: drop the forgotten tokens' ones
            keep = self.queries.shape[2] - (self.logical - max(0, logical))
            self.queries = self.queries[:, :, :keep].clone() if keep > 0 else None
        super().truncate(logical)

    kind = "staging"

    def state(self) -> dict[str, torch.Tensor]:
        return super().state() | ({} if self.queries is None else {"queries": self.queries})

    def meta_state(self) -> dict[str, Any]:
        return {"query_window": self.query_window}

    @classmethod
    def from_state(cls, state, meta, *, rope=None) -> StagingLayer:
        layer = super().from_state(state, meta)
        layer.queries = state.get("queries")
        return layer


def to_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[H, n, d] per-head vectors -> [G, n, width]: per head (G=H) or heads concatenated (G=1)."""
    if groups == x.shape[0]:
        return x
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2])


def staged_tensors(layer: StagingLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(keys [H,T,d], values [H,T,d], queries [Hq,W,d] or None) of a staging layer, batch 1."""
    q = layer.queries[0] if layer.queries is not None else None
    return layer.keys_view[0], layer.values_view[0], q


__all__ = ["CacheLayer", "FullLayer", "StagingLayer", "staged_tensors",
           "tensor_bytes", "to_groups"]
