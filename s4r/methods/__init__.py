"""The KV-cache methods, one file each, behind one `make_method` factory."""

from __future__ import annotations

from typing import Any

from ..config import S4RConfig
from .base import CompressContext, Method
from .full import FullMethod
from .s4r import S4RMethod

METHODS: tuple[str, ...] = ("s4r", "s4r-paper", "full")


def make_method(name: str, ratio: float, overrides: dict[str, Any] | None = None) -> Method:
    """Build method `name` for a target `ratio`; `overrides` adjust S4R settings (see S4RConfig)."""
    if name == "full":
        return FullMethod()
    if name == "s4r":
        return S4RMethod(S4RConfig(ratio=ratio).with_overrides(overrides), name="s4r")
    if name == "s4r-paper":
        return S4RMethod(S4RConfig.paper(ratio).with_overrides(overrides), name="s4r-paper")
    raise ValueError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")


__all__ = ["METHODS", "CompressContext", "FullMethod", "Method", "S4RMethod", "make_method"]
