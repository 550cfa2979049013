"""The README's promises that tests can hold it to: its first commands, CI running the same test command,
the exit codes it documents, the documents it links, and the size of the documentation."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from s4r.books import list_books
from s4r_cli import app

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def _first_commands() -> tuple[str, str]:
    block = README.split("```bash", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return lines[0], lines[1]


def test_command_one_needs_nothing_beside_the_clone() -> None:
    first, _ = _first_commands()
    assert "../" not in first and "shared" not in first
    book = re.search(r"--book (\S+)", first)
    assert book and book.group(1) in {b.name for b in list_books()}  # a book that ships in the package


def test_command_one_prints_the_answer_alone() -> None:
    """Every install step of command 1 is quiet on stdout, so what it prints is the answer of `s4r ask`
    (its notices and -v figures go to stderr)."""
    first, _ = _first_commands()
    steps = [step.strip() for step in first.split("&&")]
    installs = [step for step in steps if "pip install" in step]
    assert installs and all(" -q" in step and ">/dev/null" in step for step in installs)
    assert steps[-1].startswith("s4r ask ") and "--json" not in steps[-1]


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "full"])
def test_command_one_answers_what_the_readme_says(smollm2: object, method: str | None) -> None:
    """The `s4r ask` of command 1, run as written (compressed at the default ratio, and with the full cache
    the README says answers the same): stdout is the answer the README quotes, stderr one notice.
    (`smollm2` converts the embedded model first, so no first-run download line reaches stderr.)"""
    first, _ = _first_commands()
    argv = shlex.split(first.split("&&")[-1])
    assert argv[:2] == ["s4r", "ask"]
    quoted = re.search(r"Command 1 prints the answer alone on stdout, `([^`]+)`", README)
    assert quoted
    extra = ["--method", method] if method else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "s4r_cli", *argv[1:], *extra], capture_output=True, text=True,
                       env=env, timeout=600, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == quoted.group(1)
    notices = p.stderr.strip().splitlines()
    assert len(notices) == 1 and "token limit" in notices[0], p.stderr


def test_the_linked_documents_exist() -> None:
    links = set(re.findall(r"\]\(((?:docs/)?[A-Za-z_-]+\.md)\)", README))
    docs = {"docs/design.md", "docs/cli.md", "docs/library.md", "docs/architecture.md", "BENCHMARKS.md"}
    assert docs <= links
    assert all((REPO_ROOT / link).is_file() for link in links)


def test_the_documentation_stays_short() -> None:
    assert len(README.splitlines()) <= 200
    assert len((REPO_ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()) <= 300
    assert len([p for p in (REPO_ROOT / "docs").rglob("*") if p.is_file()]) <= 25


def test_ci_runs_the_readme_test_command() -> None:
    _, second = _first_commands()
    test_command = second.split("&&")[-1].strip()
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1].strip() == test_command


def test_exit_codes_table_matches_the_cli() -> None:
    table = dict(re.findall(r"^\| (\d+) \| (.+) \|$", README, flags=re.MULTILINE))
    assert set(table) == {str(c) for c in (app.EXIT_OK, app.EXIT_RUNTIME, app.EXIT_USAGE,
                                           app.EXIT_INTERRUPTED, app.EXIT_PIPE)}
    for case in ("--device cuda", "--ratio", "longer than the context"):
        assert case in table["2"]
