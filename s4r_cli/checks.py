"""Checks of command-line values that need no model, run before anything slow so a typo fails at once.

The rules themselves (ratio range, RoPE-scaling limit, device shape, what a model spec names) live in
:mod:`s4r.validation`, which the library uses too; here they raise the CLI's UsageError (exit 2).
"""

from __future__ import annotations

from pathlib import Path

from s4r import validation
from s4r_cli.cli_errors import UsageError


def check_ratio(ratio: float) -> float:
    """Accept 1 <= ratio <= 1000 (1 means no compression); anything else is a usage error."""
    return validation.check_ratio(ratio, UsageError)


def check_rope_scaling(factor: float | None) -> float | None:
    """--rope-scaling is absent, or a factor above 1 and at most s4r.validation.ROPE_SCALING_MAX."""
    return validation.check_rope_scaling(factor, UsageError)


def check_device(device: str) -> str:
    """Shape check only; whether the device exists is the library's call (DeviceError, exit 1)."""
    return validation.check_device_spec(device, UsageError)


def check_cache_path(path: str) -> Path:
    """A --load / /load path must be an existing file (missing file: usage error; bad contents: exit 1)."""
    from s4r.distributed.rank_files import exists

    p = Path(path).expanduser()
    if not p.exists() and not exists(p):  # several ranks saved it as parts beside `path`
        raise UsageError(f"saved cache not found: {path}")
    if p.is_dir():
        raise UsageError(f"{path} is a directory, not a saved cache")
    return p


def check_model_spec(spec: str) -> None:
    """Reject model specs that cannot be anything (usage error); leave real lookups to the loader.

    A profile name, an existing folder or .gguf, or a hub id (``org/name``) go on to the loader, whose
    ModelLoadError is a runtime error (exit 1). A missing path or a bare unknown word is a typo, so it is a
    usage error (exit 2) reported before anything slow happens.
    """
    from s4r.models.profiles import profile_names  # tomllib only; looked up at call time so tests can swap it

    kind = validation.model_spec_kind(spec, profile_names())  # the loader's own dispatch
    if kind == "local":
        p = Path(spec).expanduser()
        if not (p.is_dir() or p.suffix.lower() == ".gguf"):
            raise UsageError(f"--model {spec} is a file but not a .gguf; pass a model folder, .gguf or "
                             "profile")
    elif kind == "missing":
        raise UsageError(f"model not found: {spec}")
    elif kind == "unknown":
        raise UsageError(f"unknown model '{spec}'; run `s4r models` for the profiles, or pass a model "
                         "folder, a .gguf file or a hub id (org/name)")


def check_method(method: str) -> str:
    """--method must be one the library knows (it may add methods, e.g. for benchmarks)."""
    from s4r.runtime.session import METHODS as methods

    if method not in methods:
        raise UsageError(f"--method must be one of {', '.join(methods)}, got '{method}'")
    return method
