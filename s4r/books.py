"""Public-domain books shipped inside the package, plus any a user adds with ``$S4R_BOOKS_DIR``.

Two Project Gutenberg texts ship xz-compressed in ``s4r/data/`` (Pride and Prejudice, Romeo and Juliet;
each file keeps Gutenberg's header and license), beside ``saltmere``, a short invented letter the
README's first command asks about, so that command, the tests and ``s4r bench --quick`` work on a fresh
clone or an installed package with nothing beside it. A folder named by ``$S4R_BOOKS_DIR``
may add more books (``NAME.txt`` or ``NAME.txt.xz``); a book there wins over a shipped one of the same name.
"""

from __future__ import annotations

import functools
import lzma
import os
import re
from dataclasses import dataclass
from pathlib import Path

from s4r.errors import S4RError

BOOKS_ENV = "S4R_BOOKS_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent / "data"
SUFFIXES = (".txt.xz", ".txt")

__all__ = ["BOOKS_ENV", "SHIPPED_DIR", "Book", "BookNotFoundError", "book_body", "book_text", "find_book",
           "list_books", "read_book", "strip_gutenberg"]


class BookNotFoundError(S4RError):
    """No book of that name, shipped or in $S4R_BOOKS_DIR."""


@dataclass(frozen=True)
class Book:
    """A book that can be read by name: where its file is and whether it ships with s4r."""

    name: str
    path: Path
    shipped: bool


def _folders() -> list[tuple[Path, bool]]:
    """Where books are looked up, first match wins: $S4R_BOOKS_DIR, then the shipped folder."""
    folders: list[tuple[Path, bool]] = []
    env = os.environ.get(BOOKS_ENV)
    if env:
        folders.append((Path(env).expanduser(), False))
    folders.append((SHIPPED_DIR, True))
    return folders


def _stem(path: Path) -> str | None:
    for suffix in SUFFIXES:
        if path.name.endswith(suffix):
            return path.name[: -len(suffix)]
    return None


def list_books() -> list[Book]:
    """Every book that can be named, sorted by name (an added book hides a shipped one of its name)."""
    found: dict[str, Book] = {}
    for folder, shipped in _folders():
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            name = _stem(path)
            if name and path.is_file() and name not in found:
                found[name] = Book(name, path, shipped)
    return sorted(found.values(), key=lambda b: b.name)


def find_book(name: str) -> Book:
    """The book called ``name`` (a file stem such as ``pride-and-prejudice``); BookNotFoundError if none."""
    for folder, shipped in _folders():
        for suffix in SUFFIXES:
            path = folder / f"{name}{suffix}"
            if path.is_file():
                return Book(name, path, shipped)
    known = ", ".join(b.name for b in list_books()) or "none"
    raise BookNotFoundError(f"no book named '{name}' (known: {known}; ${BOOKS_ENV} may add a folder of "
                            ".txt files)")


@functools.lru_cache(maxsize=8)
def _read_path(path: Path) -> str:
    if path.name.endswith(".xz"):
        with lzma.open(path, "rt", encoding="utf-8-sig") as f:
            return f.read().replace("\r\n", "\n")
    return path.read_text(encoding="utf-8-sig").replace("\r\n", "\n")


def read_book(name: str) -> str:
    """The whole file of book ``name`` as text, Gutenberg header and license included."""
    return _read_path(find_book(name).path)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg file: the text between its START and END lines."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF.*$", text, flags=re.MULTILINE)
    end = re.search(r"^\*\*\* ?END OF.*$", text, flags=re.MULTILINE)
    lo = start.end() if start else 0
    hi = end.start() if end else len(text)
    return text[lo:hi].strip()


def book_body(name: str) -> str:
    """Book ``name`` without Gutenberg's header and footer (line breaks as in the file)."""
    return strip_gutenberg(read_book(name))


@functools.lru_cache(maxsize=8)
def book_text(name: str) -> str:
    """Book ``name`` as clean prose, what a model should read: Gutenberg header and footer removed,
    illustration captions dropped (layout residue), hard line wraps inside a paragraph made spaces,
    paragraphs separated by one blank line."""
    body = book_body(name)
    # captions span blank lines (and may hold a bracketed copyright line): remove before splitting
    body = re.sub(r"\[Illustration(?:[^\[\]]|\[[^\[\]]*\])*\]", "", body)
    paragraphs = [" ".join(block.split()) for block in re.split(r"\n[ \t]*\n", body)]
    return "\n\n".join(p for p in paragraphs if p)


DEFAULT_BOOK = "pride-and-prejudice"


@functools.lru_cache(maxsize=4)
def load_book(name: str = DEFAULT_BOOK) -> str:
    """:func:`book_text`, cached (the bench and the offline calibration read the same books again and
    again). ``name`` is the file stem, e.g. ``"romeo-and-juliet"``."""
    return book_text(name)


def books_dir() -> Path:
    """The folder books are read from first: ``$S4R_BOOKS_DIR`` when set, else the books shipped inside the
    package (``s4r/data``)."""
    env = os.environ.get(BOOKS_ENV)
    return Path(env).expanduser() if env else SHIPPED_DIR
