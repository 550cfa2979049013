"""Where converted models live (``$S4R_HOME/models``) and how a finished folder is put there atomically.

A conversion is written into a hidden temp folder next to its final place and moved in with one rename once
its marker file is written, so a killed process never leaves a half folder that looks complete."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

__all__ = ["CACHE_FORMAT", "MARKER", "cache_ok", "clean_stale", "install_folder", "models_dir", "s4r_home",
           "sha256_file", "tmp_name"]

# Bumped when the layout of converted folders changes, so old caches are rebuilt rather than misread.
CACHE_FORMAT = 1
MARKER = "s4r-source.json"


def s4r_home() -> Path:
    """The folder s4r keeps converted models in: ``$S4R_HOME`` or ``~/.cache/s4r``."""
    return Path(os.environ.get("S4R_HOME") or "~/.cache/s4r").expanduser()


def models_dir() -> Path:
    """Where converted models are cached: ``s4r_home() / "models"``."""
    return s4r_home() / "models"


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_ok(folder: Path, key: str) -> bool:
    """Whether ``folder`` is a complete conversion of the source identified by ``key``."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("key") == key
        and marker.get("format") == CACHE_FORMAT
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def clean_stale(parent: Path) -> None:
    """Remove temp folders left by conversions whose process died (killed, power loss)."""
    for entry in parent.glob(".*-tmp-*"):
        match = re.search(r"-tmp-(\d+)-", entry.name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            if time.time() - entry.stat().st_mtime > 60:
                shutil.rmtree(entry, ignore_errors=True)


def tmp_name(parent: Path, label: str) -> Path:
    """A hidden temp folder name in ``parent`` holding our pid (clean_stale removes it once we are gone)."""
    return parent / f".{label}-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def install_folder(tmp: Path, final: Path, key: str) -> None:
    """Move a finished conversion into place atomically, replacing an outdated one."""
    if final.exists():
        trash = tmp_name(final.parent, final.name + "-old")
        os.replace(final, trash)
        try:
            os.replace(tmp, final)
        finally:
            shutil.rmtree(trash, ignore_errors=True)
        return
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process finished the same conversion first; theirs is as good as ours.
        if not cache_ok(final, key):
            raise

