"""`S4RCache`: the transformers `Cache` holding one s4r layer per model layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from .budget import KVShape
from .layers import FullLayer, S4RLayerBase


class S4RCache(Cache):
    """A cache whose layers start uncompressed (prefill staging) and are then compressed by a method.

    Logical length (`get_seq_length`, what positions continue from) and stored length (`get_mask_sizes`)
    are kept apart: compression changes what is stored, never the positions.
    """

    def __init__(self, num_layers: int, shape: KVShape, query_window: int = 32) -> None:
        super().__init__(layers=[FullLayer(query_window) for _ in range(num_layers)])
        self.shape = shape

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

    # --- lifecycle --------------------------------------------------------------------------------
    def is_compressed(self) -> bool:
        """Whether the layers hold a compressed form (anything but the staging layers)."""
        return not all(type(layer) is FullLayer for layer in self.layers)

    def compress(self, build: Callable[[int, FullLayer], S4RLayerBase]) -> None:
        """Replace every staging layer by `build(layer_idx, staging_layer)`, one layer at a time so the
        peak memory is the full cache plus one compressed layer."""
        for i, layer in enumerate(self.layers):
            if type(layer) is FullLayer:
                self.layers[i] = build(i, layer)

    def copy_staged(self) -> S4RCache:
        """An independent copy of a staged (uncompressed) cache."""
        other = S4RCache(len(self.layers), self.shape)
        for i, layer in enumerate(self.layers):
            if type(layer) is not FullLayer:
                raise TypeError("copy_staged needs an uncompressed cache")
            copy = FullLayer(layer.query_window)
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

    def compact(self) -> None:
        """Fold oversized buffers into coefficients (after appending a long text)."""
        for layer in self.layers:
            if hasattr(layer, "compact"):
                layer.compact()


def staged_tensors(layer: FullLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(keys [H,T,d], values [H,T,d], queries [Hq,W,d] or None) of a staging layer, batch 1."""
    q = layer.queries[0] if layer.queries is not None else None
    return layer.keys_view[0], layer.values_view[0], q
