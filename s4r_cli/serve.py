"""`s4r serve`: an OpenAI-compatible server keeping many long documents warm as compressed caches.

Same model, method, ratio, device and thread options as `chat` and `ask`; --file and --book documents
are read and held before the server starts. The app is `s4r_cli.server.app`, the serving library under
it `s4r.serving`.

Under torchrun rank 0 serves and the other ranks follow its engine calls (`s4r.serving.lockstep`); rank
0 alone decides when serving ends, and a lost rank ends it with one line.
"""

from __future__ import annotations

import errno
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from s4r.units import memory_size, parse_size
from s4r_cli.checks import check_method, check_model_spec
from s4r_cli.cli_errors import UsageError
from s4r_cli.documents import Document, read_book_documents, read_documents, stdin_bytes
from s4r_cli.options import CommonArgs, common_args, with_options
from s4r_cli.ranks import (
    EXIT_FOLLOWER,
    collectives_checked,
    finish,
    is_main_rank,
    launched,
    on_main,
    start_ranks,
)
from s4r_cli.session_setup import check_ratio_reachable, open_model
from s4r_cli.ui import UI

_SERVER = "Server"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# under torchrun: how often idle followers hear from rank 0 (at most a quarter of S4R_DIST_TIMEOUT)
KEEPALIVE_S = 5.0
WATCH_S = 0.25


def serve(
    ctx: typer.Context,
    args: CommonArgs,
    host: Annotated[str, typer.Option("--host", rich_help_panel=_SERVER,
                                      help="Address to listen on; 0.0.0.0 makes the server reachable from "
                                           "other machines (set --api-key then).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", rich_help_panel=_SERVER, min=1, max=65535)] = 8080,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="S4R_API_KEY", rich_help_panel=_SERVER, show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route but /health (or set S4R_API_KEY).")] = None,
    memory_budget: Annotated[str, typer.Option(
        "--memory-budget", rich_help_panel=_SERVER,
        help="Stored bytes of document caches kept in memory (512M, 2G, ...); the least recently used "
             "leave first.")] = "2G",
    cache_dir: Annotated[Path | None, typer.Option(
        "--cache-dir", rich_help_panel=_SERVER, show_default=False,
        help="Folder every document cache is saved in, loaded back from when it left memory, and found "
             "again after a restart. Without it a document that leaves memory is forgotten.")] = None,
    min_document_tokens: Annotated[int, typer.Option(
        "--min-document-tokens", rich_help_panel=_SERVER, min=1,
        help="A first user message (or system prompt) at least this long is held as a document.")] = 256,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", rich_help_panel=_SERVER, min=1,
        help="Requests running or waiting for the model; more get 503.")] = 8,
    max_tokens_limit: Annotated[int, typer.Option(
        "--max-tokens-limit", rich_help_panel=_SERVER, min=1,
        help="Most tokens a request may ask for (--max-new-tokens is the default).")] = 4096,
    max_request_bytes: Annotated[str, typer.Option(
        "--max-request-bytes", rich_help_panel=_SERVER, help="Largest request body; more get 413.")] = "16M",
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", rich_help_panel=_SERVER, show_default=False,
        help="The model id clients send (default: the model's name, see /v1/models).")] = None,
) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/models, /health, /metrics).

    A request starting with a long document the server holds reuses its cache and prefills the rest.

    A new long document (first user message or system prompt) is read once and kept; --file, --book preload.

    Requests are answered one at a time, in order.
    """
    args = common_args(ctx, args)
    if args.load:
        raise UsageError("serve keeps its document caches in --cache-dir; --load is for chat and ask")
    budget = _size(memory_budget, "--memory-budget")
    body_limit = _size(max_request_bytes, "--max-request-bytes")

    def validated() -> list[Document]:
        docs = read_documents(args.files, stdin=stdin_bytes()) + read_book_documents(args.books)
        check_model_spec(args.model)
        check_method(args.method)
        check_port(host, port)
        return docs

    start_ranks(args.device)
    try:
        with collectives_checked():
            docs = on_main(validated)  # under torchrun only rank 0 reads the input and takes the port
            run_server(args, docs, host=host, port=port, api_key=api_key, budget=budget, cache_dir=cache_dir,
                       min_document_tokens=min_document_tokens, max_queue=max_queue,
                       max_tokens_limit=max_tokens_limit, body_limit=body_limit, model_id=served_model_name)
    finally:
        finish()


def _size(text: str, option: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def check_port(host: str, port: int) -> None:
    """Refuse a port that is taken (or an address this machine does not have) before loading the model."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise UsageError(f"port {port} on {host} is in use; pass --port" if taken
                             else f"cannot listen on {host}:{port}: {exc.strerror}") from None


