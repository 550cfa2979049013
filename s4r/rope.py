"""Rotary position embedding helpers: rotate keys to positions and undo it (for pre-RoPE key spaces)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (positions [n]) -> (cos [n, head_dim], sin [n, head_dim]); built from the model's own rotary module so
# every RoPE variant (llama3, yarn, dynamic ...) is handled by transformers itself.
RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The 90-degree rotation RoPE pairs dimension i with i + d/2 by (transformers' convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., n, d] to the positions whose `cos`/`sin` [n, d] are given."""
    return x * cos + rotate_half(x) * sin


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope`, also when cos/sin carry an attention scaling (cos^2 + sin^2 != 1)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def model_rope_fn(model) -> RopeFn | None:
    """A RopeFn from a transformers causal LM's rotary module, or None if it has none."""
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return None
    param = next(model.parameters())

    def rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.empty(0, device=param.device, dtype=param.dtype)
        cos, sin = rotary(dummy, positions.to(param.device).view(1, -1))
        return cos[0], sin[0]

    return rope
