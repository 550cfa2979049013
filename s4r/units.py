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


# suffixes of parse_size: K, M, G, T are binary (as `ls -h` and the other local servers read them)
_SIZE_SUFFIXES = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": MIB, "MB": MIB, "MIB": MIB,
                  "G": GIB, "GB": GIB, "GIB": GIB, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_size(text: str) -> int:
    """A byte count from "512M", "2G", "1.5GiB" or a plain number of bytes; ValueError otherwise."""
    s = str(text).strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    suffix = s[len(number):]
    if not number or suffix not in _SIZE_SUFFIXES:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 2G or a number of bytes)")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 2G or a number of bytes)") from None
    if value < 0 or value != value or value == float("inf"):
        raise ValueError(f"not a size: {text!r} (a size is at least 0)")
    return int(value * _SIZE_SUFFIXES[suffix])
