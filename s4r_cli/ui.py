"""All terminal rendering for the CLI: progress bars, the header panel, the per-turn stats line, tables.

Nothing else in s4r_cli imports rich, so what the tool looks like is decided here. Pipes get plain text:
progress bars, spinners and the live status line appear only when the relevant streams are terminals.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from s4r.units import memory_size, mib
from s4r_cli.labels import method_label

LoadProgress = Callable[[str, "float | None"], None]
IngestProgress = Callable[[int, int], None]


def is_tty(stream: Any) -> bool:
    """True when ``stream`` is an open terminal (False for pipes, files, closed or missing streams)."""
    try:
        return stream is not None and not stream.closed and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def short_dtype(dtype: Any) -> str:
    """torch.bfloat16 -> bfloat16 (also fine for plain strings)."""
    return str(dtype).removeprefix("torch.")


def seconds(s: float) -> str:
    """A duration for humans: 850 ms, 4.2 s, 3 min 05 s."""
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m} min {sec:02d} s"


# -- text built from library objects (shared by the rich and the plain renderings) --------------------------

def _threads_note(loaded: Any) -> str:
    """' · 2 threads' on CPU (what the thread policy chose); nothing on a GPU or before torch is loaded."""
    torch = sys.modules.get("torch")
    if torch is None or not str(loaded.device).startswith("cpu"):
        return ""
    n = torch.get_num_threads()
    return f" · {n} thread{'s' if n != 1 else ''}"


def header_rows(loaded: Any, session: Any, ingest_seconds: float | None) -> list[tuple[str, str]]:
    """(label, value) rows describing the model and the cache; the ratio is the achieved one."""
    mem = session.memory()
    quant = getattr(loaded, "quant", "none")
    rows = [
        ("model", f"{loaded.name}" + (f"  ({loaded.source})" if getattr(loaded, "source", None) else "")),
        ("device", f"{loaded.device} · {short_dtype(loaded.dtype)}"
         + (f" · {quant}" if quant != "none" else "") + f" · context {loaded.context_length:,} tokens"
         + _threads_note(loaded)),
        ("method", method_label(session)),
        ("documents", f"{session.document_tokens:,} tokens"
         + (f", ingested in {seconds(ingest_seconds)}" if ingest_seconds else "")),
        ("KV cache", f"{mib(mem.full_bytes)} full → {mib(mem.stored_bytes)} stored "
         f"(×{mem.ratio:.2f} achieved, {mem.tokens:,} tokens)"),
    ]
    return rows


# the stats line stays within this many columns whatever the figures (a wrapped line reads as two)
STATS_LINE_MAX = 110


def process_memory_text(proc: Any, ingest: Any = None) -> str:
    """The process's measured memory (not only the cache), and how the last document was ingested."""
    text = f"process peak {mib(proc.peak_bytes)} {proc.kind}"
    if proc.current_bytes is not None:
        text += f", now {mib(proc.current_bytes)}"
    if ingest is not None:
        text += f" · last document ingested {ingest.mode}"
        if getattr(ingest, "hidden_spilled", False):
            text += " (hidden states in a temp file)"
    return text


def turn_stats_line(stats: Any, width: int = STATS_LINE_MAX) -> str:
    """One line after each answer: latency, speeds, cache size and achieved ratio, peak memory.

    Parts are left out, least useful first (the prompt speed, then peak memory), until the line fits
    ``width`` columns.
    """
    mem = stats.memory
    ttft = f"TTFT {seconds(stats.ttft_s)}"
    parts = [f"answer {stats.generated_tokens:,} tok at {stats.decode_tok_s:,.1f} tok/s",
             f"KV {mem.tokens:,} tok {memory_size(mem.stored_bytes)} ×{mem.ratio:.2f}"]
    peak = [f"peak {memory_size(stats.peak_mem_bytes)}"]
    tail = ["interrupted"] if stats.interrupted else []
    candidates = [
        [f"{ttft} (prompt {stats.prefill_tok_s:,.0f} tok/s)", *parts, *peak, *tail],
        [ttft, *parts, *peak, *tail],
        [ttft, *parts, *tail],
        [ttft, f"{stats.decode_tok_s:,.1f} tok/s", f"KV {memory_size(mem.stored_bytes)} ×{mem.ratio:.2f}",
         *tail],
    ]
    for pieces in candidates:
        line = " · ".join(pieces)
        if len(line) <= width:
            return line
    return line


def stop_notice(stats: Any, *, in_repl: bool = False) -> str | None:
    """One line saying why an answer stopped early (token limit, context limit, a loop), else None."""
    reason = getattr(stats, "stop_reason", "end")
    if reason == "max_new_tokens":
        fix = "/set max_tokens N" if in_repl else "--max-new-tokens N"
        return f"the answer stopped at the token limit ({stats.generated_tokens:,} tokens); {fix} raises it"
    if reason == "context":
        fix = ("/clear forgets the conversation" if in_repl
               else "a shorter document or --truncate leaves more room")
        return f"the answer stopped at the model's context limit (the context is full); {fix}"
    if reason == "loop":
        fix = "/set loop_guard off" if in_repl else "--no-loop-guard"
        return f"stopped the answer: it started repeating itself ({fix} lets it run)"
    return None


