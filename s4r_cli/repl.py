"""The chat REPL: input readers (prompt-toolkit or plain lines) and slash-command handling.

Command handling lives in :class:`CommandHandler`, a plain class that takes one input line at a time, so
tests drive it without a terminal; :func:`run_repl` only connects a reader to it.

Multi-line input: Enter sends. Esc then Enter (Alt+Enter in most terminals) inserts a newline, and so does a
line ending in a backslash (the backslash is dropped). Pasted text keeps its newlines (bracketed paste).
When stdin is not a terminal, lines are read plainly and a trailing backslash also continues the line.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import Output

from s4r.errors import ContextTooLongError, RankError, S4RError
from s4r.units import mib
from s4r_cli.checks import check_cache_path
from s4r_cli.cli_errors import UsageError, error_message
from s4r_cli.documents import read_document_file
from s4r_cli.generation_settings import SETTABLE, GenerationSettings
from s4r_cli.labels import method_label
from s4r_cli.options import Truncate
from s4r_cli.ranks import collectives_checked
from s4r_cli.session_setup import ingest, report_uncompressed
from s4r_cli.ui import UI, is_tty, process_memory_text, seconds, stop_notice, turn_stats_line

EXIT_INTERRUPTED = 130

COMMANDS: list[tuple[str, str]] = [
    ("/help", "show this help"),
    ("/stats", "cache size, achieved ratio, settings and the last turn's speed"),
    ("/clear", "forget the conversation, keep the documents"),
    ("/read FILE", "add a document"),
    ("/save PATH", "save the compressed cache (documents + conversation)"),
    ("/load PATH", "replace the session with a saved cache (same model and method)"),
    ("/set KEY VALUE", f"{SETTABLE} (`/set` alone shows them)"),
    ("/exit, /quit", "leave (Ctrl-D too)"),
]
HELP_FOOTER = ("Enter sends; Esc Enter (or Alt+Enter) or a trailing \\ starts a new line; pasted text keeps "
               "its newlines. Ctrl-C stops an answer or clears the line; on an empty line it leaves. Start "
               "with // to send a literal /.")


@dataclass
class ChatState:
    """What the REPL works on; /load swaps ``session``."""

    loaded: Any
    session: Any
    settings: GenerationSettings
    # options for Session.load when /load replaces the session
    load_kwargs: dict[str, Any]
    ingest_seconds: float = 0.0
    last_stats: Any = None
    # the saved cache the session came from (--load or /load), else None
    loaded_from: str | None = None


class CommandHandler:
    """Turns one line of input into a question or a slash command. ``handle`` returns False to quit."""

    def __init__(self, state: ChatState, ui: UI):
        self.state = state
        self.ui = ui
        self._commands: dict[str, Callable[[str], bool]] = {
            "/help": self.cmd_help, "/stats": self.cmd_stats, "/clear": self.cmd_clear,
            "/read": self.cmd_read, "/save": self.cmd_save, "/load": self.cmd_load, "/set": self.cmd_set,
            "/exit": self.cmd_exit, "/quit": self.cmd_exit,
        }

    def handle(self, line: str) -> bool:
        """Process one input; errors are shown and the session goes on."""
        text = line.strip()
        if not text:
            return True
        try:
            with collectives_checked():
                if text.startswith("//"):
                    self.ask(text[1:])
                    return True
                if text.startswith("/"):
                    name, _, arg = text.partition(" ")
                    command = self._commands.get(name.lower())
                    if command is None:
                        self.ui.error(f"unknown command {name}; try /help")
                        return True
                    return command(arg.strip())
                self.ask(line.strip("\n"))
        except RankError:
            raise  # another rank is gone: the chat cannot go on, and `s4r` says so in one line
        except UsageError as e:
            self.ui.error(str(e))
        except S4RError as e:
            self.ui.error(error_message(e))
        except BrokenPipeError:
            raise  # our stdout is gone (`s4r chat ... | head`): end quietly, not chat on
        except OSError as e:
            self.ui.error(f"{e.filename or 'I/O'}: {e.strerror or e}")
        except KeyboardInterrupt:
            self.ui.message("interrupted", style="dim")
        except Exception as e:  # a bug must not kill a long chat; show it and keep the session
            self.ui.error(f"internal error: {type(e).__name__}: {e}")
            if os.environ.get("S4R_DEBUG"):
                self.ui.message(traceback.format_exc())
        return True

    def ask(self, question: str) -> None:
        """Stream one answer, then its stats line."""
        settings = self.state.settings.kwargs()
        try:
            with self.ui.answer(memory=self.state.session.memory) as stream:
                _, stats = self.state.session.ask(question, on_token=stream.on_token, **settings)
        except ContextTooLongError as e:
            # mid-chat the way out is forgetting the conversation, not a command-line flag
            self.ui.error(f"the conversation is {e.tokens:,} tokens, over the context of {e.limit:,}; "
                          "/clear forgets it and keeps the documents")
            return
        self.state.last_stats = stats
        notice = stop_notice(stats, in_repl=True)
        if notice:
            self.ui.notice(notice)
        self.ui.turn_stats(stats)

    # -- slash commands (each returns False to quit) --------------------------------------------------------

    def cmd_help(self, arg: str) -> bool:
        """/help"""
        self.ui.help(COMMANDS, HELP_FOOTER)
        return True

    def cmd_stats(self, arg: str) -> bool:
        """/stats: the cache as it is now, the settings, and the last turn."""
        s, mem = self.state.session, self.state.session.memory()
        g = self.state.settings
        rows = [
            ("model", f"{self.state.loaded.name} on {self.state.loaded.device}"),
            ("method", method_label(s)),
            ("documents", f"{s.document_tokens:,} tokens, {self._documents_origin()}"),
            ("KV cache", f"{mem.tokens:,} tokens: {mib(mem.full_bytes)} full → {mib(mem.stored_bytes)} "
                         f"stored (×{mem.ratio:.2f} achieved)"),
            ("memory", process_memory_text(s.process_memory(), s.last_ingest)),
            ("settings", g.describe()),
            ("last turn", turn_stats_line(last) if (last := self.state.last_stats) else "no question yet"),
        ]
        self.ui.key_values("stats", rows)
        return True

    def _documents_origin(self) -> str:
        """How the documents got here: 'ingested in 4.2 s', 'loaded from x.s4r', or both."""
        parts = []
        if self.state.loaded_from:
            parts.append(f"loaded from {self.state.loaded_from}")
        if self.state.ingest_seconds or not parts:
            parts.append(f"ingested in {seconds(self.state.ingest_seconds)}")
        return " + ".join(parts)

    def cmd_clear(self, arg: str) -> bool:
        """/clear: forget the conversation, keep the documents."""
        self.state.session.clear()
        self.state.last_stats = None
        kept = self.state.session.document_tokens
        self.ui.message(f"conversation cleared; documents kept ({kept:,} tokens)")
        return True

    def cmd_read(self, arg: str) -> bool:
        """/read FILE: add a document."""
        if not arg:
            raise UsageError("usage: /read FILE")
        doc = read_document_file(arg)
        first = not self.state.session.document_tokens
        stats = ingest(self.state.session, doc, self.ui, remedy="/set truncate")
        if first:
            report_uncompressed(self.state.session, self.ui)
        self.state.ingest_seconds += stats.seconds
        mem = self.state.session.memory()
        self.ui.message(f"read {arg}: {stats.tokens:,} tokens in {seconds(stats.seconds)}; KV now "
                        f"{mib(mem.stored_bytes)} (×{mem.ratio:.2f})")
        return True

    def cmd_save(self, arg: str) -> bool:
        """/save PATH"""
        if not arg:
            raise UsageError("usage: /save PATH")
        path = Path(arg).expanduser()
        if not path.parent.is_dir():
            raise UsageError(f"cannot save to {arg}: the folder {path.parent} does not exist")
        if path.is_dir():
            raise UsageError(f"cannot save to {arg}: it is a folder; give a file name")
        self.state.session.save(path)
        size = f" ({mib(path.stat().st_size)})" if path.is_file() else ""
        self.ui.message(f"saved {self.state.session.memory().tokens:,} tokens to {arg}{size}")
        return True

    def cmd_load(self, arg: str) -> bool:
        """/load PATH: swap in a saved session; on any error the current one stays."""
        if not arg:
            raise UsageError("usage: /load PATH")
        path = check_cache_path(arg)
        try:
            session = type(self.state.session).load(path, self.state.loaded, **self.state.load_kwargs)
        except S4RError as e:
            self.ui.error(f"{error_message(e)}; keeping the current session")
            return True
        self.state.session = session
        self.state.last_stats = None
        self.state.ingest_seconds = 0.0
        self.state.loaded_from = arg
        self.ui.message(f"loaded {arg}")
        self.ui.header(self.state.loaded, session, None)
        return True

    def cmd_set(self, arg: str) -> bool:
        """/set KEY VALUE, or /set alone to show the settings."""
        g = self.state.settings
        if not arg:
            self.ui.message(g.describe())
            return True
        key, _, value = arg.partition(" ")
        if not value.strip():
            raise UsageError(f"usage: /set KEY VALUE ({SETTABLE})")
        if key.lower() == "truncate":
            return self._set_truncate(value.strip())
        key = g.set(key, value.strip())
        self.ui.message(f"{key} = {getattr(g, key)}")
        return True

    def _set_truncate(self, value: str) -> bool:
        """/set truncate head|tail|middle|off: how /read fits a document longer than the context."""
        v = value.lower()
        choices = [t.value for t in Truncate]
        if v not in (*choices, "off", "none"):
            raise UsageError(f"truncate must be one of {', '.join(choices)} or off, got '{value}'")
        self.state.session.truncate = None if v in ("off", "none") else v
        self.ui.message(f"truncate = {self.state.session.truncate or 'off'}")
        return True

    def cmd_exit(self, arg: str) -> bool:
        """/exit, /quit"""
        return False


# -- input ------------------------------------------------------------------------------------------

def _key_bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("enter")
    def _enter(event: KeyPressEvent) -> None:
        buf = event.current_buffer
        # a trailing backslash continues the input on a new line, as in a shell
        if buf.document.is_cursor_at_the_end and buf.text.endswith("\\"):
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _interrupt(event: KeyPressEvent) -> None:
        # Ctrl-C clears a line being typed; on an empty line it leaves the chat
        buf = event.current_buffer
        if buf.text:
            buf.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    return kb


def _history() -> History:
    """Persistent history in $S4R_HOME/history; in memory if that folder cannot be written."""
    from s4r.models.model_store import s4r_home  # no torch: cheap even before the model loads

    home = s4r_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        path = home / "history"
        path.touch(exist_ok=True)
        return FileHistory(str(path))
    except OSError:
        return InMemoryHistory()


class PromptReader:
    """Reads input with prompt-toolkit (history, editing, multi-line). Pass ``input``/``output`` in tests."""

    def __init__(self, *, input: Input | None = None, output: Output | None = None,
                 history: History | None = None):
        self.session: PromptSession[str] = PromptSession(
            key_bindings=_key_bindings(), history=history if history is not None else _history(),
            prompt_continuation=lambda width, line_number, wrap_count: "... ".rjust(width),
            input=input, output=output)

    def read(self) -> str:
        """One input; raises KeyboardInterrupt (Ctrl-C) or EOFError (Ctrl-D)."""
        return self.session.prompt("» ")


class LineReader:
    """Reads plain lines (stdin not a terminal); a trailing backslash joins the next line."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def read(self) -> str:
        """One input; raises EOFError at the end of the stream."""
        lines: list[str] = []
        while True:
            line = self.stream.readline()
            if not line:
                if lines:
                    return "\n".join(lines)
                raise EOFError
            line = line.rstrip("\r\n")
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)


def open_terminal() -> IO[str] | None:
    """The controlling terminal for reading questions when stdin carried the document; None without one."""
    try:
        return open("/dev/tty", encoding="utf-8")  # noqa: SIM115 - held for the whole chat
    except OSError:
        return None


def question_reader(stream: IO[str]) -> PromptReader | LineReader:
    """A terminal (with stdout one too) gets the line editor; anything else is read line by line."""
    if is_tty(stream) and is_tty(sys.stdout):
        if stream.fileno() == 0:
            return PromptReader()
        from prompt_toolkit.input import create_input

        return PromptReader(input=create_input(stdin=stream))
    return LineReader(stream)


def run_repl(handler: CommandHandler, reader: PromptReader | LineReader) -> int:
    """Read inputs until /exit or end of input; return the exit code.

    Ctrl-C while typing clears the line (the line editor does that itself); Ctrl-C at an empty prompt,
    or whenever input is not a terminal, leaves cleanly with 130.
    """
    while True:
        try:
            line = reader.read()
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except EOFError:
            return 0
        if not handler.handle(line):
            return 0
