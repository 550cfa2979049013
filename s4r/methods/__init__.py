"""The KV-cache methods, one file each, behind one registry: a new method is one file + one line here.

`REGISTRY` maps a method's name to its builder `(ratio, overrides) -> method`; the CLI help, the
benchmark and the tests read it. Overrides: see `s4r.methods.base` (each method takes the keys that
name its own settings; a key no registered method has is refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from s4r.methods.base import CompressContext, Method, settings_of
from s4r.methods.full import FullMethod
from s4r.methods.kvzip import KVzipMethod
from s4r.methods.offline import OfflineMethod
from s4r.methods.quant import QuantMethod
from s4r.methods.s4r import S4RFastMethod, S4RMethod, S4RPaperMethod
from s4r.methods.snapkv import SnapKVMethod
from s4r.methods.streaming import StreamingMethod
from s4r.methods.svd import SVDMethod

Builder = Callable[[float, "dict[str, Any] | None"], Method]

REGISTRY: dict[str, Builder] = {
    "s4r": S4RMethod.build,
    "s4r-fast": S4RFastMethod.build,
    "s4r-paper": S4RPaperMethod.build,
    "full": FullMethod.build,
    "streaming": StreamingMethod.build,
    "snapkv": SnapKVMethod.build,
    "svd": SVDMethod.build,
    "offline": OfflineMethod.build,
    "quant": QuantMethod.build,
    "kvzip": KVzipMethod.build,
}

METHODS: tuple[str, ...] = tuple(REGISTRY)


def known_settings() -> frozenset[str]:
    """Every override key some registered method takes."""
    return frozenset().union(*(settings_of(builder) for builder in REGISTRY.values()))


def make_method(name: str, ratio: float, overrides: dict[str, Any] | None = None) -> Method:
    """Build method `name` for a target `ratio`. `overrides` set its settings; keys that are another
    method's settings are ignored (one dict can go to every method), a key no method has is a ValueError."""
    builder = REGISTRY.get(name)
    if builder is None:
        raise ValueError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")
    unknown = sorted(set(overrides or {}) - known_settings())
    if unknown:
        raise ValueError(f"unknown setting(s): {', '.join(unknown)} (no method has them)")
    return builder(ratio, overrides)


__all__ = ["METHODS", "REGISTRY", "CompressContext", "FullMethod", "KVzipMethod", "Method", "OfflineMethod",
           "QuantMethod", "S4RFastMethod", "S4RMethod", "S4RPaperMethod", "SVDMethod", "SnapKVMethod",
           "StreamingMethod", "known_settings", "make_method"]
