"""The KV-cache methods, one file each, behind one `make_method` factory."""

from __future__ import annotations

from typing import Any

from ..config import S4RConfig
from .base import CompressContext, Method
from .full import FullMethod
from .offline import OfflineMethod
from .s4r import S4RMethod
from .snapkv import SnapKVMethod
from .streaming import StreamingMethod
from .svd import svd_method

METHODS: tuple[str, ...] = ("s4r", "s4r-paper", "full", "streaming", "snapkv", "svd", "offline")


def make_method(name: str, ratio: float, overrides: dict[str, Any] | None = None) -> Method:
    """Build method `name` for a target `ratio`; `overrides` adjust S4R settings (see S4RConfig).

    The baselines read the settings they share with S4R from the same overrides (sinks, buffer_tokens
    as the evicting methods' reserve, query_window, pool_kernel, pool), so one set of overrides keeps
    every method on the same footing.
    """
    if name == "full":
        return FullMethod()
    if name == "s4r":
        return S4RMethod(S4RConfig(ratio=ratio).with_overrides(overrides), name="s4r")
    if name == "s4r-paper":
        return S4RMethod(S4RConfig.paper(ratio).with_overrides(overrides), name="s4r-paper")
    if name == "streaming":
        return StreamingMethod.from_config(S4RConfig(ratio=ratio).with_overrides(overrides))
    if name == "snapkv":
        return SnapKVMethod.from_config(S4RConfig(ratio=ratio).with_overrides(overrides))
    if name == "svd":
        return svd_method(ratio, overrides)
    if name == "offline":
        return OfflineMethod(S4RConfig(ratio=ratio).with_overrides(overrides))
    raise ValueError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")


__all__ = ["METHODS", "CompressContext", "FullMethod", "Method", "OfflineMethod", "S4RMethod", "SnapKVMethod",
           "StreamingMethod", "make_method", "svd_method"]
