"""The CLI's own errors and how a library error reads on one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UsageError(Exception):
    """Bad options or bad input files: exit code 2, one line on stderr."""


class PipeClosed(Exception):
    """The reader of our stdout went away (``s4r ask ... | head``); not an error worth a message."""


@contextmanager
def pipe_guard() -> Iterator[None]:
    """Turn BrokenPipeError into PipeClosed so it reaches `app.run` (typer would swallow an OSError)."""
    try:
        yield
    except BrokenPipeError:
        raise PipeClosed() from None


def error_message(e: Exception) -> str:
    """One line for a library error; ContextTooLongError gets the ways out this CLI offers."""
    from s4r.errors import ContextTooLongError

    if isinstance(e, ContextTooLongError):
        return (f"the input is {e.tokens:,} tokens but the model's context is {e.limit:,} tokens; "
                "pass --truncate head|tail|middle to keep the part that fits, or --rope-scaling FACTOR to "
                "stretch the context (lower quality)")
    return " ".join((str(e) or type(e).__name__).split())
