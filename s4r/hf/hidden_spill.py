"""Where a layer-wise ingest keeps the document's hidden states between layers: memory, or a temp file.

A layer-wise ingest must keep the hidden states of the whole text (tokens x hidden size) from one layer
to the next: 35 MiB at 32k tokens on SmolLM2, a fifth of what it otherwise holds above its compressed
cache. Each layer reads them block by block and writes each block's output back in its place, so they
can live in a file instead: one block is in memory at a time, for one read and one write of the file
per layer. The file is read and written with plain read()/write() calls, not mapped (mapped pages would
count in the process's resident set again), and it has no name from the start (an unlinked temp file),
so nothing is left behind on any exit path, a killed process included.
"""

from __future__ import annotations

import os
import tempfile
from typing import Protocol

import torch

SPILL_MODES: tuple[str, ...] = ("auto", "on", "off")
# "auto" spills hidden states of at least this size: below it the saving is lost in the few MiB a
# process's peak moves between runs, and a file and two system calls per block buy nothing
SPILL_MIN_BYTES = 4 * 2**20
# file systems whose files are memory: a spill there frees the process's resident set, not the machine's
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
MOUNTS_FILE = "/proc/self/mounts"
FILE_PREFIX = "s4r-hidden-"


class HiddenStates(Protocol):
    """The hidden states [1, tokens, width] of a text, read and written a block of tokens at a time."""

    def read(self, begin: int, end: int) -> torch.Tensor: ...

    def write(self, begin: int, block: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class HiddenInMemory:
    """All hidden states in one tensor; `read` gives a view, `write` fills the rows in place."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    def read(self, begin: int, end: int) -> torch.Tensor:
        return self.hidden[:, begin:end]

    def write(self, begin: int, block: torch.Tensor) -> None:
        self.hidden[:, begin:begin + block.shape[1]] = block

    def close(self) -> None:
        self.hidden = None


class HiddenSpill:
    """Hidden states of `tokens` rows of `width` in an unnamed temporary file in `directory` (default:
    the system's temp dir); blocks come back on `device`. Close it (or use it in a `with`) when done:
    the file's space is freed when it is closed or the process ends, whichever comes first."""

    def __init__(self, tokens: int, width: int, dtype: torch.dtype, device: torch.device,
                 directory: str | None = None) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self.row_bytes = width * torch.empty(0, dtype=dtype).element_size()
        self.nbytes = tokens * self.row_bytes
        # unbuffered: each block is one read()/write() straight from/into the tensor's memory; the file
        # outlives this call (close() or the `with` this object is used in ends it)
        self.file = tempfile.TemporaryFile(prefix=FILE_PREFIX, dir=directory, buffering=0)  # noqa: SIM115

    def write(self, begin: int, block: torch.Tensor) -> None:
        """Store `block` [1, n, width] as rows begin..begin+n-1."""
        data = _as_bytes(block.detach().to("cpu", self.dtype).contiguous())
        self.file.seek(begin * self.row_bytes)
        done = 0
        while done < len(data):  # a raw write may take only part of the buffer
            done += self.file.write(data[done:])

    def read(self, begin: int, end: int) -> torch.Tensor:
        """Rows begin..end-1 as a new tensor [1, end - begin, width] on the device."""
        block = torch.empty(1, end - begin, self.width, dtype=self.dtype)
        data = _as_bytes(block)
        self.file.seek(begin * self.row_bytes)
        done = 0
        while done < len(data):
            got = self.file.readinto(data[done:])
            if not got:
                raise OSError(f"hidden-state file ended {len(data) - done} bytes early")
            done += got
        return block.to(self.device)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> HiddenSpill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared with it (numpy has no bfloat16: go through uint8)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def spill_wanted(mode: str, tokens: int, width: int, dtype: torch.dtype, device: torch.device,
                 directory: str | None = None) -> bool:
    """Whether a layer-wise ingest of `tokens` should keep its hidden states in a file.

    "on" and "off" decide; "auto" spills on CPU when the hidden states take at least `SPILL_MIN_BYTES`
    and the temp dir is on a disk. Not on a GPU (each block would go through host memory and stall the
    device, for device memory one layer's K/V already dwarfs), nor onto tmpfs (the file would be in
    memory all the same, only no longer counted in the process's resident set).
    """
    if mode not in SPILL_MODES:
        raise ValueError(f"unknown hidden-state spill mode '{mode}' (choose {', '.join(SPILL_MODES)})")
    if mode != "auto":
        return mode == "on"
    nbytes = tokens * width * torch.empty(0, dtype=dtype).element_size()
    return (device.type == "cpu" and nbytes >= SPILL_MIN_BYTES
            and filesystem_type(directory or tempfile.gettempdir()) not in RAM_FILESYSTEMS)


def filesystem_type(path: str, mounts_file: str = MOUNTS_FILE) -> str | None:
    """The type of the file system `path` is on ("ext4", "tmpfs", ...), from the mount table; None
    where there is none to read (not Linux)."""
    try:
        with open(mounts_file, encoding="utf-8") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) >= 3]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, kind = "", None
    for point, fstype in entries:
        point = point.replace("\\040", " ")  # the table escapes spaces
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind
