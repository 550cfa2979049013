"""Fixtures and constants the CLI tests share (registered for every test module by tests/conftest.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from tests.test_cli_fakes import install_fakes

QUESTION = "What is the secret passphrase?"
DOC = "Long ago, in a harbour town, the secret passphrase is 'blue-harbor-42'. Nobody remembered it."
# what `s4r ask --json` must always print
JSON_KEYS = {"answer", "model", "method", "ratio_requested", "ratio_achieved", "kv_bytes", "kv_full_bytes",
             "prompt_tokens", "generated_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_mem_bytes",
             "ingest_s", "document_tokens", "device", "dtype"}


@pytest.fixture
def cli_fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The fake library in place of the real one, a fresh $S4R_HOME, and tmp_path as the working folder.

    A module of CLI tests uses it for every test with ``pytestmark = pytest.mark.usefixtures("cli_fakes")``.
    """
    install_fakes(monkeypatch)
    monkeypatch.setenv("S4R_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def book(tmp_path: Path) -> Path:
    """A short document (DOC) holding the passphrase."""
    path = tmp_path / "book.txt"
    path.write_text(DOC)
    return path


def pipe_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """Make ``data`` what the test's process reads on stdin."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
