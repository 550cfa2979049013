"""Errors the library raises; the CLI turns each into one line on stderr and an exit code."""

from __future__ import annotations


class S4RError(Exception):
    """Base class for every error s4r reports to a user (never a bug)."""


class BudgetError(S4RError, ValueError):
    """The requested compression ratio cannot be met for this model and length."""


class ContextTooLongError(S4RError):
    """The document (plus conversation) exceeds the model's context length."""

    def __init__(self, tokens: int, limit: int, message: str | None = None):
        self.tokens = tokens
        self.limit = limit
        super().__init__(
            message
            or f"the input is {tokens} tokens but the model's context is {limit} tokens; "
            "use --truncate head|tail|middle, or --rope-scaling FACTOR (lower quality)"
        )


class CacheFileError(S4RError):
    """A saved cache is missing, corrupt, or was made with another model or settings."""


class ModelLoadError(S4RError):
    """A model could not be found, fetched or loaded."""


class DeviceError(S4RError):
    """The requested device (or quantization) is not available on this machine."""


class RankError(S4RError):
    """Under torchrun: another rank stopped, did not answer in time, or the process group could not start."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text (library errors can run to pages), or its type."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__
