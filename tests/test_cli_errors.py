"""Every bad input gets one clear line on stderr, the right exit code, and never a traceback.

The CLI runs in a real subprocess (exit codes, stderr and signals as a user sees them) with the library
replaced by the fakes in test_cli_fakes.py, so no model is loaded and each case takes well under a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_fixtures import QUESTION
from tests.test_cli_fakes import FAKE_CONTEXT, FAKE_LAUNCHER, REPO_ROOT


def run_cli(*args: str, cwd: Path, stdin: bytes | None = None, env: dict[str, str] | None = None,
            fakes: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `s4r ARGS` (with the fake library unless fakes=False) and capture everything."""
    cmd = [sys.executable, "-c", FAKE_LAUNCHER, *args] if fakes else [sys.executable, "-m", "s4r_cli", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "S4R_DEBUG"}
    full_env.update({"S4R_HOME": str(cwd / "home"), "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    p = subprocess.run(cmd, cwd=cwd, input=stdin if stdin is not None else b"", capture_output=True,
                       env=full_env, timeout=timeout, check=False)
    return _decode(p)


def _decode(p: subprocess.CompletedProcess[bytes]) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(errors="replace"),
                                       p.stderr.decode(errors="replace"))


def assert_one_error(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """Exit code `code`, exactly one stderr line starting `s4r:`, containing every needle, no traceback."""
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("s4r: "), lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), f"{needle!r} not in {lines[0]!r}"
    assert p.returncode == code, (p.returncode, lines[0])
    return lines[0]


@pytest.fixture
def book(tmp_path: Path) -> Path:
    path = tmp_path / "book.txt"
    path.write_text("Once upon a time the secret passphrase is 'blue-harbor-42'. The end.\n")
    return path


# -- input files ---------------------------------------------------------------------------------------------

def test_missing_file(tmp_path: Path) -> None:
    p = run_cli("ask", QUESTION, "--file", "nope.txt", cwd=tmp_path)
    assert_one_error(p, 2, "file not found: nope.txt")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    p = run_cli("ask", QUESTION, "--file", "adir", cwd=tmp_path)
    assert_one_error(p, 2, "adir is a directory")


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    assert_one_error(run_cli("ask", QUESTION, "-f", "empty.txt", cwd=tmp_path), 2, "empty.txt is empty")


