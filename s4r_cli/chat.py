"""`s4r chat`: load a model, read documents into a compressed KV cache, then talk about them in a REPL."""

from __future__ import annotations

import sys
from typing import IO

import typer

from s4r_cli.checks import check_cache_path, check_method, check_model_spec
from s4r_cli.cli_errors import UsageError, pipe_guard
from s4r_cli.documents import Document, read_book_documents, read_document_stream, read_documents, stdin_bytes
from s4r_cli.options import CommonArgs, common_args, with_options
from s4r_cli.ranks import (
    RankReader,
    collectives_checked,
    finish,
    is_main_rank,
    launched,
    on_main,
    start_ranks,
)
from s4r_cli.session_setup import open_model, open_session
from s4r_cli.ui import UI

EXIT_INTERRUPTED = 130


def chat(ctx: typer.Context, args: CommonArgs) -> None:
    """Chat about documents held in a compressed KV cache.

    Text piped in (`cat book.txt | s4r chat`) is the document; the questions then come from the terminal.
    Enter sends; Esc Enter (Alt+Enter) or a trailing backslash starts a new line. /help lists the commands.
    """
    args = common_args(ctx, args)
    with pipe_guard():
        code = run_chat(args)
    if code:
        raise typer.Exit(code)


def document_on_stdin(args: CommonArgs) -> bool:
    """Is stdin the document? With `--file -`, or when text is piped in and nothing else names a document."""
    if "-" in args.files:
        return True
    return stdin_bytes() is not None and not (args.files or args.books or args.load)


def run_chat(args: CommonArgs) -> int:
    """Everything after option parsing: validate input, load, ingest, then the REPL until /exit or Ctrl-D.

    Returns the exit code: 0, or 130 when Ctrl-C left the REPL. Under torchrun rank 0 reads the documents
    and every line and the other ranks follow (`s4r_cli.ranks`).
    """
    start_ranks(args.device)
    try:
        with collectives_checked():
            return _chat(args)
    finally:
        finish()


def _validated_input(args: CommonArgs) -> tuple[list[Document], IO[str] | None]:
    """The documents, and the terminal the questions come from when stdin carried a document."""
    from s4r_cli.repl import open_terminal

    questions = None
    if document_on_stdin(args):
        # the questions must come from somewhere else: the terminal, or nowhere (refuse before reading)
        questions = open_terminal()
        if questions is None:
            raise UsageError("the document came on stdin and there is no terminal to read questions from; "
                             "use s4r ask QUESTION for one answer, or pass the document with --file")
        stdin = stdin_bytes()
        if stdin is None:
            raise UsageError("--file - needs a document on stdin")
        docs = [read_document_stream(stdin)]
        docs += read_documents([f for f in args.files if f != "-"]) + read_book_documents(args.books)
    else:
        docs = read_documents(args.files) + read_book_documents(args.books)
    if args.load:
        check_cache_path(args.load)
    check_model_spec(args.model)
    check_method(args.method)
    return docs, questions


def _chat(args: CommonArgs) -> int:
    from s4r_cli.repl import ChatState, CommandHandler, question_reader, run_repl

    # rank 0 reads (a terminal it opened stays its own); the followers get the documents
    held: list[IO[str] | None] = [None]

    def read_input() -> list[Document]:
        docs, held[0] = _validated_input(args)
        return docs

    docs = on_main(read_input)
    questions = held[0]
    ui = UI.for_chat(questions)
    loaded = open_model(args, ui)
    session, ingest_seconds, _ = open_session(args, loaded, docs, ui)
    ui.header(loaded, session, ingest_seconds)

    state = ChatState(loaded=loaded, session=session, settings=args.generation,
                      load_kwargs=args.session_kwargs(only_explicit=True), ingest_seconds=ingest_seconds,
                      loaded_from=args.load)
    reader = None
    if is_main_rank():
        reader = question_reader(questions if questions is not None else sys.stdin)
    return run_repl(CommandHandler(state, ui), RankReader(reader) if launched() else reader)


def register(app: typer.Typer) -> None:
    """Add `chat` to the app."""
    app.command()(with_options(chat))
