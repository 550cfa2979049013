"""`CompressedCache`: the transformers `Cache` holding one s4r layer per model layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from s4r.core.budget import KVShape
from s4r.layers.full import CacheLayer, FullLayer, StagingLayer


class CompressedCache(Cache):
    """A cache whose layers start uncompressed (prefill staging) and are then compressed by a method.

    Logical length (`get_seq_length`, what positions continue from) and stored length (`get_mask_sizes`)
    are kept apart: compression changes what is stored, never the positions.
    """

    def __init__(self, num_layers: int, shape: KVShape, query_window: int = 32) -> None:
        super().__init__(layers=[StagingLayer(query_window) for _ in range(num_layers)])
        self.shape = shape
        # layer-wise ingest: staging layers still being filled, and the build waiting for them
        self._held: set[int] = set()
        self._pending_build: Callable[[int, StagingLayer], CacheLayer] | None = None
        # the device of each layer where accelerate spread the model's layers (None: one device)
        self.devices: list[torch.device] | None = None

    # --- accounting -------------------------------------------------------------------------------
    def logical_length(self) -> int:
        """Positions seen so far (every layer agrees between forwards)."""
        return self.layers[0].get_seq_length() if self.layers else 0

    def nbytes(self) -> int:
        """Bytes of everything the cache keeps, over all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def full_nbytes(self) -> int:
        """Bytes the uncompressed cache of the same logical length would take (model dtype)."""
        return self.shape.full_bytes(self.logical_length())

    def ratio(self) -> float:
        """Achieved compression ratio: full bytes / stored bytes."""
        stored = self.nbytes()
        return self.full_nbytes() / stored if stored else float("inf")

    def layer_parts(self) -> list[CacheLayer]:
        """Every layer's parts: the segments of a layer holding several documents, else the layer itself."""
        return [p for layer in self.layers for p in getattr(layer, "segments", [layer])]

    def rebuilt_share(self) -> float | None:
        """Share of the stored (compressed) tokens the steps so far rebuilt (or attended in latent space),
        over every layer and step; None before any sparse step."""
        parts = self.layer_parts()
        rebuilt = sum(getattr(p, "rebuilt_tokens", 0) for p in parts)
        scored = sum(getattr(p, "scored_tokens", 0) for p in parts)
        return rebuilt / scored if scored else None

    # --- lifecycle --------------------------------------------------------------------------------
    def is_compressed(self) -> bool:
        """Whether the layers hold a compressed form (anything but full-precision layers)."""
        return not all(isinstance(layer, FullLayer) for layer in self.layers)

    def is_staged(self) -> bool:
        """Whether every layer is still a prefill staging layer (no method has compressed it yet)."""
        return all(type(layer) is StagingLayer for layer in self.layers)

    def compress(self, build: Callable[[int, StagingLayer], CacheLayer]) -> None:
        """Replace every staging layer by `build(layer_idx, staging_layer)`, one layer at a time so the
        peak memory is the full cache plus one compressed layer.

        Layers held by a layer-wise ingest (`hold_layers`) are not complete yet: `build` is kept and
        applied to each of them when it is released.
        """
        for i, layer in enumerate(self.layers):
            if type(layer) is StagingLayer and i not in self._held:
                self.layers[i] = build(i, layer)
        self._pending_build = build if self._held else None

    def prepare_decode(self) -> None:
        """Build ahead what the fused CPU decode step reads of each compressed layer (kept on the layer while
        its storage stays), so a question right after a document does not wait for it."""
        from s4r.kernels.s4r_step import prepare_layers  # numba loads only where a cache asks for it

        prepare_layers(self.layer_parts())

    def hold_layers(self, indices) -> None:
        """Mark staging layers as still being filled, so `compress` waits for `release_layer`."""
        self._held = set(indices)
        if not self._held:
            self._pending_build = None

    def reserve_layer(self, i: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """Size the empty staging layer `i` for `tokens` tokens at once: a layer-wise ingest knows the
        length up front, and growing by doubling would hold up to 1.5x a layer during the last copy."""
        layer = self.layers[i]
        if type(layer) is not StagingLayer or layer.logical:
            return
        if self.devices is not None:
            device = self.devices[i]
        shape = (1, self.shape.kv_heads, tokens, self.shape.head_dim)
        # one update of `tokens` (broadcast zeros, nothing allocated for them) sizes the storage exactly;
        # the length goes back to 0 so the real keys/values fill it from the start
        nothing = torch.zeros((), dtype=dtype, device=device).expand(shape)
        layer.update(nothing, nothing)
        layer.truncate(0)

    def release_layer(self, i: int) -> None:
        """Layer `i` holds its whole text now: compress it if a method's build is waiting for it."""
        self._held.discard(i)
        if self._pending_build is not None and type(self.layers[i]) is StagingLayer:
            self.layers[i] = self._pending_build(i, self.layers[i])
        if not self._held:
            self._pending_build = None

    def copy_staged(self) -> CompressedCache:
        """An independent copy of a staged (uncompressed) cache."""
        other = CompressedCache(len(self.layers), self.shape)
        for i, layer in enumerate(self.layers):
            if type(layer) is not StagingLayer:
                raise TypeError("copy_staged needs an uncompressed cache")
            copy = StagingLayer(layer.query_window)
            if layer.logical:
                copy.update(layer.keys_view.clone(), layer.values_view.clone())
            copy.queries = None if layer.queries is None else layer.queries.clone()
            other.layers[i] = copy
        return other

    def truncate(self, logical: int) -> None:
        """Forget every token at or past position `logical` in every layer."""
        for layer in self.layers:
            layer.truncate(logical)

    def consistent_length(self) -> int:
        """The longest length every layer holds (after an interrupted forward, layers may differ)."""
        return min(layer.get_seq_length() for layer in self.layers)

    def begin_append(self) -> None:
        """Keep the text about to be appended exact in the compressed layers' buffers until
        `s4r.layers.segments.settle_layer` stores it (a long one with bases of its own)."""
        for layer in self.layers:
            if hasattr(layer, "collecting"):
                layer.collecting = True
