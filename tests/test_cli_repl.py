"""The chat REPL driven through prompt-toolkit's pipe input (no terminal) with a fake session."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from s4r_cli.generation_settings import GenerationSettings
from s4r_cli.repl import ChatState, CommandHandler, LineReader, PromptReader, run_repl
from s4r_cli.ui import UI
from tests.test_cli_fakes import FakeLoaded, FakeSession, install_fakes

DOC = "Chapter one. The secret passphrase is 'blue-harbor-42'. It rained all day."
ENTER = "\r"
ESC_ENTER = "\x1b\r"
CTRL_C = "\x03"


class Chat:
    """A REPL over a fake session whose output is captured as text."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        console = Console(file=self.buffer, width=200, color_system=None, highlight=False)
        self.ui = UI(out=self.buffer, info=console)
        self.loaded = FakeLoaded()
        session = FakeSession(self.loaded, ratio=5.0)
        session.ingest(DOC)
        self.state = ChatState(loaded=self.loaded, session=session, settings=GenerationSettings(),
                               load_kwargs={}, ingest_seconds=0.5)
        self.handler = CommandHandler(self.state, self.ui)

    @property
    def session(self) -> FakeSession:
        return self.state.session

    def type(self, keys: str) -> str:
        """Feed raw keystrokes to a real prompt-toolkit prompt until input ends; return what was shown."""
        start = self.buffer.tell()
        with create_pipe_input() as pipe:
            pipe.send_text(keys)
            pipe.close()  # end of input = Ctrl-D: the REPL returns
            reader = PromptReader(input=pipe, output=DummyOutput(), history=InMemoryHistory())
            run_repl(self.handler, reader)
        return self.buffer.getvalue()[start:]


@pytest.fixture
def chat(monkeypatch: pytest.MonkeyPatch) -> Iterator[Chat]:
    install_fakes(monkeypatch)
    yield Chat()


def test_question_is_streamed_and_followed_by_stats(chat: Chat) -> None:
    out = chat.type("What is the secret passphrase?" + ENTER)
    assert "The passphrase is blue-harbor-42." in out
    stats = [line for line in out.splitlines() if line.startswith("TTFT")]
    assert len(stats) == 1
    # the achieved ratio (480/100), not the requested 5
    assert "×4.80" in stats[0] and "tok/s" in stats[0] and "peak" in stats[0]


def test_help(chat: Chat) -> None:
    out = chat.type("/help" + ENTER)
    for cmd in ("/stats", "/clear", "/read FILE", "/save PATH", "/load PATH", "/set KEY VALUE", "/exit"):
        assert cmd in out
    assert "Esc Enter" in out  # says how multi-line input works


def test_stats(chat: Chat) -> None:
    out = chat.type("/stats" + ENTER)
    assert "×4.80 achieved" in out and "requested ×5" in out
    assert "no question yet" in out
    out = chat.type("hello" + ENTER + "/stats" + ENTER)
    assert "no question yet" not in out and "TTFT" in out


def test_clear_keeps_documents(chat: Chat) -> None:
    chat.type("hello" + ENTER)
    assert chat.session.turns
    out = chat.type("/clear" + ENTER)
    assert chat.session.turns == [] and chat.session.docs == [DOC]
    assert "conversation cleared" in out


def test_set_valid_values_reach_the_session(chat: Chat) -> None:
    chat.type("/set temperature 0.7" + ENTER + "/set top_p 0.9" + ENTER + "/set max_tokens 3" + ENTER
              + "/set seed 7" + ENTER + "hi there" + ENTER)
    question, kwargs = chat.session.calls[-1]
    assert kwargs == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3, "seed": 7,
                      "repeat_penalty": 1.1, "repeat_last_n": 64, "loop_guard": True}
    chat.type("/set seed none" + ENTER)
    assert chat.state.settings.seed is None


@pytest.mark.parametrize("command", ["/set temperature -1", "/set top_p 2", "/set max_tokens 0",
                                     "/set max_tokens lots", "/set seed -4", "/set color blue", "/set top_p"])
def test_set_rejects_bad_values(chat: Chat, command: str) -> None:
    before = GenerationSettings(**vars(chat.state.settings))
    out = chat.type(command + ENTER)
    assert "error:" in out
    assert chat.state.settings == before


def test_set_alone_shows_settings(chat: Chat) -> None:
    assert "temperature 0, top_p 1, max_tokens 512, seed none" in chat.type("/set" + ENTER)


def test_unknown_command_hint(chat: Chat) -> None:
    out = chat.type("/frob" + ENTER)
    assert "unknown command /frob; try /help" in out
    assert not chat.session.calls  # not sent to the model


