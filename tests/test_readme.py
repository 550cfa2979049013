"""The README's promises that tests can hold it to: its first commands, CI running the same test command,
and the exit codes it documents."""

from __future__ import annotations

import re
from pathlib import Path

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
    assert "--book pride-and-prejudice" in first


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
