"""The request body of /v1/chat/completions and the bodies the server answers with, as OpenAI writes them.

Responses add two objects of s4r's own: `timings` (llama.cpp's names: `cache_n` tokens from a held
document, `prompt_n` tokens prefilled now, milliseconds and tokens per second of prefill and decode)
and `s4r` (how the document was found, its cache bytes and achieved ratio).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from s4r.serving.engine import Completion


class ChatMessageIn(BaseModel):
    """One message of a request: a role and text content (a string or a list of text parts)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[Any] | None = None


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """A chat completion request; fields s4r does not use are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    # llama.cpp's name for the repetition penalty
    repeat_penalty: float | None = Field(None, gt=0)


FINISH = {"stop": "stop", "length": "length", "loop": "stop", "cancelled": "stop"}


def usage(c: Completion) -> dict[str, Any]:
    """OpenAI's usage object, with the prompt tokens a held document gave."""
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def timings(c: Completion) -> dict[str, Any]:
    """llama.cpp-style timings of the request."""
    return {"cache_n": c.cached_tokens, "prompt_n": c.prefilled_tokens, "prompt_ms": c.prefill_s * 1e3,
            "prompt_per_second": c.prefilled_tokens / c.prefill_s if c.prefill_s > 0 else 0.0,
            "predicted_n": c.completion_tokens, "predicted_ms": c.decode_s * 1e3,
            "predicted_per_second": c.completion_tokens / c.decode_s if c.decode_s > 0 else 0.0}


def s4r_details(c: Completion, method: str) -> dict[str, Any]:
    """How the document part of the prompt was served and what its cache holds."""
    return {"cache": c.cache, "document": c.document, "document_ms": c.document_seconds * 1e3,
            "method": method, "kv_bytes": c.kv_bytes, "kv_full_bytes": c.kv_full_bytes,
            "ratio": c.kv_full_bytes / c.kv_bytes if c.kv_bytes else 0.0, "stop_reason": c.finish_reason}


def completion_body(c: Completion, *, rid: str, created: int, model: str, method: str) -> dict[str, Any]:
    """The body of a non-streamed answer."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": f"s4r-{method}",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": FINISH.get(c.finish_reason, "stop")}],
            "usage": usage(c), "timings": timings(c), "s4r": s4r_details(c, method)}


def chunk_body(*, rid: str, created: int, model: str, delta: dict[str, Any] | None = None,
               finish: Literal["stop", "length"] | None = None, extra: dict[str, Any] | None = None,
               no_choices: bool = False) -> dict[str, Any]:
    """One server-sent chunk of a streamed answer."""
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [] if no_choices else
                            [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]}
    if extra:
        body.update(extra)
    return body