def run_server(args: CommonArgs, docs: list[Document], *, host: str, port: int, api_key: str | None,
               budget: int, cache_dir: Path | None, min_document_tokens: int, max_queue: int,
               max_tokens_limit: int, body_limit: int, model_id: str | None) -> None:
    """Load the model, hold the documents, then serve until Ctrl-C or SIGTERM (a follower rank under
    torchrun follows rank 0's engine calls instead)."""
    from s4r.serving.document_store import DocumentStore
    from s4r.serving.engine import Engine
    from s4r.serving.generate import Sampling
    from s4r_cli.server.app import ServerConfig

    ui = UI.for_ask()
    loaded = open_model(args, ui)
    check_ratio_reachable(args, loaded)
    kwargs: dict[str, Any] = {k: v for k, v in args.session_kwargs().items() if k != "system"}
    store = DocumentStore(loaded, budget_bytes=budget, cache_dir=cache_dir, session_kwargs=kwargs,
                          log=lambda line: _say(line))
    engine = Engine(loaded, store, default_system=args.system, max_tokens=args.max_new_tokens,
                    min_document_tokens=min_document_tokens)
    if not is_main_rank():
        _follow(engine)
        return
    with followers_released(engine):
        if store.documents():
            _say(f"found {len(store.documents())} saved documents in {store.folder}")
        for doc in docs:
            held, new = engine.preload(doc.text, doc.name)
            how = "read" if new else "already held"
            _say(f"{doc.name}: {how}, {held.tokens:,} tokens in {memory_size(held.stored_bytes)} "
                 f"(x{held.full_bytes / max(held.stored_bytes, 1):.2f})")
        g = args.generation
        config = ServerConfig(model_id=model_id or str(loaded.name), method=args.method, ratio=args.ratio,
                              api_key=api_key, max_request_bytes=body_limit, max_queue=max_queue,
                              max_tokens_limit=max_tokens_limit,
                              defaults=Sampling(g.max_new_tokens, g.temperature, g.top_p, g.seed,
                                                g.repeat_penalty, g.loop_guard))
        if host not in LOOPBACK and api_key is None:
            _say(f"warning: listening on {host} without --api-key: anyone who can reach it can use it")
        shown = f"[{host}]" if ":" in host else host
        _say(f"serving {config.model_id} ({args.method}, ratio {args.ratio:g}) on http://{shown}:{port}/v1; "
             f"memory budget {memory_size(budget)}" + (f", caches in {cache_dir}" if cache_dir else ""))
        serve_http(engine, config, host, port)


def _follow(engine: Any) -> None:
    """A follower rank: make rank 0's engine calls until it ends serving. Rank 0 alone decides when
    that is (Ctrl-C and SIGTERM reach every rank of a launch), so they do not stop a follower."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not engine.follow():
        raise SystemExit(EXIT_FOLLOWER)


@contextmanager
def followers_released(engine: Any) -> Iterator[None]:
    """On rank 0: however serving ends, end the followers' `follow` too (as a good end for Ctrl-C)."""
    try:
        yield
    except KeyboardInterrupt:
        engine.release_followers(ok=True)
        raise
    except BaseException:
        engine.release_followers(ok=False)
        raise
    engine.release_followers(ok=True)


def serve_http(engine: Any, config: Any, host: str, port: int) -> None:
    """Run the app until Ctrl-C, SIGTERM (both after a graceful shutdown) or, under torchrun, a lost rank
    (then its RankError is raised)."""
    import uvicorn

    from s4r_cli.server.app import create_app

    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    done = threading.Event()
    if launched():
        threading.Thread(target=_watch_ranks, args=(engine, app.state.worker, server, done), daemon=True,
                         name="s4r-ranks").start()
    # uvicorn shuts down gracefully on SIGTERM, then raises it again: a no-op then lets s4r end with 0
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        done.set()
        app.state.worker.join()  # the followers' next word must come after the last request's
        signal.signal(signal.SIGTERM, previous)
    if engine.failed is not None:
        raise engine.failed


def _watch_ranks(engine: Any, worker: Any, server: Any, done: threading.Event) -> None:
    """Under torchrun: a keep-alive to idle followers now and then (their wait for the next call stays
    within the process group's timeout), and the end of the server once a rank is lost."""
    from s4r.distributed.world import timeout_s

    every = min(KEEPALIVE_S, timeout_s() / 4)
    last = time.monotonic()
    while not done.wait(WATCH_S):
        if engine.failed is not None:
            server.should_exit = True
            return
        if time.monotonic() - last >= every:
            worker.chore(engine.keepalive)
            last = time.monotonic()


def _say(line: str) -> None:
    sys.stderr.write(f"s4r: {line}\n")
    sys.stderr.flush()


def register(app: typer.Typer) -> None:
    """Add `serve` to the app."""
    app.command()(with_options(serve))
