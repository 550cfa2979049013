"""The KV-cache methods, one file each, behind one registry: a new method is one file + one line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import S4RConfig
from . import kvzip, quant
from .base import CompressContext, Method
from .full import FullMethod
from .kvzip import KVzipMethod
from .offline import OfflineMethod
from .quant import QuantMethod
from .s4r import S4RMethod
from .snapkv import SnapKVMethod
from .streaming import StreamingMethod
from .svd import svd_method

Builder = Callable[[float, "dict[str, Any] | None"], Method]

# name -> builder(ratio, overrides); the baselines read the settings they share with S4R (sinks,
# buffer_tokens as the evicting/quantizing methods' reserve, query_window, pool_kernel, pool) from the same
# overrides, so one set of overrides keeps every method on the same footing
REGISTRY: dict[str, Builder] = {
    "s4r": lambda r, o: S4RMethod(S4RConfig(ratio=r).with_overrides(o), name="s4r"),
    "s4r-paper": lambda r, o: S4RMethod(S4RConfig.paper(r).with_overrides(o), name="s4r-paper"),
    "full": lambda r, o: FullMethod(),
    "streaming": lambda r, o: StreamingMethod.from_config(S4RConfig(ratio=r).with_overrides(o)),
    "snapkv": lambda r, o: SnapKVMethod.from_config(S4RConfig(ratio=r).with_overrides(o)),
    "svd": svd_method,
    "offline": lambda r, o: OfflineMethod(S4RConfig(ratio=r).with_overrides(o)),
    "quant": quant.build,
    "kvzip": kvzip.build,
}

METHODS: tuple[str, ...] = tuple(REGISTRY)


def make_method(name: str, ratio: float, overrides: dict[str, Any] | None = None) -> Method:
    """Build method `name` for a target `ratio`; `overrides` adjust S4R settings (see S4RConfig)."""
    builder = REGISTRY.get(name)
    if builder is None:
        raise ValueError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")
    return builder(ratio, overrides)


__all__ = ["METHODS", "REGISTRY", "CompressContext", "FullMethod", "KVzipMethod", "Method", "OfflineMethod",
           "QuantMethod", "S4RMethod", "SnapKVMethod", "StreamingMethod", "make_method", "svd_method"]
