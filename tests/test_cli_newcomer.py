"""What a newcomer meets first: shipped books, threads, decoding notices, short documents,
unreachable ratios, a document piped into chat, Ctrl-C, truncation, and the REPL's small edges.

Against the fake library (tests/test_cli_fakes.py), in-process or in a subprocess where exit codes and
stderr lines matter.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from s4r.runtime.ratio_limits import max_ratio as real_max_ratio  # before any fake replaces it
from s4r_cli import repl
from s4r_cli.app import run
from s4r_cli.repl import LineReader, PromptReader, run_repl
from s4r_cli.ui import STATS_LINE_MAX, AnswerStream, stop_notice, turn_stats_line
from tests.cli_fixtures import DOC, QUESTION, pipe_stdin
from tests.test_cli_errors import assert_one_error, run_cli
from tests.test_cli_fakes import (
    FAKE_CONTEXT,
    FAKE_LAUNCHER,
    FAKE_MAX_RATIO,
    REPO_ROOT,
    FakeMemoryReport,
    FakeTurnStats,
)
from tests.test_cli_repl import CTRL_C, ENTER, Chat

pytestmark = pytest.mark.usefixtures("cli_fakes")


@pytest.fixture
def chat() -> Chat:
    return Chat()


# -- books ---------------------------------------------------------------------------------------------------

def test_ask_reads_a_shipped_book(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", "Who?", "--book", "pride-and-prejudice", "--truncate", "head"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("You asked: Who?")
    # the fake context is 2,000 words: the book is cut, and that is said in one line
    assert err.count("\n") == 1 and "truncated pride-and-prejudice" in err and "kept its start" in err


def test_unknown_book_is_bad_input(tmp_path: Path) -> None:
    p = run_cli("ask", QUESTION, "--book", "moby-dick", cwd=tmp_path)
    assert_one_error(p, 2, "no book named 'moby-dick'", "pride-and-prejudice")


def test_books_command_lists_the_shipped_books(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["books", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in records] == ["pride-and-prejudice", "romeo-and-juliet", "saltmere"]
    assert all(r["shipped"] for r in records)
    words = {r["name"]: r["words"] for r in records}
    assert words["pride-and-prejudice"] > 100_000 and words["romeo-and-juliet"] > 20_000
    assert 2_500 <= words["saltmere"] <= 3_200


# -- threads -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["ask", "chat"])
def test_threads_option_reaches_torch(command: str, book: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int | None] = []
    monkeypatch.setattr(sys.modules["s4r.runtime.threads"], "apply_threads",
                        lambda requested, device_type="cpu": seen.append(requested) or 1)
    pipe_stdin(monkeypatch, b"/exit\n")
    args = [command, QUESTION] if command == "ask" else [command]
    assert run([*args, "-f", str(book), "--threads", "1"]) == 0
    assert seen == [1]


# -- decoding notices ----------------------------------------------------------------------------------------

def test_token_limit_is_said_on_stderr(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", "LONG", "-f", str(book), "-n", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 3
    assert err == "s4r: the answer stopped at the token limit (3 tokens); --max-new-tokens N raises it\n"


def test_loop_guard_stops_and_says_so(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", "LOOP", "-f", str(book)]) == 0
    out, err = capsys.readouterr()
    assert out.count("again") == 8
    assert "repeating itself" in err and "--no-loop-guard" in err
    assert run(["ask", "LOOP", "-f", str(book), "--no-loop-guard", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stop_reason"] == "max_new_tokens"


def test_decoding_defaults_and_switches(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", QUESTION, "-f", str(book), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["repeat_penalty"] == 1.1 and record["stop_reason"] == "end"
    assert run(["ask", QUESTION, "-f", str(book), "--json", "--repeat-penalty", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["repeat_penalty"] == 1.0


def test_bad_repeat_penalty_is_refused(tmp_path: Path, book: Path) -> None:
    assert_one_error(run_cli("ask", QUESTION, "-f", str(book), "--repeat-penalty", "0.5", cwd=tmp_path), 2,
                     "repeat penalty")


def test_stop_notices_name_the_remedy_where_the_user_is() -> None:
    stats = FakeTurnStats(1, 7, 0.1, 1.0, 1.0, 0, FakeMemoryReport(1, 1, 1), stop_reason="context")
    assert "/clear" in stop_notice(stats, in_repl=True)
    assert "context limit" in stop_notice(stats)
    assert stop_notice(FakeTurnStats(1, 7, 0.1, 1.0, 1.0, 0, FakeMemoryReport(1, 1, 1))) is None


def test_repl_set_repeat_penalty_and_loop_guard(chat: Chat) -> None:
    out = chat.type("/set repeat_penalty 1.0" + ENTER + "/set loop_guard off" + ENTER + "LOOP" + ENTER)
    kwargs = chat.session.calls[-1][1]
    assert kwargs["repeat_penalty"] == 1.0 and kwargs["loop_guard"] is False
    assert "/set max_tokens N raises it" in out  # unguarded, the loop runs into the 512-token limit
    chat.type("/set loop_guard on" + ENTER + "LOOP" + ENTER)
    assert "/set loop_guard off" in chat.buffer.getvalue()


# -- short documents, unreachable ratios ---------------------------------------------------------------------

def test_short_document_kept_uncompressed_said_once(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("the secret passphrase is 'tiny-1'.")
    p = run_cli("ask", QUESTION, "-f", "short.txt", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("\n") == 1 and "kept the cache uncompressed" in p.stderr
    record = json.loads(p.stdout)
    assert record["compressed"] is False and record["method"] == "full"
    assert record["method_requested"] == "s4r"
    assert "too few" in record["uncompressed_reason"]
    assert record["answer"] == "The passphrase is tiny-1."


def test_unreachable_ratio_is_refused_before_reading(tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("word " * (FAKE_CONTEXT + 500))  # too long: would fail if read
    p = run_cli("ask", QUESTION, "-f", "long.txt", "--ratio", str(FAKE_MAX_RATIO + 10), cwd=tmp_path)
    assert_one_error(p, 2, f"--ratio {FAKE_MAX_RATIO + 10:g} is never reachable", "lower --ratio")


# -- chat with a piped document ------------------------------------------------------------------------------

def test_piped_document_then_questions_from_the_terminal(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    pipe_stdin(monkeypatch, DOC.encode())
    monkeypatch.setattr(repl, "open_terminal", lambda: io.StringIO(f"{QUESTION}\n/stats\n"))
    assert run(["chat"]) == 0
    out, err = capsys.readouterr()
    assert out == "The passphrase is blue-harbor-42.\n"  # the piped text was the document, not questions
    assert "<stdin>" not in out


def test_piped_document_without_a_terminal_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pipe_stdin(monkeypatch, DOC.encode())
    monkeypatch.setattr(repl, "open_terminal", lambda: None)
    assert run(["chat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no terminal to read questions from" in err


def test_chat_without_a_terminal_subprocess(tmp_path: Path) -> None:
    """`cat doc | s4r chat` in a process without a controlling terminal (CI, cron): one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "S4R_DEBUG"}
    env.update({"S4R_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO_ROOT)})
    # a new session has no controlling terminal: /dev/tty cannot be opened, even under an interactive pytest
    p = subprocess.run([sys.executable, "-c", FAKE_LAUNCHER, "chat"], input=DOC.encode(), capture_output=True,
                       env=env, cwd=tmp_path, timeout=60, check=False, start_new_session=True)
    result = subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())
    assert_one_error(result, 2, "no terminal")


# -- Ctrl-C --------------------------------------------------------------------------------------------------

def test_ctrl_c_on_piped_questions_leaves_with_130(chat: Chat) -> None:
    class Interrupting(LineReader):
        def read(self) -> str:
            raise KeyboardInterrupt

    assert run_repl(chat.handler, Interrupting(io.StringIO())) == 130


def test_ctrl_c_on_an_empty_prompt_leaves(chat: Chat) -> None:
    with create_pipe_input() as pipe:
        pipe.send_text("half" + CTRL_C + "asked" + ENTER + CTRL_C + "never asked" + ENTER)
        pipe.close()
        reader = PromptReader(input=pipe, output=DummyOutput(), history=InMemoryHistory())
        assert run_repl(chat.handler, reader) == 130
    assert [q for q, _ in chat.session.calls] == ["asked"]


# -- truncation ----------------------------------------------------------------------------------------------

def test_truncate_help_says_middle_is_cut_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "middle cuts out the middle and keeps both ends" in text


def test_truncation_is_always_one_line(tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("word " * (FAKE_CONTEXT + 500))
    p = run_cli("ask", QUESTION, "-f", "long.txt", "--truncate", "middle", cwd=tmp_path)
    assert p.returncode == 0
    assert p.stderr == (f"s4r: truncated long.txt: 500 of {FAKE_CONTEXT + 500:,} tokens left out to fit the "
                        "context (middle: cut out its middle, kept both ends)\n")


# -- the REPL's small edges ----------------------------------------------------------------------------------

def test_read_of_a_too_long_file_suggests_the_repl_remedy(chat: Chat, tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("word " * (FAKE_CONTEXT + 500))
    out = chat.type(f"/read {tmp_path / 'long.txt'}" + ENTER)
    assert "/set truncate head|tail|middle" in out and "--truncate" not in out
    out = chat.type("/set truncate head" + ENTER + f"/read {tmp_path / 'long.txt'}" + ENTER)
    assert "truncate = head" in out and "truncated" in out and "error" not in out


def test_save_refuses_a_missing_folder(chat: Chat, tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "s.s4r"
    out = chat.type(f"/save {target}" + ENTER)
    assert "error:" in out and "does not exist" in out
    assert not (tmp_path / "no").exists()


def test_stats_after_load_says_loaded_from(chat: Chat, tmp_path: Path) -> None:
    path = tmp_path / "s.s4r"
    chat.type(f"/save {path}" + ENTER + f"/load {path}" + ENTER)
    out = chat.type("/stats" + ENTER)
    assert f"loaded from {path}" in out and "ingested in 0 ms" not in out


def test_cli_load_then_stats(tmp_path: Path, book: Path) -> None:
    first = run_cli("chat", "-f", str(book), cwd=tmp_path, stdin=b"/save s.s4r\n")
    assert first.returncode == 0, first.stderr
    p = run_cli("chat", "--load", "s.s4r", cwd=tmp_path, stdin=b"/stats\n")
    assert "loaded from s.s4r" in p.stderr and "ingested in 0 ms" not in p.stderr


def test_live_status_shows_kv_memory_while_streaming() -> None:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    mem = FakeMemoryReport(stored_bytes=3 * 2**20, full_bytes=15 * 2**20, tokens=1234)
    stream = AnswerStream(console, io.StringIO(), live=True, memory=lambda: mem)
    with stream:
        stream.on_token("Hello")
        status = stream._status().plain
    assert "KV 1,234 tok 3.0 MiB ×5.00" in status


def test_stats_line_fits_without_wrapping() -> None:
    worst = FakeTurnStats(prompt_tokens=131_072, generated_tokens=100_000, ttft_s=185.0,
                          prefill_tok_s=123_456.0, decode_tok_s=1234.5, peak_mem_bytes=123 * 2**30,
                          memory=FakeMemoryReport(999 * 2**30, 9999 * 2**30, 131_072), interrupted=True)
    assert len(turn_stats_line(worst)) <= STATS_LINE_MAX
    assert len(turn_stats_line(worst, 80)) <= 80
    usual = FakeTurnStats(9, 498, 0.85, 1345.0, 12.4, int(1.2 * 2**30),
                          FakeMemoryReport(33 * 2**20, 167 * 2**20, 8154))
    line = turn_stats_line(usual)
    assert "peak" in line and "prompt" in line and len(line) <= STATS_LINE_MAX


def test_method_help_lists_every_registered_method(capsys: pytest.CaptureFixture[str]) -> None:
    from s4r.methods import METHODS

    assert run(["chat", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for method in METHODS:
        assert method in text
    assert ", ".join(METHODS) in text


@pytest.mark.slow
def test_unreachable_ratio_real_library(smollm2: object, tmp_path: Path) -> None:
    """`--ratio 1000` with the real model: refused with exit 2 after the (1 s) model load, before the
    document is read (it is too long for the context, which would be a different error)."""
    (tmp_path / "long.txt").write_text("word " * 20_000)
    # the bound depends on the auto dtype (bf16 where the CPU has it, else fp32): ask the library for it
    bound = real_max_ratio(smollm2, "s4r")
    assert 20 < bound < 100  # int8 coefficients and exact sinks/outliers cap it far below 1000
    p = run_cli("ask", QUESTION, "-f", "long.txt", "--ratio", "1000", cwd=tmp_path, fakes=False, timeout=300)
    assert_one_error(p, 2, "--ratio 1000 is never reachable with s4r", f"at most ×{bound:.1f}")
