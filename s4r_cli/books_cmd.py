"""`s4r books`: the books that ship with s4r (and any $S4R_BOOKS_DIR adds)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from s4r_cli.cli_errors import pipe_guard
from s4r_cli.ui import UI

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def books(as_json: JsonOpt = False) -> None:
    """List the books `--book NAME` can read (shipped inside the package; $S4R_BOOKS_DIR may add more)."""
    from s4r.books import BOOKS_ENV, book_body, list_books

    records = []
    for book in list_books():
        body = book_body(book.name)
        records.append({"name": book.name, "words": len(body.split()), "characters": len(body),
                        "shipped": book.shipped, "path": str(book.path)})
    with pipe_guard():
        if as_json:
            print(json.dumps(records, indent=2))
            return
        rows = [(r["name"], f"{r['words']:,}", "shipped" if r["shipped"] else f"${BOOKS_ENV}")
                for r in records]
        UI.for_report().table("books (use with --book NAME)", ["name", "words", "from"], rows)


def register(app: typer.Typer) -> None:
    """Add `books` to the app."""
    app.command()(books)
