"""The server's decoding loop: the rest of a prompt prefilled over a (forked) cache, then an answer token
by token, stopping at an end token, the token limit, a stop string, a loop, or when the caller cancels."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from s4r.distributed.world import agree_token
from s4r.hf.generation import apply_repetition_penalty, forward_tokens, loops, prefill, sample_token

REPEAT_LAST_N = 64
# the token rank 0 sends instead of the next one when its client left (under torchrun)
CANCELLED = -1


@dataclass(frozen=True)
class Sampling:
    """How an answer is drawn: greedy at temperature 0; `repeat_penalty` 1 turns the penalty off."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repeat_penalty: float = 1.0
    loop_guard: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Generated:
    """An answer and its timings. `finish_reason`: "stop" (end token or stop string), "length" (the token
    limit or the context), "loop" or "cancelled"."""

    text: str
    tokens: int
    finish_reason: str
    prefill_s: float
    decode_s: float


def _cut_at_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string starts in `text`, or None."""
    found = [i for s in stop if s and (i := text.find(s)) >= 0]
    return min(found) if found else None


def generate(model, tokenizer, cache, prompt_ids: list[int], *, start: int, stop_ids: set[int],
             sampling: Sampling, chunk_size: int = 512, device: torch.device | str = "cpu",
             on_text: Callable[[str], None] | None = None, on_prefilled: Callable[[], None] | None = None,
             cancelled: Callable[[], bool] = lambda: False) -> Generated:
    """Prefill `prompt_ids` at position `start` of `cache`, then answer; text pieces go to `on_text`.

    Streamed text holds back as many characters as the longest stop string, so a stop string is never
    sent. `on_prefilled` is called once the prompt is in the cache. `cancelled` is asked before every
    token: a true answer stops the answer where it is (under torchrun rank 0's answer counts, and every
    rank takes rank 0's token).
    """
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    hold = max((len(s) for s in sampling.stop), default=1) - 1
    generated: list[int] = []
    sent, text, finish = 0, "", "length"
    t0 = time.perf_counter()
    with torch.inference_mode():
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        logits = prefill(model, cache, ids, start, chunk_size)
        t1 = time.perf_counter()
        if on_prefilled is not None:
            on_prefilled()
        for _ in range(sampling.max_tokens):
            stop_now = cancelled()
            recent = (prompt_ids[-REPEAT_LAST_N:] + generated)[-REPEAT_LAST_N:]
            logits = apply_repetition_penalty(logits.float(), recent, sampling.repeat_penalty)
            token = sample_token(logits, sampling.temperature, sampling.top_p, generator)
            # under torchrun every rank continues (or stops) as rank 0 does, whatever the logits' rounding
            token = agree_token(CANCELLED if stop_now else token)
            if token == CANCELLED:
                finish = "cancelled"
                break
            if token in stop_ids:
                finish = "stop"
                break
            generated.append(token)
            text = tokenizer.decode(generated, skip_special_tokens=True)
            cut = _cut_at_stop(text, sampling.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            # a piece ending inside a multi-byte character waits for the rest of it
            ready = len(text) - hold if not text.endswith("\ufffd") else sent
            if on_text is not None and ready > sent:
                on_text(text[sent:ready])
                sent = ready
            if sampling.loop_guard and loops(generated):
                finish = "loop"
                break
            tok = torch.tensor([[token]], dtype=torch.long, device=device)
            logits = forward_tokens(model, cache, tok, start + len(prompt_ids) + len(generated) - 1)
    if on_text is not None and len(text) > sent:
        on_text(text[sent:])
    t2 = time.perf_counter()
    return Generated(text, len(generated), finish, t1 - t0, t2 - t1)
