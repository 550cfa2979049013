"""`create_app`: the FastAPI app of `s4r serve` over one `s4r.serving.engine.Engine`.

Routes: POST /v1/chat/completions (streamed as server-sent events ending in `data: [DONE]`, or one JSON
body), GET /v1/models and /v1/models/{id}, GET /health, GET /metrics. With an API key, every route but
/health needs `Authorization: Bearer KEY`. Every failure is an OpenAI-style JSON error (`errors`).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from s4r.errors import ContextTooLongError, RankError, S4RError, first_line
from s4r.serving.engine import Completion, Engine
from s4r.serving.generate import Sampling
from s4r.serving.prompt import Message, PromptError, RenderedPrompt, message_text
from s4r_cli.server.errors import ApiError, status_error
from s4r_cli.server.metrics import render_metrics
from s4r_cli.server.schemas import ChatRequest, chunk_body, completion_body, s4r_details, timings, usage
from s4r_cli.server.worker import ModelWorker, RequestRun

log = logging.getLogger("s4r.serve")


@dataclass(frozen=True)
class ServerConfig:
    """What the app serves and its limits. `defaults` are the sampling settings a request leaves out;
    a request may ask for at most `max_tokens_limit` tokens."""

    model_id: str
    method: str
    ratio: float
    api_key: str | None = None
    max_request_bytes: int = 16 * 2**20
    max_queue: int = 8
    max_tokens_limit: int = 4096
    defaults: Sampling = Sampling()


def _sse(body: dict[str, Any] | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes, whether or not a Content-Length says so."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared):,} bytes; this server takes at most "
                       f"{limit:,}")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise ApiError(413, f"the request body is over this server's limit of {limit:,} bytes")
    return bytes(data)


def parse_request(data: bytes) -> ChatRequest:
    """A ChatRequest from a JSON body (400 with the first problem otherwise)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({first_line(exc)})") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return ChatRequest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or None
        raise ApiError(400, f"{where}: {err.get('msg')}" if where else str(err.get("msg")), param=where,
                       code="invalid_value") from None


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The app; its model worker stops with it (see `s4r_cli.server.worker`)."""
    worker = ModelWorker(config.max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.shutdown()

    app = FastAPI(title="s4r", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    http: Counter[tuple[str, int]] = Counter()
    created = int(time.time())
    app.state.worker = worker

    @app.middleware("http")
    async def count(request: Request, call_next):  # noqa: ANN001, ANN202 - Starlette's middleware shape
        response = await call_next(request)
        http[(request.url.path if response.status_code != 404 else "other", response.status_code)] += 1
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return status_error(exc.status_code, exc.detail).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(exc).__name__, first_line(exc))
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # constant time: how much of a guess was right does not show in how long the answer takes
        right = hmac.compare_digest(token.strip().encode(), config.api_key.encode())
        if scheme.lower() != "bearer" or not right:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'" if given else
                           "this server needs an API key: send 'Authorization: Bearer KEY'",
                           headers={"WWW-Authenticate": "Bearer"})

    def model_card() -> dict[str, Any]:
        return {"id": config.model_id, "object": "model", "created": created, "owned_by": "s4r",
                "meta": {"method": config.method, "ratio": config.ratio,
                         "context_length": engine.context_length}}

    @app.get("/health")
    async def health() -> Response:
        if engine.failed is not None:  # a rank was lost (torchrun): the server is ending
            return _api_error(engine.failed).response()
        return JSONResponse({"status": "ok", "model": config.model_id, "queued": worker.pending})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        if model_id != config.model_id:
            raise _unknown_model(model_id, config)
        return model_card()

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        authorize(request)
        counters, store = engine.snapshot()
        info = {"model": config.model_id, "method": config.method, "ratio": config.ratio}
        text = render_metrics(counters, store, http, worker.pending, info)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = parse_request(await read_body(request, config.max_request_bytes))
        if req.model != config.model_id:
            raise _unknown_model(req.model, config)
        prompt, sampling = _prepare(req, engine, config)
        if worker.full():
            raise ApiError(503, f"the server is busy ({worker.pending} requests queued); try again shortly",
                           headers={"Retry-After": "1"})
        run = worker.start(lambda r: _work(engine, prompt, sampling, r, req.stream))
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        first = await run.next_event(request)
        if first[0] == "error":
            raise _api_error(first[1])
        if first[0] == "disconnected":
            return Response(status_code=499)
        if not req.stream:
            assert first[0] == "done"
            return JSONResponse(completion_body(first[1], rid=rid, created=now, model=config.model_id,
                                                method=config.method))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(run, request, rid, now, config, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _unknown_model(name: str, config: ServerConfig) -> ApiError:
    return ApiError(404, f"the model '{name}' does not exist; this server has '{config.model_id}'",
                    code="model_not_found", param="model")


def _prepare(req: ChatRequest, engine: Engine, config: ServerConfig) -> tuple[RenderedPrompt, Sampling]:
    """The request's prompt and sampling settings, or a 400 saying what is wrong."""
    if req.n != 1:
        raise ApiError(400, "n must be 1: this server answers one choice per request", param="n")
    try:
        messages = [Message(m.role, message_text(m.content)) for m in req.messages]
        prompt = engine.render(messages)
    except PromptError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    d = config.defaults
    max_tokens = req.max_completion_tokens or req.max_tokens or d.max_tokens
    if max_tokens > config.max_tokens_limit:
        raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of "
                       f"{config.max_tokens_limit}", param="max_tokens")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4:
        raise ApiError(400, "at most 4 stop strings", param="stop")
    sampling = Sampling(
        max_tokens=max_tokens, temperature=d.temperature if req.temperature is None else req.temperature,
        top_p=d.top_p if req.top_p is None else req.top_p, seed=d.seed if req.seed is None else req.seed,
        repeat_penalty=d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
        loop_guard=d.loop_guard, stop=tuple(s for s in stop if s))
    return prompt, sampling


