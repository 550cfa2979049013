"""Capacity-grown tensors: stores that take new tokens without copying what they hold on every append."""

from __future__ import annotations

import torch

# spare token slots when a store grows: the larger of this and 1/16 of what it holds
MIN_SPARE = 64


def grown(t: torch.Tensor, dim: int, used: int, need: int) -> torch.Tensor:
    """`t` if its `dim` holds `need` slots, else a larger copy (first `used` slots kept, spare added).

    Also copies a tensor made under inference mode when written outside it (e.g. `generate` after a
    compression in `inference_mode`), which torch forbids updating in place."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        t = t.clone()
    if t.shape[dim] >= need:
        return t
    shape = list(t.shape)
    shape[dim] = need + max(MIN_SPARE, need // 16)
    bigger = t.new_empty(shape)
    bigger.narrow(dim, 0, used).copy_(t.narrow(dim, 0, used))
    return bigger


def cloned(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of `t` (None stays None)."""
    return None if t is None else t.clone()


def contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` laid out contiguously (None stays None)."""
    return None if t is None else t.contiguous()
