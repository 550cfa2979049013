"""The progress callback model loading reports through: ``progress(stage, fraction)``."""

from __future__ import annotations

from collections.abc import Callable

# stage is "download", "convert" or "load"; fraction is None while unknown
Progress = Callable[[str, "float | None"], None]


def report(progress: Progress | None, stage: str, fraction: float | None) -> None:
    """Call ``progress`` when there is one."""
    if progress is not None:
        progress(stage, fraction)
