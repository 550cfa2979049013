"""Layers spread over devices by accelerate's device_map: every layer's cache lives on its layer's device.

This machine may have only a CPU, so two stand-ins: a device_map that names a device for every layer
explicitly (all "cpu" here) with each cache layer's tensors checked against its own layer's device, and the
placement itself checked with a second device that needs no hardware ("meta"), where a cache that followed
one session-wide device instead of each layer's would put the tensors on the wrong one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from s4r.core.budget import KVShape
from s4r.distributed.placement import layer_devices, spread
from s4r.hf.cache import CompressedCache
from s4r.runtime.persist import load_cache
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

DOC = "The harbor key is 4821. " + "Waves came and went over the quiet stones. " * 40


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """A tiny llama loaded back with a device_map naming each of its parts' device."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("placed")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(folder)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    return AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, dtype=torch.float32).eval()


def cache_devices(layer) -> set[torch.device]:
    return {t.device for t in layer.state().values()}


def test_each_layer_cache_sits_on_its_layer_device(placed, tmp_path):
    devices = layer_devices(placed)
    assert devices == [torch.device("cpu")] * 2 and not spread(devices)
    loaded = SimpleNamespace(model=placed, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    session = Session(loaded, method="s4r", ratio=2.0)
    session.ingest(DOC)
    session.ask("What is the harbor key?", max_new_tokens=4)
    assert session.cache.is_compressed()
    for layer, device in zip(session.cache.layers, devices, strict=True):
        assert cache_devices(layer) == {device}
    path = tmp_path / "placed.s4r"
    session.save(path)
    again = Session.load(path, loaded)
    for layer, device in zip(again.cache.layers, devices, strict=True):
        assert cache_devices(layer) == {device}


def test_a_model_on_one_device_is_not_spread():
    devices = layer_devices(tiny_model("llama", num_hidden_layers=3))
    assert devices == [torch.device("cpu")] * 3 and not spread(devices)


def test_loaded_layers_go_to_their_own_devices(placed, tmp_path):
    loaded = SimpleNamespace(model=placed, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    session = Session(loaded, method="full")
    session.ingest(DOC)
    path = tmp_path / "full.s4r"
    session.save(path)
    cache = CompressedCache(2, session.shape)
    load_cache(path, cache, None, [torch.device("cpu"), torch.device("meta")])
    assert cache_devices(cache.layers[0]) == {torch.device("cpu")}
    assert cache_devices(cache.layers[1]) == {torch.device("meta")}


def test_staging_storage_is_reserved_on_each_layer_device():
    shape = KVShape(layers=2, kv_heads=2, q_heads=4, head_dim=16, dtype_bytes=4)
    cache = CompressedCache(2, shape)
    cache.devices = [torch.device("cpu"), torch.device("meta")]
    for i in range(2):
        # a layer-wise ingest passes the input's device; the layer's own device wins
        cache.reserve_layer(i, 64, torch.float32, torch.device("cpu"))
    assert cache.layers[0]._k.device == torch.device("cpu")
    assert cache.layers[1]._k.device == torch.device("meta")