def test_whitespace_only_file(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text("  \n\n\t \n")
    assert_one_error(run_cli("ask", QUESTION, "-f", "blank.txt", cwd=tmp_path), 2, "only whitespace")


def test_empty_stdin(tmp_path: Path) -> None:
    assert_one_error(run_cli("ask", QUESTION, cwd=tmp_path, stdin=b""), 2, "stdin", "empty")


def test_binary_file(tmp_path: Path) -> None:
    (tmp_path / "img.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    assert_one_error(run_cli("ask", QUESTION, "-f", "img.bin", cwd=tmp_path), 2, "binary")


def test_non_utf8_file(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("Café crème, déjà vu.\n".encode("latin-1"))
    p = run_cli("ask", QUESTION, "-f", "latin1.txt", cwd=tmp_path)
    line = assert_one_error(p, 2, "not UTF-8", "iconv")
    assert "0xe9" in line  # names the offending byte


def test_utf8_bom_and_utf16_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfthe secret passphrase is 'bom-1'.")
    (tmp_path / "u16.txt").write_bytes("the secret passphrase is 'u16-2'.".encode("utf-16"))
    for name, expected in (("bom.txt", "bom-1"), ("u16.txt", "u16-2")):
        p = run_cli("ask", QUESTION, "-f", name, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert expected in p.stdout


def test_huge_file_refused_without_reading(tmp_path: Path) -> None:
    with open(tmp_path / "huge.txt", "wb") as f:
        f.truncate(257 * 2**20)  # sparse: instant, and the size check must come before any read
    assert_one_error(run_cli("ask", QUESTION, "-f", "huge.txt", cwd=tmp_path), 2, "huge.txt", "256.0 MiB")


# -- options -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", ["0.5", "0", "-3", "nan", "inf", "5000"])
def test_bad_ratio(tmp_path: Path, book: Path, ratio: str) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--ratio", ratio, cwd=tmp_path)
    assert_one_error(p, 2, "--ratio")


def test_ratio_not_a_number(tmp_path: Path, book: Path) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--ratio", "lots", cwd=tmp_path)
    assert_one_error(p, 2, "--ratio")


def test_unknown_option(tmp_path: Path, book: Path) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--frobnicate", cwd=tmp_path)
    assert_one_error(p, 2, "--frobnicate")


def test_missing_question(tmp_path: Path) -> None:
    assert_one_error(run_cli("ask", cwd=tmp_path), 2, "QUESTION")


def test_empty_question(tmp_path: Path, book: Path) -> None:
    assert_one_error(run_cli("ask", "  ", "-f", str(book), cwd=tmp_path), 2, "question is empty")


@pytest.mark.parametrize(("option", "value"), [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5"),
                                               ("--max-new-tokens", "0"), ("--device", "gpu"),
                                               ("--dtype", "int3"), ("--method", "magic")])
def test_bad_generation_and_model_options(tmp_path: Path, book: Path, option: str, value: str) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), option, value, cwd=tmp_path)
    assert_one_error(p, 2, value)


@pytest.mark.parametrize("factor", ["0.5", "1", "9", "nan"])
def test_bad_rope_scaling(tmp_path: Path, book: Path, factor: str) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--rope-scaling", factor, cwd=tmp_path)
    assert_one_error(p, 2, "--rope-scaling", factor)


def test_load_and_file_together(tmp_path: Path, book: Path) -> None:
    p = run_cli("chat", "--file", str(book), "--load", "x.s4r", cwd=tmp_path)
    assert_one_error(p, 2, "--load cannot be combined with --file")


# -- models and devices --------------------------------------------------------------------------------------

def test_unknown_model_name_is_usage_error(tmp_path: Path, book: Path) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--model", "gpt-17", cwd=tmp_path)
    assert_one_error(p, 2, "unknown model 'gpt-17'", "s4r models")


def test_missing_model_path_is_usage_error(tmp_path: Path, book: Path) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--model", "./weights/model.gguf", cwd=tmp_path)
    assert_one_error(p, 2, "model not found")


def test_unloadable_hub_model_is_runtime_error(tmp_path: Path, book: Path) -> None:
    p = run_cli("ask", QUESTION, "-f", str(book), "--model", "fail/model", cwd=tmp_path)
    assert_one_error(p, 1, "fail/model")


def test_cuda_without_gpu(tmp_path: Path, book: Path) -> None:
    """A device that is not there is bad input: exit 2, as the README says."""
    p = run_cli("ask", QUESTION, "-f", str(book), "--device", "cuda", cwd=tmp_path)
    assert_one_error(p, 2, "no CUDA GPU")


def test_cuda_without_gpu_real_library(tmp_path: Path, book: Path) -> None:
    """The real resolve_device (no model is loaded: the device is checked first)."""
    pytest.importorskip("s4r.models.loading", reason="s4r.models.loading not written yet")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = run_cli("ask", QUESTION, "-f", str(book), "--device", "cuda", cwd=tmp_path, fakes=False)
    assert_one_error(p, 2, "cuda")


# -- saved caches --------------------------------------------------------------------------------------------

def test_missing_saved_cache(tmp_path: Path) -> None:
    assert_one_error(run_cli("ask", QUESTION, "--load", "gone.s4r", cwd=tmp_path), 2, "not found: gone.s4r")


def test_corrupt_saved_cache(tmp_path: Path) -> None:
    (tmp_path / "bad.s4r").write_bytes(b"\x00garbage" * 10)
    assert_one_error(run_cli("ask", QUESTION, "--load", "bad.s4r", cwd=tmp_path), 1, "bad.s4r")


def test_mismatched_saved_cache(tmp_path: Path, book: Path) -> None:
    from tests.test_cli_fakes import FakeLoaded, FakeSession

    other = FakeSession(FakeLoaded(name="tiny-test"))
    other.ingest(book.read_text())
    other.save(tmp_path / "other.s4r")
    p = run_cli("ask", QUESTION, "--load", "other.s4r", cwd=tmp_path)
    assert_one_error(p, 1, "tiny-test")


# -- documents too long, bugs, Ctrl-C, pipes -----------------------------------------------------------------

def test_document_longer_than_context(tmp_path: Path) -> None:
    words = FAKE_CONTEXT + 500
    (tmp_path / "long.txt").write_text("word " * words)
    # too long without --truncate is bad input: exit 2
    line = assert_one_error(run_cli("ask", QUESTION, "-f", "long.txt", cwd=tmp_path), 2, "--truncate")
    assert f"{words:,}" in line and f"{FAKE_CONTEXT:,}" in line  # names both numbers
    assert "--rope-scaling FACTOR" in line
    ok = run_cli("ask", QUESTION, "-f", "long.txt", "--truncate", "head", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_rope_scaling_lets_a_long_document_in_with_one_warning(tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("word " * (FAKE_CONTEXT + 500))
    p = run_cli("ask", QUESTION, "-f", "long.txt", "--rope-scaling", "2", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    warning = (f"s4r: warning: RoPE scaling x2 extends the context to {2 * FAKE_CONTEXT:,} tokens; "
               "answer quality may drop")
    assert p.stderr.splitlines() == [warning]


def test_internal_error_is_one_line(tmp_path: Path, book: Path) -> None:
    assert_one_error(run_cli("ask", "BOOM", "-f", str(book), cwd=tmp_path), 1, "internal error", "fake bug")


def test_internal_error_traceback_with_debug(tmp_path: Path, book: Path) -> None:
    p = run_cli("ask", "BOOM", "-f", str(book), cwd=tmp_path, env={"S4R_DEBUG": "1"})
    assert p.returncode == 1
    assert "Traceback" in p.stderr and "fake bug" in p.stderr


def _sigint_when_marked(args: list[str], tmp_path: Path) -> tuple[int, str, str]:
    marker = tmp_path / "marker"
    env = {**os.environ, "S4R_HOME": str(tmp_path / "home"), "S4R_FAKE_MARKER": str(marker)}
    # A suite started in the background (`nohup pytest &`, some CI runners) inherits SIGINT ignored, and
    # Python then never turns SIGINT into KeyboardInterrupt: the child ran on and exited 0. Restore the
    # default so the child gets what a terminal's Ctrl-C gives it.
    proc = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCHER, *args], cwd=tmp_path, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # generous waits for a loaded machine (startup and imports can take tens of seconds there)
    deadline = time.monotonic() + 180
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode(), err.decode()


def test_ctrl_c_while_loading_exits_130(tmp_path: Path, book: Path) -> None:
    code, out, err = _sigint_when_marked(["ask", QUESTION, "-f", str(book), "-m", "slow/model"], tmp_path)
    assert code == 130
    assert "Traceback" not in err and len(err.splitlines()) <= 1


def test_ctrl_c_while_answering_exits_130_with_partial_answer(tmp_path: Path, book: Path) -> None:
    code, out, err = _sigint_when_marked(["ask", "SLEEP", "-f", str(book)], tmp_path)
    assert code == 130
    assert "Traceback" not in err
    assert out.startswith("You")  # the partial answer was kept


def test_closed_pipe_is_quiet(tmp_path: Path, book: Path) -> None:
    """`s4r ask ... | head -c 20`: no traceback, no message, exit 141 like other tools cut off by a pipe.

    The answer must be longer than the pipe's buffer (64 KiB on Linux), or under load the writer can put
    all of it into the pipe before the reader closes its end, never see EPIPE and rightly exit 0 (the
    default -n 512 gives only 51 KiB). -n 20000 lets all ~1 MB through.
    """
    env = {**os.environ, "S4R_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-c", FAKE_LAUNCHER, "ask", "LONG", "-n", "20000", "-f", str(book)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    head = proc.stdout.read(20)
    time.sleep(0.5)  # a slow reader, as under load: the writer must still meet the closed pipe
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=30)
    assert head == b"x" * 20
    assert err == ""
    assert proc.returncode == 141


def test_closed_pipe_in_a_shell_pipeline(tmp_path: Path, book: Path) -> None:
    cmd = f"{sys.executable} -c \"$LAUNCHER\" ask LONG -n 20000 -f {book} | head -c 20"
    env = {**os.environ, "S4R_HOME": str(tmp_path / "home"), "LAUNCHER": FAKE_LAUNCHER}
    p = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, timeout=60,
                       check=False)
    assert p.stdout == b"x" * 20
    assert p.stderr == b""
    assert p.returncode == 0
