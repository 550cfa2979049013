"""`s4r ask QUESTION`: one question about a document, answer streamed to stdout (pipeline friendly)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from s4r_cli.checks import check_cache_path, check_method, check_model_spec
from s4r_cli.cli_errors import UsageError, pipe_guard
from s4r_cli.documents import Document, read_book_documents, read_document_stream, read_documents, stdin_bytes
from s4r_cli.options import CommonArgs, common_args, with_options
from s4r_cli.ranks import collectives_checked, finish, memory_fields, on_main, start_ranks
from s4r_cli.session_setup import open_model, open_session
from s4r_cli.ui import UI, short_dtype, stop_notice

EXIT_INTERRUPTED = 130


def ask(
    ctx: typer.Context,
    question: Annotated[str, typer.Argument(metavar="QUESTION", help="What to ask about the document.")],
    args: CommonArgs,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Model, cache and speed stats on stderr.")]
    = False,
    as_json: Annotated[bool, typer.Option("--json", help=(
        "Print one JSON object (answer and stats) instead; its peak_mem_bytes is the process's measured "
        "peak memory."))]
    = False,
) -> None:
    """Answer one question about a document (--file, --book, or text piped on stdin).

    Only the answer goes to stdout; `-v` adds stats on stderr.

    Truncation, an uncompressed cache and an answer cut short are each said in one line on stderr.
    """
    args = common_args(ctx, args)
    with pipe_guard():
        code = run_ask(args, question, verbose=verbose, as_json=as_json)
    if code:
        raise typer.Exit(code)


def gather_documents(args: CommonArgs) -> list[Document]:
    """--file and --book documents, else stdin when something is piped in; --load alone needs none."""
    stdin = stdin_bytes()
    if args.files or args.books:
        return read_documents(args.files, stdin=stdin) + read_book_documents(args.books)
    if stdin is not None and not args.load:
        return [read_document_stream(stdin)]
    if args.load:
        return []
    raise UsageError("no document: pass --file FILE or --book NAME, pipe text on stdin, or --load a saved "
                     "cache")


def result_record(answer: str, stats: Any, args: CommonArgs, loaded: Any, session: Any,
                  ingest_seconds: float, truncated_tokens: int = 0) -> dict[str, Any]:
    """The --json object. The ratio reported as achieved is measured from the stored cache.

    ``compressed`` is false (with ``uncompressed_reason``) when the documents were too short for the
    requested ratio to pay for itself and the cache was kept whole.
    """
    mem = stats.memory
    reason = getattr(session, "uncompressed_reason", None)
    return {
        "answer": answer,
        "model": loaded.name,
        "method": session.method,
        "method_requested": args.method,
        "compressed": session.method != "full",
        "uncompressed_reason": reason,
        "ratio_requested": session.ratio_requested,
        "ratio_achieved": mem.ratio,
        "kv_bytes": mem.stored_bytes,
        "kv_full_bytes": mem.full_bytes,
        "kv_tokens": mem.tokens,
        "document_tokens": session.document_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "ttft_s": stats.ttft_s,
        "prefill_tok_s": stats.prefill_tok_s,
        "decode_tok_s": stats.decode_tok_s,
        # the process's measured peak (RSS on CPU, CUDA allocated on GPU), weights included: not the cache
        "peak_mem_bytes": stats.peak_mem_bytes,
        "ingest_mode": session.last_ingest.mode if getattr(session, "last_ingest", None) else None,
        # whether the last layer-wise ingest kept its hidden states in a temp file between layers
        "hidden_spilled": bool(getattr(getattr(session, "last_ingest", None), "hidden_spilled", False)),
        "ingest_s": ingest_seconds,
        "device": str(loaded.device),
        "dtype": short_dtype(loaded.dtype),
        "quant": getattr(loaded, "quant", args.quant.value),
        "interrupted": stats.interrupted,
        "stop_reason": getattr(stats, "stop_reason", "end"),
        "truncated_tokens": truncated_tokens,
        "repeat_penalty": args.generation.repeat_penalty,
    }


def run_ask(args: CommonArgs, question: str, *, verbose: bool = False, as_json: bool = False) -> int:
    """Validate, load, ingest, answer. Returns the exit code (0, or 130 when Ctrl-C cut the answer).

    Under torchrun rank 0 reads the input and every rank answers with its share of the model's heads
    (`s4r_cli.ranks`); --json then reports the cache's bytes per rank and in all.
    """
    start_ranks(args.device)
    try:
        with collectives_checked():
            return _answer(args, question, verbose, as_json)
    finally:
        finish()


def _validated_input(args: CommonArgs, question: str) -> list[Document]:
    if not question.strip():
        raise UsageError("the question is empty")
    docs = gather_documents(args)
    if args.load:
        check_cache_path(args.load)
    check_model_spec(args.model)
    check_method(args.method)
    return docs


def _answer(args: CommonArgs, question: str, verbose: bool, as_json: bool) -> int:
    docs = on_main(lambda: _validated_input(args, question))
    ui = UI.for_ask()
    loaded = open_model(args, ui)
    session, ingest_seconds, dropped = open_session(args, loaded, docs, ui)
    if verbose:
        ui.header_plain(loaded, session, ingest_seconds)

    if as_json:
        answer, stats = session.ask(question, **args.generation.kwargs())
        record = result_record(answer, stats, args, loaded, session, ingest_seconds,
                               truncated_tokens=dropped)
        record.update(memory_fields(stats.memory))  # every rank's cache, under torchrun
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    else:
        with ui.answer() as stream:
            answer, stats = session.ask(question, on_token=stream.on_token, **args.generation.kwargs())
    notice = stop_notice(stats)
    if notice:
        ui.notice(notice)
    if verbose:
        ui.turn_stats(stats)
    return EXIT_INTERRUPTED if stats.interrupted else 0


def register(app: typer.Typer) -> None:
    """Add `ask` to the app."""
    app.command()(with_options(ask))
