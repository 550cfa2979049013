"""Reading the documents `chat` and `ask` ingest: files, stdin and shipped books, validated up front.

Every failure is one UsageError line (exit 2), raised before any model is loaded.
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from s4r.units import mib
from s4r_cli.cli_errors import UsageError

# Refuse bigger documents up front: even the longest-context models hold far less than this.
MAX_DOCUMENT_BYTES = 256 * 1024 * 1024
# Enough to tell text from binary; the same window `grep` and `git` look at.
BINARY_SNIFF_BYTES = 8192


@dataclass
class Document:
    """A validated text document ready to ingest."""

    name: str
    text: str


def decode_document(data: bytes, name: str) -> str:
    """Bytes -> text, or UsageError naming what is wrong (empty, binary, not UTF-8)."""
    if not data.strip():
        raise UsageError(f"{name} is empty" if not data else f"{name} contains only whitespace")
    # UTF-16 has NUL bytes by nature; with a BOM it is unambiguous, so accept it instead of calling it binary.
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise UsageError(f"{name} starts with a UTF-16 mark but is not UTF-16 ({e.reason})") from None
    else:
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            raise UsageError(f"{name} looks like a binary file (NUL bytes in its first 8 KiB); pass text")
        try:
            text = data.decode("utf-8-sig")  # -sig: drop the BOM some editors (and Gutenberg) write
        except UnicodeDecodeError as e:
            src = "the input" if name == "<stdin>" else name
            raise UsageError(
                f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason}); "
                f"convert it first, e.g. iconv -f latin1 -t utf-8 {src} > converted.txt") from None
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise UsageError(f"{name} contains only whitespace")
    return text


def read_document_file(path: str) -> Document:
    """Read and validate one document file; every failure is a one-line UsageError."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise UsageError(f"file not found: {path}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    if p.is_dir():
        raise UsageError(f"{path} is a directory, not a text file")
    if st.st_size > MAX_DOCUMENT_BYTES:
        raise UsageError(f"{path} is {mib(st.st_size)}; the limit is {mib(MAX_DOCUMENT_BYTES)} "
                         "(pass an excerpt instead)")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    return Document(name=path, text=decode_document(data, path))


def read_document_stream(stream: IO[bytes], name: str = "<stdin>") -> Document:
    """Read a document from a binary stream (stdin), refusing more than MAX_DOCUMENT_BYTES."""
    data = stream.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise UsageError(f"{name} is more than {mib(MAX_DOCUMENT_BYTES)}; pass an excerpt instead")
    if not data:
        raise UsageError(f"{name} is empty; pipe a document in or pass --file FILE")
    return Document(name=name, text=decode_document(data, name))


def read_documents(files: Sequence[str], *, stdin: IO[bytes] | None = None) -> list[Document]:
    """Read every --file (``-`` means stdin) in order. Validates all before returning any."""
    docs = []
    for f in files:
        if f == "-":
            if stdin is None:
                raise UsageError("--file - needs a document on stdin")
            docs.append(read_document_stream(stdin))
        else:
            docs.append(read_document_file(f))
    return docs


def read_book_documents(names: Sequence[str]) -> list[Document]:
    """The shipped (or $S4R_BOOKS_DIR) books named by --book, without their Gutenberg header and license."""
    if not names:
        return []
    from s4r.books import BookNotFoundError, book_text

    docs = []
    for name in names:
        try:
            docs.append(Document(name=name, text=book_text(name)))
        except BookNotFoundError as e:
            raise UsageError(str(e)) from None
    return docs


def stdin_bytes() -> IO[bytes] | None:
    """Binary stdin when something is piped in, None when stdin is a terminal or closed."""
    s = sys.stdin
    if s is None or s.closed:
        return None
    try:
        if s.isatty():
            return None
    except (OSError, ValueError):
        return None
    return s.buffer
