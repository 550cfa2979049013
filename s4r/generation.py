"""Small pure steps of generation with explicit positions: forward a chunk, sample a token."""

from __future__ import annotations

from collections.abc import Callable

import torch


def forward_tokens(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Run `ids` [1, q] at positions start..start+q-1 through the model; logits [vocab] of the last one.

    Only the last position's logits are materialized (`logits_to_keep=1`), whatever the chunk size.
    """
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def prefill(model, cache, ids: torch.Tensor, start: int, chunk_size: int,
            progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Forward a long `ids` [n] in chunks of `chunk_size` (bounded activation memory); last logits."""
    total = ids.shape[0]
    logits = None
    for begin in range(0, total, chunk_size):
        chunk = ids[begin : begin + chunk_size].unsqueeze(0)
        logits = forward_tokens(model, cache, chunk, start + begin)
        if progress is not None:
            progress(min(begin + chunk_size, total), total)
    if logits is None:
        raise ValueError("nothing to prefill")
    return logits


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
