"""Correctness edges: a missed attention hand-off is an error, a forgotten turn leaves no
queries behind, truncation frees what it drops, and a long question never holds the cache over its ratio.
Tiny random models (fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.errors import S4RError
from s4r.hf.generation import forward_tokens, prefill
from s4r.layers.full import StagingLayer
from s4r.layers.lowrank import LowRankLayer
from s4r.layers.quant import QuantLayer
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

DOC = "The quick brown fox jumps over the lazy dog near the river bank. " * 24


@pytest.fixture(scope="module")
def loaded() -> SimpleNamespace:
    return SimpleNamespace(model=tiny_model("llama"), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                           dtype=torch.float32, context_length=4096)


def session_for(loaded, method: str = "s4r", ratio: float = 2.5, **overrides) -> Session:
    session = Session(loaded, method=method, ratio=ratio, config_overrides=overrides or None)
    session.ingest(DOC)
    return session


def changed_keys(layer) -> None:
    """Wrap `layer.update` as a model wrapper that copies the keys would (the hand-off no longer matches)."""
    update = layer.update

    def wrapped(key_states, value_states, *args, **kwargs):
        keys, values = update(key_states, value_states, *args, **kwargs)
        return keys.clone(), values

    layer.update = wrapped


# --- the attention hand-off ----------------------------------------------------------------------------

def test_keys_changed_on_the_way_to_a_compressed_layer_is_an_error(loaded):
    session = session_for(loaded)
    assert isinstance(session.cache.layers[1], LowRankLayer)
    changed_keys(session.cache.layers[1])
    with pytest.raises(S4RError, match="did not get the keys its LowRankLayer returned"):
        session.ask("Who jumps?", max_new_tokens=3)


def test_another_attention_implementation_over_a_compressed_cache_is_an_error():
    model = tiny_model("llama")
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    session = session_for(loaded, "quant")
    model.set_attn_implementation("sdpa")  # a single token needs no mask: sdpa would run over the residual
    token = torch.tensor([[5]])
    with pytest.raises(S4RError, match="another attention implementation"), torch.inference_mode():
        forward_tokens(model, session.cache, token, session.logical_length)


def test_the_fallback_stays_where_it_is_exact(loaded):
    reference, _ = session_for(loaded, "full").ask("Who jumps?", max_new_tokens=6)
    session = session_for(loaded, "full")
    for layer in session.cache.layers:
        changed_keys(layer)
    answer, _ = session.ask("Who jumps?", max_new_tokens=6)
    assert answer == reference


# --- forgotten turns -----------------------------------------------------------------------------------

def test_truncate_drops_the_forgotten_queries_of_summed_scoring(loaded):
    session = session_for(loaded, scoring="summed")
    session.ask("Who jumps over the dog?", max_new_tokens=4)
    layer = session.cache.layers[0]
    before = layer.query_coef.clone()
    window = before.shape[1]
    session.cache.truncate(session.logical_length - 3)
    assert torch.equal(layer.query_coef, before[:, : window - 3])
    session.clear()  # the whole turn (longer than the window) goes
    assert all(layer.query_coef is None for layer in session.cache.layers)


def test_clear_drops_the_relevance_of_the_forgotten_turn(loaded):
    session = session_for(loaded, scoring="max")
    session.ask("Who jumps over the dog?", max_new_tokens=4)
    assert session.cache.layers[0].relevance is not None
    session.clear()
    assert all(layer.relevance is None and layer.query_coef is None for layer in session.cache.layers)


def test_staging_truncate_drops_the_forgotten_queries():
    layer = StagingLayer(query_window=4)
    keys = torch.randn(1, 2, 10, 8)
    layer.update(keys, keys)
    query = torch.randn(1, 4, 10, 8)
    layer.attend(query, keys, keys, 1.0)
    layer.truncate(8)
    assert torch.equal(layer.queries, query[:, :, 6:8])
    layer.truncate(5)
    assert layer.queries is None


def test_quant_truncate_copies_what_it_keeps():
    keys = torch.randn(2, 100, 16)
    layer = QuantLayer(keys, keys.clone(), bits=4, key_group=32, value_group=16, reserve=64)
    layer.update(torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16))
    layer.truncate(layer.logical - 10)
    for t in (layer.res_k, layer.res_v):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


# --- a long question -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["s4r", "quant"])
def test_a_question_longer_than_the_buffer_keeps_the_ratio(loaded, method):
    ratio = 2.5
    session = session_for(loaded, method, ratio)
    assert session.cache.is_compressed()
    question = torch.tensor(CharTokenizer().encode("Where does the fox go, and why? " * 10))
    assert question.numel() > 64 * 4  # several buffers (s4r's buffer_tokens, quant's reserve)
    with torch.inference_mode():
        prefill(loaded.model, session.cache, question, session.logical_length, 512)
    assert session.cache.ratio() >= ratio