def _work(engine: Engine, prompt: RenderedPrompt, sampling: Sampling, run: RequestRun, stream: bool) -> None:
    """The worker's part of a request: answer, streaming text pieces as events when asked to."""
    completion = engine.complete(
        prompt, sampling, cancelled=run.cancel.is_set,
        on_text=(lambda piece: run.emit("text", piece)) if stream else None,
        on_prefilled=(lambda: run.emit("prefilled")) if stream else None)
    run.emit("done", completion)


def _api_error(exc: BaseException) -> ApiError:
    """The status and body a failure of the worker gets."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextTooLongError):
        return ApiError(413, f"the prompt is {exc.tokens:,} tokens with the answer's first token; the "
                        f"model's context is {exc.limit:,}", code="context_length_exceeded", param="messages")
    if isinstance(exc, PromptError):
        return ApiError(400, str(exc), param="messages")
    if isinstance(exc, RankError):  # under torchrun: the model cannot run without every rank
        return ApiError(503, f"the server cannot answer: {first_line(exc)}", code="rank_lost")
    if isinstance(exc, S4RError):
        return ApiError(500, first_line(exc), code="s4r_error")
    log.error("internal error in the model worker: %s: %s", type(exc).__name__, first_line(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}")


async def _stream(run: RequestRun, request: Request, rid: str, created: int, config: ServerConfig,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent chunks: the role, the text pieces, the finish (with timings), the usage, [DONE].

    A client that leaves cancels the run: Starlette stops this generator, and `finally` tells the worker.
    """
    model = config.model_id
    try:
        role = {"role": "assistant", "content": ""}
        yield _sse(chunk_body(rid=rid, created=created, model=model, delta=role))
        while True:
            kind, value = await run.next_event(request)
            if kind == "text":
                yield _sse(chunk_body(rid=rid, created=created, model=model, delta={"content": value}))
            elif kind == "done":
                c: Completion = value
                finish = "length" if c.finish_reason == "length" else "stop"
                yield _sse(chunk_body(rid=rid, created=created, model=model, finish=finish,
                                      extra={"timings": timings(c), "s4r": s4r_details(c, config.method)}))
                if include_usage:
                    yield _sse(chunk_body(rid=rid, created=created, model=model, no_choices=True,
                                          extra={"usage": usage(c)}))
                break
            elif kind == "error":
                yield _sse(_api_error(value).body())
                break
            elif kind == "disconnected":
                return
        yield _sse("[DONE]")
    finally:
        run.cancel.set()
