"""`s4r ask`, `s4r chat` (piped), `s4r models`, `s4r info` and the app wiring, against the fake library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from s4r_cli.app import run
from tests.cli_fixtures import DOC, JSON_KEYS, QUESTION, pipe_stdin
from tests.test_cli_fakes import FAKE_LAUNCHER, REPO_ROOT

pytestmark = pytest.mark.usefixtures("cli_fakes")


def test_ask_prints_only_the_answer(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", QUESTION, "--file", str(book)]) == 0
    out, err = capsys.readouterr()
    assert out == "The passphrase is blue-harbor-42.\n"
    assert err == ""


def test_ask_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pipe_stdin(monkeypatch, DOC.encode())
    assert run(["ask", QUESTION]) == 0
    assert "blue-harbor-42" in capsys.readouterr().out


def test_ask_file_dash_is_stdin(monkeypatch: pytest.MonkeyPatch, book: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    pipe_stdin(monkeypatch, b"Also: the secret passphrase is 'from-stdin'.")
    assert run(["ask", QUESTION, "-f", "-", "-f", str(book)]) == 0
    assert "from-stdin" in capsys.readouterr().out


def test_ask_json_has_every_key(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", QUESTION, "-f", str(book), "--json", "--ratio", "5"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)  # one JSON object and nothing else on stdout
    assert set(record) >= JSON_KEYS
    assert record["answer"] == "The passphrase is blue-harbor-42."
    assert record["ratio_requested"] == 5.0
    assert record["ratio_achieved"] == pytest.approx(4.8)  # measured, not echoed
    assert record["kv_full_bytes"] == 480 * record["kv_bytes"] // 100
    assert err == ""


def test_ask_verbose_stats_on_stderr(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", QUESTION, "-f", str(book), "-v"]) == 0
    out, err = capsys.readouterr()
    assert out == "The passphrase is blue-harbor-42.\n"
    assert "model: smollm2-135m" in err and "×4.80 achieved" in err
    assert "TTFT" in err and "answer 4 tok at 50.0 tok/s" in err and "peak" in err


def test_ask_generation_options_reach_the_session(book: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    from tests.test_cli_fakes import FakeSession

    original = FakeSession.ask

    def spy(self: FakeSession, question: str, **kw: object) -> object:
        seen.update(kw, method=self.method, ratio=self.ratio_requested, system=self.system,
                    truncate=self.truncate)
        return original(self, question, **kw)

    monkeypatch.setattr(FakeSession, "ask", spy)
    code = run(["ask", QUESTION, "-f", str(book), "--temperature", "0.5", "--top-p", "0.8", "--seed", "3",
                "-n", "7", "--method", "full", "--ratio", "8", "--system", "Be brief.", "--truncate", "tail"])
    assert code == 0
    assert seen["temperature"] == 0.5 and seen["top_p"] == 0.8 and seen["seed"] == 3
    assert seen["max_new_tokens"] == 7
    session_options = (seen["method"], seen["ratio"], seen["system"], seen["truncate"])
    assert session_options == ("full", 8.0, "Be brief.", "tail")


def test_ask_from_saved_cache(book: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_cli_fakes import FakeLoaded, FakeSession

    saved = FakeSession(FakeLoaded())
    saved.ingest(DOC)
    saved.save(tmp_path / "c.s4r")
    assert run(["ask", QUESTION, "--load", "c.s4r"]) == 0
    assert "blue-harbor-42" in capsys.readouterr().out


def test_load_passes_only_the_session_options_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved cache keeps its settings (e.g. its system prompt) unless the command line overrides them."""
    from tests.test_cli_fakes import FakeLoaded, FakeSession

    saved = FakeSession(FakeLoaded(), ratio=8.0)
    saved.ingest(DOC)
    saved.save(tmp_path / "c.s4r")
    seen: dict[str, object] = {}
    original = FakeSession.load.__func__

    def spy(cls: type[FakeSession], path: object, loaded: object, **kw: object) -> FakeSession:
        seen.update(kw)
        return original(cls, path, loaded, **kw)

    monkeypatch.setattr(FakeSession, "load", classmethod(spy))
    assert run(["ask", QUESTION, "--load", "c.s4r", "--ratio", "8"]) == 0
    assert seen == {"ratio": 8.0}


def test_ask_interrupted_answer_exits_130(book: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["ask", "INTERRUPT", "-f", str(book)]) == 130
    assert capsys.readouterr().out == "You asked: \n"  # the partial answer, then a newline


def test_no_document_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", None)
    assert run(["ask", QUESTION]) == 2
    assert "no document" in capsys.readouterr().err


def test_help_and_bare_command_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--help"]) == 0
    assert run([]) == 0
    out = capsys.readouterr().out
    for cmd in ("chat", "ask", "models", "info"):
        assert cmd in out


def test_models_lists_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["models"]) == 0
    assert "smollm2-135m *" in capsys.readouterr().out
    assert run(["models", "--json"]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)]
    assert "smollm2-135m" in names


def test_info_reports_device_and_versions(tmp_path: Path) -> None:
    """Runs the real library (no model is loaded): device, dtype and versions."""
    env = {**os.environ, "S4R_HOME": str(tmp_path / "home")}
    p = subprocess.run([sys.executable, "-m", "s4r_cli", "info", "--json"], capture_output=True, env=env,
                       timeout=120, check=False, text=True)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    for key in ("auto_device", "auto_dtype", "cpu_bf16_native", "cuda_available", "torch", "transformers"):
        assert key in data
    p = subprocess.run([sys.executable, "-m", "s4r_cli", "info"], capture_output=True, env=env, timeout=120,
                       check=False, text=True)
    assert p.returncode == 0 and "auto device" in p.stdout and "transformers" in p.stdout


def test_bench_hook_is_optional() -> None:
    """Without s4r_cli/bench.py the app still works; with it, `bench` is registered through register(app)."""
    from s4r_cli.app import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert {"chat", "ask", "models", "info"} <= names
    has_bench_module = (REPO_ROOT / "s4r_cli" / "bench.py").exists()
    assert ("bench" in names) == has_bench_module


def test_chat_with_piped_input(tmp_path: Path, book: Path) -> None:
    """Scripted chat: answers on stdout, header and stats on stderr, /exit ends it."""
    script = f"{QUESTION}\n/stats\n/set temperature 2\n/save {tmp_path / 's.s4r'}\n/exit\nnot asked\n"
    env = {**os.environ, "S4R_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("S4R_DEBUG", None)
    cmd = [sys.executable, "-c", FAKE_LAUNCHER, "chat", "--file", str(book)]
    p = subprocess.run(cmd, input=script.encode(), capture_output=True, env=env, cwd=tmp_path, timeout=60,
                       check=False)
    out, err = p.stdout.decode(), p.stderr.decode()
    assert p.returncode == 0, err
    assert out == "The passphrase is blue-harbor-42.\n"
    assert "KV cache" in err and "×4.80" in err and "TTFT" in err and "temperature = 2.0" in err
    assert (tmp_path / "s.s4r").is_file()
    assert "\x1b[" not in out + err  # no colour or cursor codes when not a terminal


def test_chat_stdin_document_needs_a_terminal_for_questions(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`--file -` makes stdin the document; the questions must then come from a terminal."""
    from s4r_cli import repl

    monkeypatch.setattr(repl, "open_terminal", lambda: None)
    assert run(["chat", "-f", "-"]) == 2
    assert "no terminal to read questions from" in capsys.readouterr().err
