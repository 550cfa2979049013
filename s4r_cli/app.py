"""The `s4r` command: the Typer app, subcommand registration, and errors -> one line + exit code.

Exit codes:
    0    success
    1    runtime error: the model or a saved cache cannot be loaded, a failure while running, a bug
    2    bad input: bad options, unreadable or missing files, an unknown model or book, a document or
         question longer than the context (without --truncate), a --ratio the method can never reach,
         a device that is not there (`--device cuda` without a GPU)
    130  interrupted (Ctrl-C)
    141  stdout closed early by its reader (`s4r ask ... | head`), like tools killed by SIGPIPE
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence

import click
import typer

from s4r_cli import ask, books_cmd, chat, models_cmd, serve
from s4r_cli.cli_errors import PipeClosed, UsageError, error_message
from s4r_cli.options import METHODS_PLACEHOLDER

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141

app = typer.Typer(
    name="s4r",
    help="Long-context chat with a compressed (S4R) KV cache.",
    add_completion=False,
    pretty_exceptions_enable=False,  # run() reports errors; no rich tracebacks for users
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context) -> None:
    """Long-context chat with a compressed (S4R) KV cache."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(EXIT_OK)


chat.register(app)
ask.register(app)
models_cmd.register(app)
books_cmd.register(app)
serve.register(app)


def _register_bench(app: typer.Typer) -> None:
    """Add `s4r bench` from s4r_cli/bench.py when it exists (it is developed separately)."""
    try:
        bench = importlib.import_module("s4r_cli.bench")
    except ModuleNotFoundError as e:
        if e.name == "s4r_cli.bench":
            return  # not written yet
        error = f"{e}"
    except ImportError as e:
        error = f"{e}"
    else:
        bench.register(app)
        return

    # bench exists but cannot be imported (e.g. an optional dependency): say so instead of hiding it
    @app.command(name="bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def _bench_unavailable() -> None:
        """Benchmarks (unavailable: see the error when run)."""
        _say(f"error: s4r bench is unavailable: {error}")
        raise typer.Exit(EXIT_RUNTIME)


_register_bench(app)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"s4r: {_one_line(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr itself is gone; the exit code still tells


def _debug_traceback() -> None:
    """With S4R_DEBUG=1 set, print the traceback behind an error (for bug reports)."""
    if os.environ.get("S4R_DEBUG"):
        traceback.print_exc()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def fill_method_help(command: click.Command) -> None:
    """Put every registered method (s4r.methods.METHODS) into the --method(s) help of each subcommand.

    Done only when help is shown: the list lives in the library, whose import loads torch.
    """
    try:
        from s4r.methods import METHODS
    except ImportError:
        return
    for sub in getattr(command, "commands", {}).values():
        for param in sub.params:
            if param.name in ("method", "methods") and getattr(param, "help", None):
                param.help = param.help.replace(METHODS_PLACEHOLDER, ", ".join(METHODS))


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code; every failure becomes one line on stderr."""
    from s4r.errors import ContextTooLongError, S4RError
    from s4r_cli.ranks import mute_followers

    mute_followers()  # under torchrun only rank 0 speaks
    command = typer.main.get_command(app)
    try:
        args = list(argv) if argv is not None else sys.argv[1:]
        if "--help" in args or "-h" in args:
            fill_method_help(command)
        rv = command.main(args=args, prog_name="s4r", standalone_mode=False)
        return rv if isinstance(rv, int) else EXIT_OK
    except UsageError as e:
        _say(f"error: {e}")
        return EXIT_USAGE
    except typer.TyperException as e:  # click-level parse errors: bad option, bad value, missing argument
        _say(f"error: {e.format_message()}")
        return e.exit_code
    except S4RError as e:
        _debug_traceback()
        _say(f"error: {error_message(e)}")
        # a document or question longer than the context is bad input, like a missing file
        return EXIT_USAGE if isinstance(e, ContextTooLongError) else EXIT_RUNTIME
    except PipeClosed:
        _silence_stdout()
        return EXIT_PIPE
    except (KeyboardInterrupt, typer.Abort):
        # typer turns Ctrl-C inside a command into exit 130 itself; this covers the rest
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_RUNTIME)
    except Exception as e:
        _debug_traceback()
        _say(f"internal error: {type(e).__name__}: {e} (S4R_DEBUG=1 shows the traceback)")
        return EXIT_RUNTIME


def _launched() -> bool:
    """Whether this process is one of several ranks torchrun started (without importing torch otherwise).

    Such a process leaves without the interpreter's teardown: there the process group's threads abort it
    (SIGABRT, "terminate called ...") after a lost rank, and now and then after a clean run too."""
    if "WORLD_SIZE" not in os.environ:
        return False
    from s4r.distributed.world import launched_size

    return launched_size() > 1


def main() -> None:
    """Console-script entry point."""
    try:
        code = run()
    except KeyboardInterrupt:  # Ctrl-C while importing or reporting
        code = EXIT_INTERRUPTED
    if _launched():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
