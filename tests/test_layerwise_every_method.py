"""Every registered method: layer-wise ingest gives what token-chunked prefill gives, or says why it
cannot apply; appended text goes layer by layer for all of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.methods import METHODS
from s4r.methods.offline import calibrate, clear_calibrations
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

TEXT = "".join(chr(97 + (i * 7919) % 26) for i in range(900))
# methods that need every layer of the text before they compress any (kvzip re-reads the prompt)
WHOLE_MODEL_METHODS = {"kvzip"}


@pytest.fixture(autouse=True)
def _no_calibrations():
    clear_calibrations()
    yield
    clear_calibrations()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_ingests_layerwise_or_says_why(method):
    model = tiny_model("mistral")
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    if method == "offline":
        ids = torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(5)).tolist()
        calibrate(model, ids, S4RConfig(ratio=2.0))
    results, modes = {}, {}
    for asked in ("chunked", "layerwise"):
        session = Session(loaded, method=method, ratio=2.0, ingest=asked, chunk_size=128, hidden_spill="on")
        reason = session.ingest_mode_for()[1]
        stats = [session.ingest(TEXT), session.ingest(TEXT[:300])]
        modes[asked] = [s.mode for s in stats], reason
        results[asked] = (session.ask("what?", max_new_tokens=6)[0], session.memory(), session.compress_info)
    assert results["layerwise"] == results["chunked"]
    assert modes["chunked"] == (["chunked", "chunked"], "asked for")
    if method in WHOLE_MODEL_METHODS:
        # the first document in token chunks, said why; the appended one still layer by layer
        assert modes["layerwise"][0] == ["chunked", "layerwise"] and "every layer" in modes["layerwise"][1]
    else:
        assert modes["layerwise"] == (["layerwise", "layerwise"], "")
