"""`s4r chat`: load a model, read documents into a compressed KV cache, then talk about them in a REPL."""

from __future__ import annotations

import sys

import typer

from s4r_cli.common import (
    DEFAULT_MODEL,
    CommonArgs,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    FileOpt,
    Ingest,
    IngestOpt,
    LoadOpt,
    MaxNewTokensOpt,
    MethodOpt,
    ModelOpt,
    Quant,
    QuantOpt,
    RatioOpt,
    RopeScalingOpt,
    SeedOpt,
    SystemOpt,
    TemperatureOpt,
    TopPOpt,
    TruncateOpt,
    UsageError,
    check_cache_path,
    check_method,
    check_model_spec,
    common_args,
    load_model,
    open_session,
    pipe_guard,
    read_documents,
)
from s4r_cli.ui import UI, is_tty


def chat(
    ctx: typer.Context,
    file: FileOpt = None,
    load: LoadOpt = None,
    model: ModelOpt = DEFAULT_MODEL,
    ratio: RatioOpt = 5.0,
    method: MethodOpt = "s4r",
    truncate: TruncateOpt = None,
    rope_scaling: RopeScalingOpt = None,
    ingest: IngestOpt = Ingest.layerwise,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.auto,
    quant: QuantOpt = Quant.none,
    max_new_tokens: MaxNewTokensOpt = 512,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    system: SystemOpt = None,
) -> None:
    """Chat about documents held in a compressed KV cache.

    Enter sends; Esc Enter (Alt+Enter) or a trailing backslash starts a new line. /help lists the commands.
    """
    args = common_args(ctx, model=model, device=device, dtype=dtype, quant=quant, ratio=ratio, method=method,
                       truncate=truncate, system=system, files=file, load=load, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, seed=seed, rope_scaling=rope_scaling,
                       ingest=ingest)
    with pipe_guard():
        run_chat(args)


def run_chat(args: CommonArgs) -> None:
    """Everything after option parsing: validate input, load, ingest, then the REPL until /exit or Ctrl-D."""
    from s4r_cli.repl import ChatState, CommandHandler, LineReader, PromptReader, run_repl

    if "-" in args.files:
        raise UsageError("chat reads your questions from stdin, so --file - is not available; use s4r ask")
    docs = read_documents(args.files)
    if args.load:
        check_cache_path(args.load)
    check_model_spec(args.model)
    check_method(args.method)

    ui = UI.for_chat()
    loaded = load_model(args, ui)
    session, ingest_seconds = open_session(args, loaded, docs, ui)
    ui.header(loaded, session, ingest_seconds)

    state = ChatState(loaded=loaded, session=session, settings=args.generation,
                      load_kwargs=args.session_kwargs(only_explicit=True), ingest_seconds=ingest_seconds)
    # a terminal gets the full line editor; piped input (scripts, tests) is read line by line
    reader = PromptReader() if is_tty(sys.stdin) and is_tty(sys.stdout) else LineReader(sys.stdin)
    run_repl(CommandHandler(state, ui), reader)


def register(app: typer.Typer) -> None:
    """Add `chat` to the app."""
    app.command()(chat)
