"""Layer-wise ingest: the same cache and logits as token-chunked prefill, one layer's full K/V at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape
from s4r.errors import S4RError
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import prefill
from s4r.hf.layerwise import decoder_parts, layerwise_prefill
from s4r.layers.full import StagingLayer
from s4r.methods.offline import calibrate, clear_calibrations
from s4r.runtime.session import Session
from tests.helpers import ARCHS, CharTokenizer, tiny_model


@pytest.fixture(autouse=True)
def _no_calibrations():
    clear_calibrations()
    yield
    clear_calibrations()
TEXT = "".join(chr(97 + (i * 7919) % 26) for i in range(900))


def loaded_for(model, context: int = 4096):
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=context)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_cache_match_chunked_prefill(arch):
    model = tiny_model(arch)
    install(model)
    shape = KVShape.from_config(model.config, 4)
    ids = torch.randint(0, model.config.vocab_size, (700,), generator=torch.Generator().manual_seed(3))
    chunked, layered = (CompressedCache(shape.layers, shape, query_window=16) for _ in range(2))
    done: list[int] = []
    with torch.inference_mode():
        # a first part then an appended one, as a document and a /read after it
        parts = ((ids[:500], 0), (ids[500:], 500))
        want = [prefill(model, chunked, part, start, 128) for part, start in parts]
        got = [layerwise_prefill(model, layered, part, start, 128, done.append) for part, start in parts]
    for a, b in zip(got, want, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
    assert done == list(range(shape.layers)) * 2
    for a, b in zip(layered.layers, chunked.layers, strict=True):
        assert a.logical == b.logical == 700
        torch.testing.assert_close(a.keys_view, b.keys_view, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values_view, b.values_view, rtol=1e-5, atol=1e-5)
        # the last queries S4R and SnapKV compress with are those of the last block
        torch.testing.assert_close(a.queries, b.queries, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["full", "s4r", "s4r-paper", "snapkv", "streaming", "svd", "offline"])
def test_sessions_agree_for_every_method(method):
    loaded = loaded_for(tiny_model("qwen3"))
    if method == "offline":
        ids = torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(5)).tolist()
        calibrate(loaded.model, ids, S4RConfig(ratio=2.0))
    results = {}
    for mode in ("chunked", "layerwise"):
        session = Session(loaded, method=method, ratio=2.0, ingest=mode, chunk_size=128)
        first = session.ingest(TEXT)
        second = session.ingest(TEXT[:300])
        answer, _ = session.ask("what?", max_new_tokens=6)
        assert (first.mode, second.mode) == (mode, mode)
        results[mode] = (answer, session.memory(), session.compress_info)
    assert results["layerwise"] == results["chunked"]


def test_cache_never_holds_more_than_one_full_layer():
    loaded = loaded_for(tiny_model("llama", num_hidden_layers=6))
    session = Session(loaded, method="s4r", ratio=4.0, chunk_size=128)
    seen: list[int] = []
    session.ingest(TEXT * 2, progress=lambda done, total: seen.append(session.cache.nbytes()))
    staged = [layer for layer in session.cache.layers if type(layer) is StagingLayer]
    assert not staged
    compressed = session.memory().stored_bytes
    one_layer = session.shape.full_bytes(session.logical_length) // session.shape.layers
    assert len(seen) == session.shape.layers
    # each report comes after a layer is complete: compressed so far, never a growing full cache
    assert max(seen) <= compressed + one_layer
    assert session.memory().full_bytes > 3 * compressed


def test_append_folds_each_layer_as_it_completes():
    loaded = loaded_for(tiny_model("llama"))
    session = Session(loaded, method="s4r", ratio=2.0, chunk_size=100,
                      config_overrides={"buffer_tokens": 32, "fold_tokens": 16})
    session.ingest(TEXT)
    completed: list[list[int]] = []
    layers = session.cache.layers
    # 2 tokens of turn prefix + 398: four full blocks, the last one left in the buffer unless folded
    session.ingest(TEXT[:398], progress=lambda d, t: completed.append(
        [layer.buf_k.shape[1] for layer in layers[: len(completed) + 1]]))
    assert len(completed) == len(layers)
    # each layer is folded down to its buffer as soon as it has the text (not only after the last one);
    # unfolded, a layer keeps its last 100-token block in full
    assert all(max(bufs) <= 32 for bufs in completed)


def test_mode_choice_is_explicit():
    loaded = loaded_for(tiny_model("llama"))
    assert Session(loaded, method="s4r").ingest_mode_for() == ("layerwise", "")
    assert Session(loaded, method="s4r", ingest="chunked").ingest_mode_for()[0] == "chunked"
    energy = Session(loaded, method="s4r", config_overrides={"rank_alloc": "energy"})
    mode, reason = energy.ingest_mode_for()
    assert mode == "chunked" and "every layer" in reason
    # a staged session kept whole for fork
    assert Session(loaded, method="full").ingest_mode_for(compress=False)[0] == "chunked"
    with pytest.raises(S4RError):
        Session(loaded, ingest="sideways")


def test_energy_ranks_fall_back_to_chunked_and_still_compress():
    loaded = loaded_for(tiny_model("llama"))
    session = Session(loaded, method="s4r", ratio=2.0, config_overrides={"rank_alloc": "energy"})
    stats = session.ingest(TEXT)
    assert stats.mode == "chunked"
    assert session.cache.is_compressed()


def test_unknown_architecture_is_not_layerwise():
    model = tiny_model("llama")
    model.config.model_type = "gemma"  # scales its embeddings: not the plain stack layer-wise runs
    assert decoder_parts(model) is None
    assert Session(loaded_for(model)).ingest_mode_for()[0] == "chunked"


def test_ratio_unreachable_at_this_length_keeps_the_layerwise_cache_uncompressed():
    loaded = loaded_for(tiny_model("llama"))
    session = Session(loaded, method="s4r", ratio=50.0)
    stats = session.ingest(TEXT[:200])
    assert stats.mode == "layerwise"
    assert session.method == "full" and session.uncompressed_reason
    assert not session.cache.is_compressed()
    assert session.memory().ratio == pytest.approx(1.0)
    # and the session is still usable at a ratio that fits
    session = Session(loaded, method="s4r", ratio=2.0)
    assert session.ingest(TEXT).mode == "layerwise"


def test_interrupted_append_leaves_the_documents_as_they_were():
    """Ctrl-C during a layer-wise append: every layer holds exactly what it held before (tensors, lengths),
    the session's documents are unchanged, and it answers as a twin that never saw the append does."""
    loaded = loaded_for(tiny_model("llama", num_hidden_layers=6))
    session, twin = (Session(loaded, method="s4r", ratio=2.0, chunk_size=128) for _ in range(2))
    for s in (session, twin):
        s.ingest(TEXT)
    length, documents = session.logical_length, list(session.documents)
    before = [{k: v.clone() for k, v in layer.state().items()} for layer in session.cache.layers]

    def stop_at_third_layer(done: int, total: int) -> None:
        if done >= 3 * total // session.shape.layers:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.ingest(TEXT[:300], progress=stop_at_third_layer)
    assert {layer.get_seq_length() for layer in session.cache.layers} == {length}
    assert session.documents == documents and session.logical_length == length
    for saved, layer in zip(before, session.cache.layers, strict=True):
        now = layer.state()
        assert now.keys() == saved.keys()
        assert all(torch.equal(now[k], saved[k]) for k in saved)
    answer, stats = session.ask("what?", max_new_tokens=3)
    twin_answer, twin_stats = twin.ask("what?", max_new_tokens=3)
    assert (answer, stats.generated_tokens) == (twin_answer, twin_stats.generated_tokens)
    assert stats.generated_tokens > 0
