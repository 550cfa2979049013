"""Every registered method, the same checks (as kvpress's test matrix): it builds by name, ingests a
prompt of a tiny random model, stays within its byte budget, decodes, and its chat saves and loads back
to the same next answer."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from s4r.hf.generation import forward_tokens
from s4r.layers.eviction import EvictedLayer
from s4r.methods import METHODS, REGISTRY, OfflineMethod, make_method
from s4r.methods.offline import clear_calibrations
from s4r.methods.scorer import ScorerMethod
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

DOC = "".join(f"Line {i}: the {['red', 'green', 'blue'][i % 3]} fox sat at table {i * 7 % 31}. "
              for i in range(60))
QUESTION = "Which table did the blue fox sit at?"


@pytest.fixture(scope="module")
def loaded() -> SimpleNamespace:
    return SimpleNamespace(model=tiny_model("llama"), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=8192)


@pytest.fixture(autouse=True)
def _calibrated(loaded):
    """`offline` needs bases from calibration text first (registered per model shape)."""
    OfflineMethod().calibrate(loaded.model, torch.arange(3, 128).repeat(8), tokenizer=loaded.tokenizer)
    yield
    clear_calibrations()


def chat(loaded, method: str, ratio: float) -> Session:
    session = Session(loaded, method=method, ratio=ratio)
    session.ingest(DOC)
    return session


@pytest.mark.parametrize("ratio", [2.5, 5.0])
@pytest.mark.parametrize("method", METHODS)
def test_method_keeps_its_budget_and_decodes(loaded, method, ratio):
    session = chat(loaded, method, ratio)
    assert session.uncompressed_reason is None
    assert session.method == method
    compresses = method != "full"
    assert session.cache.is_compressed() == compresses
    answer, stats = session.ask(QUESTION, max_new_tokens=8)
    assert stats.generated_tokens > 0 or answer == ""
    if compresses:
        assert stats.memory.ratio >= ratio, (method, stats.memory)
    else:
        assert stats.memory.ratio == 1.0


@pytest.mark.parametrize(("method", "overrides"), [(m, None) for m in METHODS]
                         + [("s4r", {"coef_bands": "8:1,4:1", "scoring": "max"})])
def test_chat_saved_and_loaded_gives_the_same_next_answer(loaded, method, overrides, tmp_path):
    session = Session(loaded, method=method, ratio=2.5, config_overrides=overrides)
    session.ingest(DOC)
    session.ask(QUESTION, max_new_tokens=6)  # a first turn, so the saved state is past the document
    session.save(tmp_path / "chat.s4r")
    restored = Session.load(tmp_path / "chat.s4r", loaded)
    assert restored.method == method and restored.memory() == session.memory()
    # the same logits for a probe token (a random model's greedy answers alone hardly depend on the cache)
    probe = torch.tensor([[40, 41, 42]])
    with torch.inference_mode():
        logits = [forward_tokens(loaded.model, s.cache, probe, s.logical_length) for s in (session, restored)]
    assert torch.equal(logits[0], logits[1])
    before, _ = session.ask("And the red fox?", max_new_tokens=12)
    after, _ = restored.ask("And the red fox?", max_new_tokens=12)
    assert after == before
    assert restored.memory() == session.memory()


# --- one registry, settings of their own -----------------------------------------------------------------

@dataclass
class RecentMethod(ScorerMethod):
    """A new method is this class (its own file in s4r/methods/) plus one line in REGISTRY: keep the most
    recent tokens, no sinks."""

    name: str = "recent"

    def score(self, i, layer, budget):
        return torch.arange(layer.logical, dtype=torch.float32)


def test_a_new_method_is_one_class_and_one_registry_line(loaded, monkeypatch, tmp_path):
    monkeypatch.setitem(REGISTRY, "recent", RecentMethod.build)
    session = chat(loaded, "recent", 2.5)
    layer = session.cache.layers[0]
    assert isinstance(layer, EvictedLayer)
    staged = Session(loaded, method="full")
    staged.ingest(DOC)
    full_keys = staged.cache.layers[0].keys_view[0]
    assert torch.equal(layer.keys_view, full_keys[:, -layer.kept :])  # what `score` asked for
    answer, stats = session.ask(QUESTION, max_new_tokens=6)
    assert stats.memory.ratio >= 2.5
    session.save(tmp_path / "recent.s4r")
    assert Session.load(tmp_path / "recent.s4r", loaded).memory() == session.memory()
    assert make_method("recent", 3.0, {"buffer_tokens": 32}).reserve == 32


def test_each_method_takes_its_own_settings_from_one_overrides_dict():
    shared = {"buffer_tokens": 32, "pool_kernel": 5, "sinks": 2, "outlier_fraction": 0.0, "chunk_tokens": 64}
    built = {name: make_method(name, 4.0, shared) for name in METHODS}
    assert built["s4r"].config.buffer_tokens == 32 and built["s4r"].config.outlier_fraction == 0.0
    assert (built["streaming"].reserve, built["streaming"].sinks) == (32, 2)
    assert (built["snapkv"].reserve, built["snapkv"].kernel) == (32, 5)
    assert (built["kvzip"].reserve, built["kvzip"].sinks, built["kvzip"].chunk_tokens) == (32, 2, 64)
    assert built["quant"].reserve == 32 and built["quant"].ratio == 4.0
    assert not hasattr(built["streaming"], "config")  # nothing borrowed from S4R's settings


def test_a_setting_no_method_has_is_refused():
    for name in METHODS:
        with pytest.raises(ValueError, match="unknown setting.*buffer_tokes"):
            make_method(name, 4.0, {"buffer_tokes": 32})
