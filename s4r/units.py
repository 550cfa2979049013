"""Byte counts for people: the one place s4r formats sizes (MiB and GiB, binary units)."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30


def mib(n: float) -> str:
    """Bytes as MiB with one decimal ("12.3 MiB")."""
    return f"{n / MIB:,.1f} MiB"


def gib(n: float) -> str:
    """Bytes as GiB with one decimal ("1.2 GiB")."""
    return f"{n / GIB:,.1f} GiB"


def memory_size(n: float) -> str:
    """Bytes in at most 9 characters: 31.8 MiB, 167 MiB, 1.2 GiB."""
    if n >= GIB:
        return gib(n)
    return f"{n / MIB:.0f} MiB" if n >= 100 * MIB else mib(n)
