"""Memory figures: KV bytes of a cache and the process's peak memory."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch


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


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak CUDA memory allocated on a GPU device, else the process's peak resident set size."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return int(peak if sys.platform == "darwin" else peak * 1024)
