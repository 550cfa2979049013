"""The on-disk index of a cache directory: which document prefixes have a saved cache, for one model and
one set of settings (each such set has a folder of its own, named by a hash of them)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from s4r.distributed.rank_files import rank_path

INDEX_FORMAT = "s4r-serve-index/1"
INDEX_NAME = "index.json"


@dataclass
class SavedDocument:
    """What the index says about one saved document cache (`file` is relative to the folder)."""

    key: str
    length: int
    tokens: int
    name: str
    stored_bytes: int
    full_bytes: int
    file: str


def identity_folder(cache_dir: Path, identity: dict[str, Any]) -> Path:
    """The folder of `cache_dir` for caches made with `identity` (model fingerprint, method, settings)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / digest


def prefix_key(text: str) -> str:
    """The key of a document prefix: SHA-256 of its text."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def read_index(folder: Path) -> dict[str, SavedDocument]:
    """The saved documents of `folder` whose files are there (this rank's part of each, under torchrun);
    an unreadable index counts as empty."""
    path = folder / INDEX_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        docs = data["documents"] if data.get("format") == INDEX_FORMAT else {}
        found = {key: SavedDocument(key=key, **{k: v for k, v in rec.items() if k != "key"})
                 for key, rec in docs.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {key: doc for key, doc in found.items() if rank_path(folder / doc.file).is_file()}


def write_index(folder: Path, identity: dict[str, Any], docs: dict[str, SavedDocument]) -> None:
    """Write the index atomically (a crash leaves the old one or the new one, never half of it)."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {"format": INDEX_FORMAT, "identity": identity,
            "documents": {key: asdict(doc) for key, doc in docs.items()}}
    fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1, sort_keys=True)
        os.replace(tmp, folder / INDEX_NAME)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
