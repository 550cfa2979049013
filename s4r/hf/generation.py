"""Small pure steps of generation with explicit positions: forward a chunk, sample a token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from s4r.hf.attention import drop_handoff, ensure_handoff_taken
from s4r.hf.lean import lean_step


def forward_tokens(model, cache, ids: torch.Tensor, start: int, step: str | None = None) -> torch.Tensor:
    """Run `ids` [1, q] at positions start..start+q-1 through the model; logits [vocab] of the last one.

    Only the last position's logits are materialized (`logits_to_keep=1`), whatever the chunk size.
    A one-token step runs the model's lean step where it has one (`s4r.hf.lean`), else its own forward;
    `step` (one of `s4r.hf.lean.STEPS`) overrides the model's choice.
    """
    lean = lean_step(model, step) if ids.shape[1] == 1 else None
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    try:
        if lean is not None:
            logits = lean(cache, ids, start)
            ensure_handoff_taken()
            return logits
        out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    except BaseException:
        drop_handoff()  # stopped between a cache update and its attention: nothing was missed
        raise
    ensure_handoff_taken()  # the last layer's attention ran through s4r attention too
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


def apply_repetition_penalty(logits: torch.Tensor, recent_ids: list[int], penalty: float) -> torch.Tensor:
    """Make tokens seen in ``recent_ids`` less likely, as llama.cpp and transformers do.

    A positive logit is divided by ``penalty`` and a negative one multiplied, so the token loses
    probability either way; each distinct token is penalized once. ``penalty`` 1 returns ``logits`` as is.
    """
    if penalty == 1.0 or not recent_ids:
        return logits
    ids = torch.tensor(sorted(set(recent_ids)), dtype=torch.long, device=logits.device)
    picked = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


# A loop is a block of tokens repeated back to back at the end of the answer: at least LOOP_MIN_REPEATS
# times, covering at least LOOP_MIN_TOKENS, so a legitimately repeated word or short list is left alone.
LOOP_MIN_REPEATS = 2
LOOP_MIN_TOKENS = 48
LOOP_MAX_PERIOD = 200


def repeating_period(ids: list[int], *, min_tokens: int = LOOP_MIN_TOKENS,
                     min_repeats: int = LOOP_MIN_REPEATS, max_period: int = LOOP_MAX_PERIOD) -> int:
    """The length of the block the end of ``ids`` repeats back to back, or 0 when it does not loop.

    "A B C A B C" ends in a loop of period 3 once the repeated run spans ``min_tokens`` tokens and the
    block occurs ``min_repeats`` times. Short periods need more repeats to cover ``min_tokens``.
    """
    n = len(ids)
    for period in range(1, min(max_period, n // min_repeats) + 1):
        repeats = max(min_repeats, -(-min_tokens // period))
        span = period * repeats
        if span > n:
            continue
        tail = ids[n - span :]
        if tail[period:] == tail[:-period]:  # shifting by one period changes nothing: periodic
            return period
    return 0


# Near-loops vary a word now and then ("are both examples" / "is another example"), so a periodic check
# misses them; a long span said again, or a shorter one said a third time, is the same loop.
LOOP_LONG_SPAN = 16
LOOP_SHORT_SPAN = 8


def _occurrences(ids: list[int], span: list[int], end: int) -> int:
    """How many times ``span`` occurs in ``ids[:end]``."""
    n, first, count = len(span), span[0], 0
    for i in range(end - n + 1):
        if ids[i] == first and ids[i : i + n] == span:
            count += 1
    return count


def loops(ids: list[int]) -> bool:
    """Does the end of an answer repeat itself: a block repeated back to back (:func:`repeating_period`),
    its last LOOP_LONG_SPAN tokens said before, or its last LOOP_SHORT_SPAN tokens said twice before?"""
    if repeating_period(ids):
        return True
    n = len(ids)  # each count below includes the tail itself
    if n >= 2 * LOOP_LONG_SPAN and _occurrences(ids, ids[n - LOOP_LONG_SPAN :], n) >= 2:
        return True
    return n >= 3 * LOOP_SHORT_SPAN and _occurrences(ids, ids[n - LOOP_SHORT_SPAN :], n) >= 3
