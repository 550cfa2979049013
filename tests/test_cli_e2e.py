"""End to end with the real SmolLM2-135M: a needle in a ~3k-token excerpt of Pride and Prejudice.

Slow (each CLI run loads the model and prefills the excerpt on CPU). The `smollm2` fixture from
conftest.py loads the model once; it also makes sure the converted model is cached for the subprocesses.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from s4r.books import read_book
from tests.cli_fixtures import JSON_KEYS, QUESTION

pytestmark = pytest.mark.slow

NEEDLE = "The secret passphrase is 'blue-harbor-42'."
ANSWER = "blue-harbor-42"
MAX_NEW = "32"


@pytest.fixture(scope="module")
def excerpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Chapters 1-3 or so (~12k characters, ~3k tokens) with the needle halfway, at a paragraph break."""
    text = read_book("pride-and-prejudice")
    start = text.index("It is a truth universally acknowledged")
    paragraphs = text[start:start + 12_000].split("\n\n")
    paragraphs.insert(len(paragraphs) // 2, NEEDLE)
    path = tmp_path_factory.mktemp("e2e") / "excerpt.txt"
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    return path


def s4r(*args: str, stdin: bytes = b"", timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess (stdout/stderr are pipes, so no colour or progress bars)."""
    env = {k: v for k, v in os.environ.items() if k != "S4R_DEBUG"}
    p = subprocess.run([sys.executable, "-m", "s4r_cli", *args], input=stdin, capture_output=True, env=env,
                       timeout=timeout, check=False)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())


@pytest.mark.parametrize("method", ["full", "s4r"])
def test_ask_file_finds_the_needle(smollm2: object, excerpt: Path, method: str) -> None:
    """`full` checks the CLI's plumbing alone; `s4r` at ratio 2.5 is the library's needle claim (at 5 this
    word passphrase in a 3k-token excerpt is lost: SmolLM2's 192-wide KV leaves too little rank)."""
    p = s4r("ask", QUESTION, "--file", str(excerpt), "-n", MAX_NEW, "--method", method, "--ratio", "2.5")
    assert p.returncode == 0, p.stderr
    # only the answer, on stdout; stderr at most says the answer reached -n
    cut = f"s4r: the answer stopped at the token limit ({MAX_NEW} tokens); --max-new-tokens N raises it\n"
    assert p.stderr in ("", cut)
    assert ANSWER in p.stdout, p.stdout


def test_ask_stdin_finds_the_needle(smollm2: object, excerpt: Path) -> None:
    p = s4r("ask", QUESTION, "-n", MAX_NEW, "--ratio", "2.5", stdin=excerpt.read_bytes())
    assert p.returncode == 0, p.stderr
    assert ANSWER in p.stdout, p.stdout


def test_ask_json_has_every_key(smollm2: Any, excerpt: Path) -> None:
    p = s4r("ask", QUESTION, "--file", str(excerpt), "-n", MAX_NEW, "--json")
    assert p.returncode == 0, p.stderr
    record = json.loads(p.stdout)
    assert set(record) >= JSON_KEYS
    assert record["method"] == "s4r" and record["ratio_requested"] == 5.0
    # the uncompressed size is the model's shape times the tokens, computed here from the config: layers x
    # (K and V) x kv heads x head dim x bytes per value
    config = smollm2.model.config
    value_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[record["dtype"]]
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * value_bytes
    assert record["kv_full_bytes"] == per_token * record["kv_tokens"]
    # and the stored cache meets the requested ratio
    assert 0 < record["kv_bytes"] <= record["kv_full_bytes"] / record["ratio_requested"]
    assert record["ratio_achieved"] >= record["ratio_requested"]
    assert record["document_tokens"] > 2000 and record["generated_tokens"] > 0
    assert record["answer"].strip()


def test_save_in_repl_then_load_gives_the_same_answer(smollm2: object, excerpt: Path, tmp_path: Path) -> None:
    """/save from a REPL over a real session, then `s4r ask --load` in a new process, same question; both
    on one thread (a split kernel sums in another order, and a greedy answer may follow it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        in_repl, cache = _repl_answer_after_save(smollm2, excerpt, tmp_path)
    finally:
        torch.set_num_threads(before)
    p = s4r("ask", QUESTION, "--load", str(cache), "-n", MAX_NEW, "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == in_repl


def _repl_answer_after_save(smollm2: object, excerpt: Path, tmp_path: Path) -> tuple[str, Path]:
    """A REPL's answer to QUESTION over `excerpt`, asked after `/save`, and the saved file."""
    from s4r.runtime.session import Session
    from s4r_cli.generation_settings import GenerationSettings
    from s4r_cli.repl import ChatState, CommandHandler
    from s4r_cli.ui import UI

    session = Session(smollm2)
    stats = session.ingest(excerpt.read_text(), name=excerpt.name)
    buffer = io.StringIO()
    ui = UI(out=buffer, info=Console(file=io.StringIO(), color_system=None))
    settings = GenerationSettings(max_new_tokens=int(MAX_NEW))
    state = ChatState(loaded=smollm2, session=session, settings=settings, load_kwargs={},
                      ingest_seconds=stats.seconds)
    handler = CommandHandler(state, ui)
    cache = tmp_path / "chat.s4r"
    assert handler.handle(f"/save {cache}") and cache.is_file()
    assert handler.handle(QUESTION)
    in_repl = buffer.getvalue().strip()
    assert in_repl
    return in_repl, cache


def test_load_refuses_a_cache_made_with_other_settings(smollm2: object, excerpt: Path,
                                                       tmp_path: Path) -> None:
    from s4r.runtime.session import Session

    session = Session(smollm2, ratio=8.0)
    session.ingest(excerpt.read_text()[:4000])  # any document will do; the settings are what differ
    cache = tmp_path / "r8.s4r"
    session.save(cache)
    p = s4r("ask", QUESTION, "--load", str(cache), "--ratio", "5")
    assert p.returncode == 1
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "ratio" in lines[0] and "Traceback" not in p.stderr
