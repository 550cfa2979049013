"""Timing and memory planning of the speed benchmark.

Decode speed is measured by stepping every method's session one token at a time *in the same loop*
(interleaved, in a rotating order), so a machine that slows down or speeds up during the run (other jobs,
turbo clocks, a shared CPU) affects every method alike and the ratios to `full` stay meaningful.

Before a long run the memory it needs is estimated, so a length that cannot fit is refused up front with
its numbers rather than failing (or swapping) an hour later.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from s4r.core.budget import KVShape
from s4r.errors import DeviceError
from s4r.hf.generation import forward_tokens
from s4r.units import gib

__all__ = [
    "DecodeTiming",
    "MemoryPlan",
    "available_bytes",
    "check_lengths_fit",
    "model_bytes",
    "param_count",
    "plan_memory",
    "synchronize",
    "teacher_force",
]

# share of the free memory a run may plan to use: the estimate ignores allocator slack and fragmentation
USABLE_SHARE = 0.9


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so wall-clock timings cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class DecodeTiming:
    """Wall-clock seconds of each timed decode step of one session."""

    seconds: tuple[float, ...]

    @property
    def steps(self) -> int:
        return len(self.seconds)

    @property
    def tok_s(self) -> float:
        """Tokens per second over all timed steps (0 when none)."""
        total = sum(self.seconds)
        return self.steps / total if total > 0 else 0.0

    @property
    def median_ms(self) -> float:
        """Median milliseconds per token: robust to a few steps hit by other processes."""
        return 1000 * statistics.median(self.seconds) if self.seconds else math.nan


def teacher_force(sessions: Sequence[Any], ids: Sequence[int], *, warmup: int,
                  on_logits: Callable[[int, int, torch.Tensor], None] | None = None,
                  on_step: Callable[[int], None] | None = None,
                  failed: dict[int, str] | None = None) -> list[DecodeTiming]:
    """Feed `ids` one token at a time to every session's cache, interleaved; time each step.

    Step i forwards ids[i] through each session (in an order rotated every step, so no method always
    runs right after another), and `on_logits(session_index, i, logits)` sees the next-token logits
    (outside the timed span). Steps before `warmup` are not timed (allocator growth, first-call costs).
    `on_step(i)` is called after each step. Every session must share one model and device; a session's
    `step` attribute, where it has one, picks its decode step (`s4r.hf.lean.STEPS`).

    A session whose forward raises is dropped from the loop and its error recorded in `failed` (by
    index), so one broken method does not stop the others; without `failed` the error propagates.
    """
    if not sessions:
        return []
    model = sessions[0].model
    device = sessions[0].device
    times: list[list[float]] = [[] for _ in sessions]
    n = len(sessions)
    with torch.inference_mode():
        for i, token in enumerate(ids):
            tok = torch.tensor([[int(token)]], dtype=torch.long, device=device)
            for k in range(n):
                j = (i + k) % n
                if failed is not None and j in failed:
                    continue
                cache = sessions[j].cache
                synchronize(device)
                t0 = time.perf_counter()
                try:
                    logits = forward_tokens(model, cache, tok, cache.logical_length(),
                                            step=getattr(sessions[j], "step", None))
                except Exception as exc:  # noqa: BLE001 - reported per session, see above
                    if failed is None:
                        raise
                    failed[j] = f"{type(exc).__name__}: {exc}"
                    continue
                synchronize(device)
                if i >= warmup:
                    times[j].append(time.perf_counter() - t0)
                if on_logits is not None:
                    on_logits(j, i, logits)
            if on_step is not None:
                on_step(i)
    return [DecodeTiming(tuple(t)) for t in times]


# --- memory planning ------------------------------------------------------------------------------------

def param_count(arch: dict[str, Any]) -> int:
    """Parameters of a decoder-only transformer described by a profile's `architecture` table.

    Counts embeddings, attention and gated-MLP projections and norms; biases are ignored (well under 1%).
    """
    hidden, inter = int(arch["hidden_size"]), int(arch["intermediate_size"])
    heads, kv_heads = int(arch["num_attention_heads"]), int(arch["num_key_value_heads"])
    head_dim = int(arch.get("head_dim") or hidden // heads)
    vocab, layers = int(arch["vocab_size"]), int(arch["num_hidden_layers"])
    embed = vocab * hidden * (1 if arch.get("tie_word_embeddings") else 2)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inter
    return embed + layers * (attn + mlp + 2 * hidden) + hidden


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors now: free GPU memory, or the OS's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated peak bytes of one context length of the speed/perplexity phase."""

    tokens: int
    weights: int
    kv: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations


def _staging_capacity(tokens: int) -> int:
    # a staging layer grows by doubling from 256 slots, so it holds the next power of two
    return max(256, 1 << max(tokens - 1, 1).bit_length())


def plan_memory(shape: KVShape, tokens: int, ratios: Sequence[float], *, device: torch.device,
                chunk_size: int = 512, weights: int = 0) -> MemoryPlan:
    """Peak memory of one length: the staged prefill, every fork alive at once, and one prefill chunk.

    `ratios` has one entry per compressed fork (method x ratio); the `full` fork is added here. While a
    fork is compressed its staged copy exists too, hence one more full cache.
    """
    full = shape.full_bytes(tokens)
    staged = shape.full_bytes(_staging_capacity(tokens))
    kv = staged + full + full + sum(int(full / r) for r in ratios)
    # prefill of one chunk: SDPA's fused kernels (CPU flash attention included: 72 MiB measured for a
    # 512 x 32k, 32-head chunk that would take 2 GiB as explicit scores) keep the attention small, so the
    # MLP activations (in fp32, hidden ~ q_heads * head_dim, intermediate ~ 4x) dominate
    chunk = min(chunk_size, tokens)
    mlp = 3 * chunk * 4 * shape.head_dim * shape.q_heads * 4
    # compression of one layer works on fp32 copies of its keys and values (and projections of them)
    layer_fp32 = 6 * tokens * shape.kv_heads * shape.head_dim * 4
    return MemoryPlan(tokens, weights, kv, mlp + layer_fp32)


def check_lengths_fit(shape: KVShape, lengths: Sequence[int], ratios: Sequence[float], *,
                      device: torch.device, chunk_size: int = 512, weights: int = 0,
                      free: int | None = None) -> None:
    """Raise DeviceError naming every length whose estimated peak exceeds the free memory.

    `weights` counts a model not loaded yet (random-weight runs check before building it); `free`
    defaults to what the device has available now.
    """
    free = available_bytes(device) if free is None else free
    budget = USABLE_SHARE * free
    too_big = [plan_memory(shape, n, ratios, device=device, chunk_size=chunk_size, weights=weights)
               for n in lengths]
    too_big = [p for p in too_big if p.total > budget]
    if not too_big:
        return
    worst = max(too_big, key=lambda p: p.total)
    names = ", ".join(f"{p.tokens:,}" for p in too_big)
    parts = f"KV caches {gib(worst.kv)}, activations {gib(worst.activations)}"
    if worst.weights:
        parts = f"weights {gib(worst.weights)}, " + parts
    hint = "pass shorter --lengths, fewer --methods/--ratios"
    if device.type != "cuda":
        hint += ", or run on a GPU (--device cuda)"
    raise DeviceError(
        f"context length(s) {names} cannot fit in memory on {device}: {worst.tokens:,} tokens need about "
        f"{gib(worst.total)} ({parts}) but only {gib(free)} is available; {hint}")
