"""Memory figures: KV bytes of a cache, and what the process really holds (RSS, CUDA allocations)."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

STATUS_FILE = "/proc/self/status"
CLEAR_REFS_FILE = "/proc/self/clear_refs"


@dataclass(frozen=True)
class MemoryReport:
    """Stored KV bytes against the uncompressed cache of the same model, dtype and length."""

    stored_bytes: int
    full_bytes: int
    tokens: int

    @property
    def ratio(self) -> float:
        """Achieved compression ratio (full / stored)."""
        return self.full_bytes / self.stored_bytes if self.stored_bytes else 1.0


def _status_kib(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), or None where there is no such file or field."""
    try:
        with open(STATUS_FILE, encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """The process's resident set size now (Linux), or None where it cannot be read."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """The process's peak resident set size: since the last `reset_peak_memory` where the kernel allows
    resetting it (Linux VmHWM), else since the process started."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """The process's measured peak: CUDA memory allocated on a GPU device, else peak resident set size.

    Both count everything the process holds (weights, activations, cache, allocator slack), not only
    the cache; `reset_peak_memory` starts a new measurement.
    """
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


@dataclass(frozen=True)
class ProcessMemory:
    """What the whole process holds: its measured peak and its size now, and what they count."""

    peak_bytes: int
    current_bytes: int | None
    kind: str  # "RSS" (resident set, CPU) or "CUDA allocated"


def process_memory(device: torch.device | None = None) -> ProcessMemory:
    """The process's measured peak and current memory on `device` (see `peak_memory_bytes`)."""
    kind = "CUDA allocated" if device is not None and device.type == "cuda" else "RSS"
    return ProcessMemory(peak_memory_bytes(device), current_memory_bytes(device), kind)


def current_memory_bytes(device: torch.device | None = None) -> int | None:
    """What the process holds now: CUDA memory allocated on a GPU device, else the resident set size."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


def reset_peak_memory(device: torch.device | None = None) -> bool:
    """Start a new peak measurement; False where the peak RSS cannot be reset (it then stays the
    process-lifetime peak). CUDA peaks can always be reset."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        # "5" resets the peak RSS (VmHWM) to the current RSS (Linux 4.0+)
        with open(CLEAR_REFS_FILE, "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


# glibc's mallopt parameter number of the mmap threshold (malloc.h)
M_MMAP_THRESHOLD = -3
# allocations at least this big get their own mapping, returned to the OS as soon as they are freed
MMAP_THRESHOLD_BYTES = 256 * 1024


@lru_cache(maxsize=1)
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc only; musl and others lack them
        return libc
    except (OSError, AttributeError):
        return None


def _malloc_trim():
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


@lru_cache(maxsize=1)
def bound_heap_growth() -> bool:
    """Keep large freed buffers from piling up in the heap (glibc): fix the mmap threshold.

    By default glibc raises its mmap threshold to the largest buffer freed so far, so the activations
    of a long prefill (a little bigger at every block, as the keys grow) come from the heap, and the
    freed ones can rarely be reused or given back: the process grows by several MiB per block even
    though the live tensors do not. A fixed threshold maps each large buffer on its own and unmaps it
    when freed. Process-wide and permanent (glibc has no way back to the sliding threshold); returns
    whether it could be set.
    """
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_freed_memory(device: torch.device | None = None) -> bool:
    """Give freed heap pages back to the OS (glibc `malloc_trim`) and, on CUDA, cached blocks back to
    the driver, so the process's memory shrinks after a large staging buffer is freed.

    Returns whether the host heap could be trimmed (False on non-glibc platforms).
    """
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
