"""Checks of user settings that the library and the CLI share, importing nothing heavy (no torch).

The CLI runs them before the model loads, so a typo fails in milliseconds; the library runs the same ones
so that a call from Python gets the same answer. Each check takes the error class to raise: the CLI asks
for its usage error (exit 2), the library for its own (:class:`~s4r.errors.ModelLoadError`, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Literal

__all__ = [
    "DEVICE_RE",
    "HUB_ID_RE",
    "MAX_RATIO",
    "ROPE_SCALING_MAX",
    "check_device_spec",
    "check_ratio",
    "check_rope_scaling",
    "looks_like_path",
    "model_spec_kind",
]

# --rope-scaling stretches the context by at most this factor; beyond it answers are mostly noise.
ROPE_SCALING_MAX = 8.0
# a ratio above this is a typo (a 1000x smaller cache keeps nothing a question could use)
MAX_RATIO = 1000.0
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
DEVICE_RE = re.compile(r"auto|cpu|cuda(?::(\d+))?")

ModelSpecKind = Literal["profile", "local", "missing", "hub", "unknown"]


def check_rope_scaling(factor: float | None, error: type[Exception] = ValueError) -> float | None:
    """``None`` (no scaling) or a factor in (1, ``ROPE_SCALING_MAX``]; anything else raises ``error``."""
    if factor is None:
        return None
    if not math.isfinite(factor) or not 1.0 < factor <= ROPE_SCALING_MAX:
        raise error(f"--rope-scaling must be above 1 and at most {ROPE_SCALING_MAX:g} "
                    f"(the factor the context grows by), got {factor:g}")
    return float(factor)


def check_ratio(ratio: float, error: type[Exception] = ValueError, *, name: str = "--ratio",
                upper: float | None = MAX_RATIO) -> float:
    """A compression ratio of at least 1 (1 means no compression) and, unless ``upper`` is None, at most
    ``upper``; anything else raises ``error`` naming the setting ``name``."""
    if not math.isfinite(ratio) or ratio < 1.0:
        raise error(f"{name} must be at least 1 (the cache keeps 1/RATIO of its size), got {ratio:g}")
    if upper is not None and ratio > upper:
        raise error(f"{name} {ratio:g} is absurdly high; use at most {upper:g}")
    return ratio


def check_device_spec(device: str, error: type[Exception] = ValueError) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, lower-cased; the shape only (whether the GPU is there is
    for :func:`s4r.models.device.resolve_device` to say)."""
    spec = device.strip().lower()
    if not DEVICE_RE.fullmatch(spec):
        raise error(f"--device must be auto, cpu, cuda or cuda:N, got '{device}'")
    return spec


def looks_like_path(spec: str) -> bool:
    """Whether a model spec can only be meant as a file or folder (``./x``, ``/x``, ``~/x``, ``x.gguf``,
    ``a/b/c``): ``org/name`` is a hub id instead."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        return True
    return "\\" in spec or spec.count("/") > 1


def model_spec_kind(spec: str, profiles: Collection[str]) -> ModelSpecKind:
    """What a ``--model`` value names, the way :func:`s4r.models.loading.load_model` dispatches on it.

    ``profile``: one of `profiles` (the profile names, `s4r.models.profiles.profile_names()`; they win over
    same-named folders; write ``./name`` for the folder); ``local``: an existing file or folder;
    ``missing``: a path that does not exist; ``hub``: an ``org/name`` hub id; ``unknown``: a bare word that
    is none of these (a typo).
    """
    if "/" not in spec and spec in profiles:
        return "profile"
    if Path(spec).expanduser().exists():
        return "local"
    if looks_like_path(spec):
        return "missing"
    if HUB_ID_RE.fullmatch(spec):
        return "hub"
    return "unknown"
