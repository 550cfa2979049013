"""Saved caches: the header is inside the checksum, the dtype is kept by name, damaged files are refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from s4r.errors import CacheFileError
from s4r.hf.generation import forward_tokens
from s4r.runtime.persist import _checksum
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

DOC = "The quick brown fox jumps over the lazy dog near the river bank. " * 24


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def loaded_as(model, dtype: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu", dtype=dtype,
                           context_length=4096)


@pytest.fixture
def saved(model, tmp_path):
    session = Session(loaded_as(model, torch.float32), method="s4r", ratio=2.5)
    session.ingest(DOC)
    path = tmp_path / "chat.s4r"
    session.save(path)
    return path


def rewrite(path, edit_header=None, edit_tensors=None, resign: bool = False) -> None:
    """Rewrite a saved file as a tool that changes it would (a valid safetensors file again); `resign`
    recomputes the checksum, as s4r itself would have written the edited file."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open API
        header = json.loads(f.metadata()["s4r"])
    if edit_header is not None:
        edit_header(header)
    if edit_tensors is not None:
        edit_tensors(tensors)
    if resign:
        header.pop("checksum")
        header["checksum"] = _checksum(tensors, header)
    save_file(tensors, str(path), metadata={"s4r": json.dumps(header)})


def next_logits(model, *sessions: Session) -> list[torch.Tensor]:
    """Each session's logits for the same three next tokens."""
    ids = torch.tensor([[5, 17, 42]])
    with torch.inference_mode():
        return [forward_tokens(model, s.cache, ids, s.logical_length) for s in sessions]


def test_an_untouched_file_loads(model, tmp_path):
    """The loaded session holds what the saved one held: every layer's tensors and lengths, the
    conversation state, and the same next-token logits for the same question."""
    original = Session(loaded_as(model, torch.float32), method="s4r", ratio=2.5)
    original.ingest(DOC)
    path = tmp_path / "chat.s4r"
    original.save(path)
    loaded = Session.load(path, loaded_as(model, torch.float32))
    assert (loaded.method, loaded.ratio_requested) == ("s4r", 2.5)
    assert loaded.logical_length == original.logical_length
    assert loaded.document_tokens == original.document_tokens and loaded.documents == original.documents
    assert loaded.memory() == original.memory()
    for before, after in zip(original.cache.layers, loaded.cache.layers, strict=True):
        assert type(after) is type(before) and after.get_seq_length() == before.get_seq_length()
        assert after.meta_state() == before.meta_state()
        saved_tensors, loaded_tensors = before.state(), after.state()
        assert saved_tensors.keys() == loaded_tensors.keys() and saved_tensors
        for name, tensor in saved_tensors.items():
            assert torch.equal(loaded_tensors[name], tensor), name
    logits = next_logits(model, original, loaded)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


@pytest.mark.parametrize("edit", [
    lambda h: h["meta"].update(document_tokens=h["meta"]["document_tokens"] + 1),
    lambda h: h["meta"].update(system="You are someone else."),
    lambda h: h["layers"][0]["meta"]["config"].update(local_window=8),
])
def test_a_changed_header_is_refused(model, saved, edit):
    rewrite(saved, edit_header=edit)
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        Session.load(saved, loaded_as(model, torch.float32))


def test_a_file_from_before_the_ratio_presets_reads_back_as_stored(model, tmp_path):
    """Files that did not write their value bands stored the values in the keys' bands, and on orthonormal
    bases: past 5x too, where today's presets differ, they load as stored and give the saved logits (the
    three tokens attend every stored token, so the presets' selection settings do not enter)."""
    original = Session(loaded_as(model, torch.float32), method="s4r", ratio=2.5,
                       config_overrides={"dense_queries": 2})
    original.ingest(DOC)
    path = tmp_path / "old.s4r"
    original.save(path)

    def as_before(header):
        for layer in header["layers"]:
            if "config" in layer["meta"]:
                layer["meta"]["config"].update(ratio=8.0, value_bands=None)
                layer["meta"]["config"].pop("tail_norm")

    rewrite(path, edit_header=as_before, resign=True)
    loaded = Session.load(path, loaded_as(model, torch.float32))
    assert all(layer.cfg.band_spec(values=True) == layer.cfg.band_spec() and not layer.cfg.tails_normed
               for layer in loaded.cache.layers if hasattr(layer, "cfg"))
    logits = next_logits(model, original, loaded)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_a_changed_tensor_is_refused(model, saved):
    rewrite(saved, edit_tensors=lambda t: t["0.coef_v"].mul_(2))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        Session.load(saved, loaded_as(model, torch.float32))


def test_a_truncated_file_is_refused(model, saved):
    saved.write_bytes(saved.read_bytes()[:-100])
    with pytest.raises(CacheFileError, match="not a valid s4r cache file"):
        Session.load(saved, loaded_as(model, torch.float32))


def test_the_dtype_is_kept_by_name(model, tmp_path):
    """bf16 and fp16 are both two bytes wide: a cache saved in one is refused by a session in the other."""
    path = tmp_path / "half.s4r"
    session = Session(loaded_as(model, torch.bfloat16), method="full")
    session.ingest(DOC)
    session.save(path)
    assert Session.load(path, loaded_as(model, torch.bfloat16)).memory() == session.memory()
    with pytest.raises(CacheFileError, match="dtype 'bfloat16', this session uses 'float16'"):
        Session.load(path, loaded_as(model, torch.float16))
