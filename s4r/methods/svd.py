"""`svd`: the costly online low-rank baseline (ShadowKV/xKV-like).

S4R's storage and sparse decoding, but the bases come from an SVD of every prompt token without
normalization, so the benchmark shows what the full decomposition costs at compression time (and
what S4R's selective sampling saves).
"""

from __future__ import annotations

from typing import Any

from ..config import S4RConfig
from .s4r import S4RMethod

# what makes `svd` itself: every token goes into the SVD, as it is
SVD_SETTINGS: dict[str, Any] = {"sample_tokens": None, "normalize": False}


def svd_config(ratio: float, overrides: dict[str, Any] | None = None) -> S4RConfig:
    """S4R's default settings with `overrides`, then the full-SVD settings (which overrides may not
    change: the result would no longer be this baseline)."""
    clash = sorted(k for k, v in (overrides or {}).items() if k in SVD_SETTINGS and v != SVD_SETTINGS[k])
    if clash:
        raise ValueError(f"svd fits its bases on every token as they are; it cannot set {', '.join(clash)}")
    return S4RConfig(ratio=ratio).with_overrides(overrides).with_overrides(SVD_SETTINGS)


def svd_method(ratio: float, overrides: dict[str, Any] | None = None) -> S4RMethod:
    """The `svd` method for a target `ratio` (ranks from the same solver as s4r)."""
    return S4RMethod(svd_config(ratio, overrides), name="svd")
