"""What a session reports about an ingest and a question/answer turn."""

from __future__ import annotations

from dataclasses import dataclass

from s4r.runtime.memory import MemoryReport


@dataclass(frozen=True)
class IngestStats:
    """Timing of one ingest: prefill (model forward) and compression.

    `mode` is how it ran ("layerwise" or "chunked"; a layer-wise ingest compresses during the prefill,
    so its compression time is counted in `prefill_seconds`). `peak_mem_bytes` is the process's
    measured peak after it (see `s4r.runtime.memory.peak_memory_bytes`), not the cache's bytes.
    """

    tokens: int
    seconds: float
    prefill_seconds: float
    compress_seconds: float
    mode: str = "chunked"
    peak_mem_bytes: int = 0
    # document tokens --truncate left out (0 when the document fitted)
    dropped_tokens: int = 0
    # whether a layer-wise ingest kept the hidden states in a temporary file between layers
    hidden_spilled: bool = False

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TurnStats:
    """Figures of one question/answer turn. `peak_mem_bytes` is the process's measured peak (RSS on CPU,
    CUDA allocated on GPU; see `s4r.runtime.memory.peak_memory_bytes`), weights included, not the cache's
    bytes (those are in `memory`)."""

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_mem_bytes: int
    memory: MemoryReport
    interrupted: bool = False
    # why the answer ended: "end" (the model finished), "max_new_tokens", "context" (the context is
    # full), "loop" (the answer repeated itself) or "interrupted"
    stop_reason: str = "end"


def timed_turn(prompt_tokens: int, generated_tokens: int, t0: float, t_first: float | None, t_end: float,
               **figures: object) -> TurnStats:
    """A turn's stats from its clock readings: start, first sampled token (None: none came) and end;
    `figures` are the remaining `TurnStats` fields."""
    ttft = (t_first or t_end) - t0
    decode_s = t_end - (t_first or t_end)
    return TurnStats(
        prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, ttft_s=ttft,
        prefill_tok_s=prompt_tokens / ttft if ttft > 0 else 0.0,
        decode_tok_s=(generated_tokens - 1) / decode_s if decode_s > 0 and generated_tokens > 1 else 0.0,
        **figures)  # type: ignore[arg-type]
