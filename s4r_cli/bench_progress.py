"""`s4r bench` progress on the terminal: a rich bar per phase on a TTY, plain timestamped lines otherwise."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from s4r_cli.ui import seconds


class BenchProgress:
    """s4r.bench.runner.BenchHooks for the terminal (duck-typed: subclassing would import torch before the
    options are checked): one rich bar per phase on a TTY, plain timestamped lines on stderr otherwise."""

    def __init__(self, err: Console, progress: Progress | None) -> None:
        self.err = err
        self.progress = progress
        self.plain = progress is None
        self.task: Any = None
        self.started = time.perf_counter()

    def phase(self, name: str, total: int) -> None:
        if self.progress is not None:
            if self.task is not None:
                self.progress.remove_task(self.task)
            self.task = self.progress.add_task(name, total=total or None, detail="")
        elif name != "setup":
            self.err.print(f"[{self._clock()}] {name}: {total:,} steps", markup=False, highlight=False)

    def advance(self, detail: str = "", units: int = 1) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, advance=units, detail=detail)

    def note(self, message: str) -> None:
        if self.plain:
            self.err.print(f"[{self._clock()}] {message}", markup=False, highlight=False)

    def warn(self, message: str) -> None:
        target = self.progress.console if self.progress is not None else self.err
        target.print(f"warning: {message}", style="yellow", markup=False, highlight=False)

    def _clock(self) -> str:
        return seconds(time.perf_counter() - self.started)


def progress_bars(err: Console) -> Progress:
    """The bars of a run on a terminal: spinner, phase, bar, count, elapsed, eta, what runs now."""
    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description:<8}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    TextColumn("[dim]{task.fields[detail]}"), console=err, transient=True)