def test_exit_and_quit_stop_reading(chat: Chat) -> None:
    for word in ("/exit", "/quit"):
        chat.type(word + ENTER + "never asked" + ENTER)
        assert not chat.session.calls


def test_end_of_input_exits(chat: Chat) -> None:
    assert chat.type("") == ""  # Ctrl-D on an empty prompt: run_repl returns


def test_ctrl_c_at_prompt_clears_the_line(chat: Chat) -> None:
    chat.type("half a thought" + CTRL_C + "whole question" + ENTER)
    assert [q for q, _ in chat.session.calls] == ["whole question"]


def test_ctrl_c_during_answer_keeps_session(chat: Chat) -> None:
    out = chat.type("INTERRUPT" + ENTER + "after" + ENTER)
    assert "interrupted" in out
    assert [q for q, _ in chat.session.calls] == ["INTERRUPT", "after"]


def test_multiline_with_escape_enter(chat: Chat) -> None:
    chat.type("first line" + ESC_ENTER + "second line" + ENTER)
    assert chat.session.calls[-1][0] == "first line\nsecond line"


def test_multiline_with_trailing_backslash(chat: Chat) -> None:
    chat.type("first line\\" + ENTER + "second line" + ENTER)
    assert chat.session.calls[-1][0] == "first line\nsecond line"


def test_pasted_text_keeps_newlines(chat: Chat) -> None:
    chat.type("\x1b[200~pasted one\npasted two\x1b[201~" + ENTER)
    assert chat.session.calls[-1][0] == "pasted one\npasted two"


def test_double_slash_sends_a_literal_slash(chat: Chat) -> None:
    chat.type("//etc/passwd is a path" + ENTER)
    assert chat.session.calls[-1][0] == "/etc/passwd is a path"


def test_read_adds_a_document(chat: Chat, tmp_path: Path) -> None:
    (tmp_path / "more.txt").write_text("Another chapter with six words here.")
    out = chat.type(f"/read {tmp_path / 'more.txt'}" + ENTER)
    assert len(chat.session.docs) == 2 and "read " in out and "6 tokens" in out


def test_read_bad_file_is_an_error_not_an_exit(chat: Chat, tmp_path: Path) -> None:
    out = chat.type("/read nope.txt" + ENTER + "/read" + ENTER + "still here" + ENTER)
    assert "error: file not found: nope.txt" in out and "usage: /read FILE" in out
    assert chat.session.calls[-1][0] == "still here"


def test_save_then_load(chat: Chat, tmp_path: Path) -> None:
    path = tmp_path / "chat.s4r"
    chat.type("hello" + ENTER + f"/save {path}" + ENTER)
    assert path.is_file()
    old = chat.session
    out = chat.type(f"/load {path}" + ENTER)
    assert chat.session is not old and chat.session.turns == old.turns
    assert "loaded" in out


def test_load_refuses_corrupt_and_mismatched_caches(chat: Chat, tmp_path: Path) -> None:
    (tmp_path / "bad.s4r").write_bytes(b"not a cache")
    other = FakeSession(FakeLoaded(name="another-model"))
    other.ingest("x y z")
    other.save(tmp_path / "other.s4r")
    current = chat.session
    out = chat.type(f"/load {tmp_path / 'bad.s4r'}" + ENTER + f"/load {tmp_path / 'other.s4r'}" + ENTER
                    + f"/load {tmp_path / 'missing.s4r'}" + ENTER)
    assert chat.session is current
    assert out.count("keeping the current session") == 2
    assert "another-model" in out and "saved cache not found" in out


def test_internal_error_does_not_end_the_chat(chat: Chat) -> None:
    out = chat.type("BOOM" + ENTER + "next" + ENTER)
    assert "internal error: RuntimeError: fake bug" in out
    assert chat.session.calls[-1][0] == "next"


def test_conversation_too_long_suggests_clear(chat: Chat) -> None:
    out = chat.type("OVERFLOW" + ENTER)
    assert "/clear" in out and f"{2001:,}" in out
    assert "TTFT" not in out


def test_line_reader_joins_backslash_lines() -> None:
    reader = LineReader(io.StringIO("one\\\ntwo\nthree\n"))
    assert reader.read() == "one\ntwo"
    assert reader.read() == "three"
    with pytest.raises(EOFError):
        reader.read()


def test_history_is_written_under_s4r_home(chat: Chat, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S4R_HOME", str(tmp_path / "home"))
    with create_pipe_input() as pipe:
        pipe.send_text("remember me" + ENTER)
        pipe.close()
        run_repl(chat.handler, PromptReader(input=pipe, output=DummyOutput()))
    assert "remember me" in (tmp_path / "home" / "history").read_text()
