"""Buffers the fused decode step reuses: named, per thread and per segment position, shared by the layers
of a step (the buffers the previous layer just used are still in cache), regrown when a shape outgrows
them."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from s4r.kernels.jit import as_numpy


class Scratch:
    """Named buffers (of one segment position), reused from layer to layer and regrown when a shape
    outgrows them; each name keeps the views of its last few shapes, so the shapes a step alternates
    between cost nothing."""

    # views kept per name: a prompt's layers select a dozen different token counts (a name asked at a new
    # shape every step keeps only its latest)
    SHAPES = 16

    def __init__(self) -> None:
        self._bufs: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # name: (flat tensor, its numpy view)
        self._views: dict[str, dict[tuple, tuple[torch.Tensor, np.ndarray]]] = {}
        self._arrays: dict[str, dict[tuple, np.ndarray]] = {}

    def _flat(self, name: str, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        """The buffer `name`, regrown (its views forgotten) where it holds fewer than `size` of dtype."""
        held = self._bufs.get(name)
        if held is None or held[0].numel() < size or held[0].dtype != dtype:
            # a normal tensor, also when asked under inference_mode: torch writes into some views of it
            # (`out=`), which it refuses outside inference_mode for a tensor or view made inside it
            with torch.inference_mode(False):
                buf = torch.zeros(max(size, 1) + size // 8, dtype=dtype)
            held = self._bufs[name] = (buf, as_numpy(buf))
            self._views.pop(name, None)
            self._arrays.pop(name, None)
        return held

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        """The buffer `name` as a tensor of `shape` and its numpy view (bf16 as its bits; contents left
        from earlier steps)."""
        views = self._views.get(name)
        hit = None if views is None else views.get((shape, dtype))
        if hit is not None:
            return hit
        size = math.prod(shape)
        buf, flat = self._flat(name, size, dtype)
        views = self._views.setdefault(name, {})
        if len(views) >= self.SHAPES:
            views.clear()
        with torch.inference_mode(False):
            view = buf[:size].view(shape)
        hit = views[(shape, dtype)] = (view, flat[:size].reshape(shape))
        return hit

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`view`'s tensor."""
        return self.view(name, shape, dtype)[0]

    def np(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> np.ndarray:
        """`view`'s numpy array, made without a tensor view: the selected tokens' count changes the shapes
        of some buffers from layer to layer, and a numpy view costs a small share of a tensor's."""
        arrays = self._arrays.get(name)
        hit = None if arrays is None else arrays.get((shape, dtype))
        if hit is not None:
            return hit
        size = math.prod(shape)
        flat = self._flat(name, size, dtype)[1]
        arrays = self._arrays.setdefault(name, {})
        if len(arrays) >= self.SHAPES:
            arrays.clear()
        hit = arrays[(shape, dtype)] = flat[:size].reshape(shape)
        return hit


_pool = threading.local()


def thread_scratch(position: int) -> Scratch:
    """The scratch of the `position`th segment of a step, one per thread shared by every layer: a step's
    layers run one after another, and buffers the previous layer just used are still in cache where a
    buffer of each layer's own (30 of them on the default model) is not."""
    scratches = getattr(_pool, "scratches", None)
    if scratches is None:
        scratches = _pool.scratches = []
    while len(scratches) <= position:
        scratches.append(Scratch())
    return scratches[position]
