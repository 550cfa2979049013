"""Every registered method, the same checks (as kvpress's test matrix): it builds by name, ingests a
prompt of a tiny random model, stays within its byte budget, decodes, and its chat saves and loads back
to the same next answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.generation import forward_tokens
from s4r.methods import METHODS, OfflineMethod
from s4r.methods.offline import clear_calibrations
from s4r.session import Session
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


@pytest.mark.parametrize("method", METHODS)
def test_chat_saved_and_loaded_gives_the_same_next_answer(loaded, method, tmp_path):
    session = chat(loaded, method, 2.5)
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
