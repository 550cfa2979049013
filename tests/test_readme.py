"""The README's promises that tests can hold it to: its first commands, CI running the same test command,
the exit codes it documents, the documents it links, and the size of the documentation."""

from __future__ import annotations

import re
from pathlib import Path

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