def live_memory_line(memory: Any) -> str:
    """The KV part of the live status while an answer streams."""
    return f"KV {memory.tokens:,} tok {memory_size(memory.stored_bytes)} ×{memory.ratio:.2f}"


class _TokensColumn(ProgressColumn):
    """"1,234/3,000 tok · 812 tok/s" for the ingest bar."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        total = f"/{int(task.total):,}" if task.total else ""
        rate = f" · {speed:,.0f} tok/s" if speed else ""
        return Text(f"{int(task.completed):,}{total} tok{rate}", style="progress.data.speed")


class AnswerStream:
    """Receives decoded pieces from Session.ask and shows them as they come.

    Plain mode writes each piece straight to the stream (pipes, tests). Live mode (a terminal) prints
    finished lines normally and keeps the unfinished line plus a status line (tokens, tok/s) in a rich
    Live area, so long answers scroll like ordinary output and the status never gets mixed into them.
    """

    # the live status re-reads the cache size at most this often (seconds)
    MEMORY_EVERY = 0.25

    def __init__(self, console: Console | None, file: IO[str], *, live: bool,
                 memory: Callable[[], Any] | None = None):
        self.console = console
        self.file = file
        self.live_enabled = live and console is not None
        # called from on_token (the decoding thread, between steps), never from the refresh thread
        self.memory = memory
        self.memory_text = ""
        self._memory_at = 0.0
        self.pieces = 0
        self._last = ""
        self._partial = ""
        self._start = 0.0
        self._first = 0.0
        self._live: Live | None = None

    def __enter__(self) -> AnswerStream:
        self._start = time.perf_counter()
        if self.live_enabled:
            assert self.console is not None
            self._live = Live(console=self.console, get_renderable=self._render, refresh_per_second=8,
                              transient=True, vertical_overflow="visible")
            self._live.start()
        return self

    def _status(self) -> Text:
        now = time.perf_counter()
        if not self.pieces:
            return Text(f"thinking… {now - self._start:.1f} s", style="dim")
        # like the session's decode speed: tokens after the first, over the time since the first
        rate = (self.pieces - 1) / max(now - self._first, 1e-6)
        kv = f" · {self.memory_text}" if self.memory_text else ""
        return Text(f"generating… {self.pieces} tok · {rate:.1f} tok/s{kv} · Ctrl-C stops", style="dim")

    def _update_memory(self) -> None:
        now = time.perf_counter()
        if self.memory is not None and now - self._memory_at >= self.MEMORY_EVERY:
            self._memory_at = now
            self.memory_text = live_memory_line(self.memory())

    def _render(self) -> Group:
        return Group(Text(self._partial), self._status())

    def on_token(self, piece: str) -> None:
        """Callback for Session.ask(on_token=...)."""
        if not self.pieces:
            self._first = time.perf_counter()
        self.pieces += 1
        self._last = piece
        if self.live_enabled:
            self._update_memory()
        if self._live is None:
            self.file.write(piece)
            self.file.flush()  # stream: the reader sees each piece as it is decoded
            return
        self._partial += piece
        if "\n" in self._partial:
            done, self._partial = self._partial.rsplit("\n", 1)
            self._live.console.print(done, markup=False, highlight=False, soft_wrap=False)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            if self._partial:
                self._live.console.print(self._partial, markup=False, highlight=False)
        elif self.pieces and not self._last.endswith("\n") and exc_type is not BrokenPipeError:
            # end the answer's line, so the shell prompt (or the next record in a pipe) starts fresh
            self.file.write("\n")
            self.file.flush()


class UI:
    """Where and how the CLI shows things.

    ``out`` receives answers (raw text), ``info`` headers/stats/messages (a rich Console), and
    ``progress`` the loading/ingest bars (None disables them, as for pipes).
    """

    def __init__(self, *, out: IO[str], info: Console, progress: Console | None = None,
                 live: bool = False, answer_console: Console | None = None):
        self.out = out
        self.info = info
        self.progress = progress
        self.live = live
        self.answer_console = answer_console

    @classmethod
    def for_ask(cls) -> UI:
        """Answer on stdout; stats on stderr; bars only when both streams are terminals."""
        err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        both_tty = is_tty(sys.stdout) and is_tty(sys.stderr)
        return cls(out=sys.stdout, info=err, progress=err if both_tty else None)

    @classmethod
    def for_chat(cls, questions: IO[str] | None = None) -> UI:
        """A terminal gets one console for everything; otherwise answers on stdout, the rest on stderr.

        ``questions`` is where questions come from when it is not stdin (the terminal, when the document
        was piped in)."""
        if is_tty(questions if questions is not None else sys.stdin) and is_tty(sys.stdout):
            con = Console(highlight=False)
            return cls(out=sys.stdout, info=con, progress=con, live=True, answer_console=con)
        err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        return cls(out=sys.stdout, info=err)

    @classmethod
    def for_report(cls) -> UI:
        """For `models` and `info`, whose tables are their output: everything on stdout."""
        return cls(out=sys.stdout, info=Console(highlight=False))

    # -- progress --------------------------------------------------------------------------------------------

    @contextmanager
    def loading(self, model: str) -> Iterator[LoadProgress]:
        """Spinner/bar while the model loads; yields the ``progress(stage, fraction)`` callback."""
        if self.progress is None:
            yield lambda stage, fraction: None
            return
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.progress, transient=True) as bar:
            task = bar.add_task(f"loading {model}", total=None)

            def update(stage: str, fraction: float | None) -> None:
                if fraction is None:
                    bar.update(task, description=f"loading {model}: {stage}")
                else:
                    bar.update(task, description=f"loading {model}: {stage}", total=1.0,
                               completed=min(max(fraction, 0.0), 1.0))

            yield update

    @contextmanager
    def ingesting(self, name: str) -> Iterator[IngestProgress]:
        """Token progress bar (tokens, tok/s, ETA) while a document is prefilled and compressed."""
        if self.progress is None:
            yield lambda done, total: None
            return
        columns = (TextColumn("reading [bold]{task.description}"), BarColumn(), _TokensColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=self.progress, transient=True) as bar:
            task = bar.add_task(name, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total or None)

            yield update

    # -- messages --------------------------------------------------------------------------------

    def answer(self, memory: Callable[[], Any] | None = None) -> AnswerStream:
        """A context manager streaming one answer; ``memory`` (e.g. ``session.memory``) feeds the live
        KV size shown while it streams in a terminal."""
        return AnswerStream(self.answer_console, self.out, live=self.live, memory=memory)

    def notice(self, text: str) -> None:
        """One line the user should not miss (truncation, an uncompressed cache, why an answer stopped);
        on stderr unless this is an interactive chat."""
        self.info.print(f"s4r: {text}", style="yellow", markup=False, highlight=False, soft_wrap=True)

    def message(self, text: str, style: str | None = None) -> None:
        """A line for the user (not an answer), e.g. 'saved cache to x'."""
        self.info.print(text, style=style, markup=False, highlight=False)

    def error(self, text: str) -> None:
        """A recoverable error inside the REPL (the session goes on)."""
        self.info.print(f"error: {text}", style="bold red", markup=False, highlight=False)

    def header(self, loaded: Any, session: Any, ingest_seconds: float | None) -> None:
        """The panel shown once the model and documents are ready."""
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan")
        grid.add_column()
        for label, value in header_rows(loaded, session, ingest_seconds):
            grid.add_row(label, value)
        self.info.print(Panel(grid, title="s4r chat", title_align="left", border_style="cyan", expand=False))
        self.info.print("Type a question, /help for commands, Ctrl-D to quit.", style="dim")

    def header_plain(self, loaded: Any, session: Any, ingest_seconds: float | None) -> None:
        """The header as `label: value` lines (for `ask -v` on stderr)."""
        for label, value in header_rows(loaded, session, ingest_seconds):
            self.info.print(f"{label}: {value}", markup=False, highlight=False)

    def turn_stats(self, stats: Any) -> None:
        """The stats line after an answer (shortened to the terminal's width, never wrapped)."""
        width = min(STATS_LINE_MAX, self.info.width) if self.info.is_terminal else STATS_LINE_MAX
        self.info.print(turn_stats_line(stats, width), style="dim", markup=False, highlight=False,
                        soft_wrap=True)

    def help(self, commands: Sequence[tuple[str, str]], footer: str) -> None:
        """The /help table."""
        table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        for cmd, text in commands:
            table.add_row(cmd, text)
        self.info.print(table)
        self.info.print(footer, style="dim", markup=False, highlight=False)

    def key_values(self, title: str, rows: Sequence[tuple[str, str]]) -> None:
        """A two-column table (used by /stats and `s4r info`)."""
        table = Table(title=title, title_justify="left", box=box.SIMPLE, show_header=False, pad_edge=False)
        table.add_column(style="bold cyan")
        table.add_column()
        for k, v in rows:
            table.add_row(k, v)
        self.info.print(table)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A table with a header row (used by `s4r models`)."""
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for i, c in enumerate(columns):
            # the first column is what users copy into a command line: never cut or wrap it
            table.add_column(c, no_wrap=i == 0, overflow="fold")
        for r in rows:
            table.add_row(*r)
        self.info.print(table)
