"""`s4r serve`: an OpenAI-compatible server keeping many long documents warm as compressed caches.

Same model, method, ratio, device and thread options as `chat` and `ask`; --file and --book documents
are read and held before the server starts. The app is `s4r_cli.server.app`, the serving library under
it `s4r.serving`.
"""

from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from s4r.units import memory_size, parse_size
from s4r_cli.checks import check_method, check_model_spec
from s4r_cli.cli_errors import UsageError
from s4r_cli.documents import Document, read_book_documents, read_documents, stdin_bytes
from s4r_cli.options import CommonArgs, common_args, with_options
from s4r_cli.session_setup import check_ratio_reachable, open_model
from s4r_cli.ui import UI

_SERVER = "Server"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
    docs = read_documents(args.files, stdin=stdin_bytes()) + read_book_documents(args.books)
    check_model_spec(args.model)
    check_method(args.method)
    check_port(host, port)
    run_server(args, docs, host=host, port=port, api_key=api_key, budget=budget, cache_dir=cache_dir,
               min_document_tokens=min_document_tokens, max_queue=max_queue,
               max_tokens_limit=max_tokens_limit, body_limit=body_limit, model_id=served_model_name)


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
    """Load the model, hold the documents, then serve until Ctrl-C."""
    import uvicorn

    from s4r.serving.document_store import DocumentStore
    from s4r.serving.engine import Engine
    from s4r.serving.generate import Sampling
    from s4r_cli.server.app import ServerConfig, create_app

    ui = UI.for_ask()
    loaded = open_model(args, ui)
    check_ratio_reachable(args, loaded)
    kwargs: dict[str, Any] = {k: v for k, v in args.session_kwargs().items() if k != "system"}
    store = DocumentStore(loaded, budget_bytes=budget, cache_dir=cache_dir, session_kwargs=kwargs,
                          log=lambda line: _say(line))
    engine = Engine(loaded, store, default_system=args.system, max_tokens=args.max_new_tokens,
                    min_document_tokens=min_document_tokens)
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
    uvicorn.run(create_app(engine, config), host=host, port=port, log_level="warning")


def _say(line: str) -> None:
    sys.stderr.write(f"s4r: {line}\n")
    sys.stderr.flush()


def register(app: typer.Typer) -> None:
    """Add `serve` to the app."""
    app.command()(with_options(serve))
