"""`svd`: the costly online low-rank baseline (ShadowKV/xKV-like).

S4R's storage and sparse decoding, but the bases come from an SVD of every prompt token without
normalization, so the benchmark shows what the full decomposition costs at compression time (and
what S4R's selective sampling saves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from s4r.config import S4RConfig
from s4r.methods.s4r import S4RMethod

# what makes `svd` itself: every token goes into the SVD, as it is
SVD_SETTINGS: dict[str, Any] = {"sample_tokens": None, "normalize": False}


@dataclass
class SVDMethod(S4RMethod):
    """S4R's default settings with every token in the SVD, unnormalized (ranks from the same solver)."""

    name: str = "svd"

    @classmethod
    def build(cls, ratio: float, overrides: dict[str, Any] | None = None) -> SVDMethod:
        """Refuses overrides of the full-SVD settings: the result would no longer be this baseline."""
        clash = sorted(k for k, v in (overrides or {}).items() if k in SVD_SETTINGS and v != SVD_SETTINGS[k])
        if clash:
            raise ValueError("svd fits its bases on every token as they are; it cannot set "
                             + ", ".join(clash))
        return super().build(ratio, overrides)

    @classmethod
    def defaults(cls, ratio: float) -> S4RConfig:
        return S4RConfig(ratio=ratio).with_overrides(SVD_SETTINGS)
