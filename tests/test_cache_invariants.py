"""What an S4R cache promises whatever the scores say: the sinks are stored exactly as the model made
them, and every decode step attends the most recent stored tokens (the local window). A tiny random
model, prefilled once, compressed in both key spaces."""

from __future__ import annotations

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape
from s4r.core.rope import model_rope_fn
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import prefill
from s4r.layers.lowrank import LowRankLayer
from s4r.methods import CompressContext, S4RMethod
from tests.helpers import tiny_model

TOKENS = 300
WINDOW = 16


def _configs() -> dict[str, S4RConfig]:
    # a small fixed share (6 of ~290 tokens) so the scores alone would rarely pick the whole window
    common = {"ratio": 2.5, "local_window": WINDOW, "recon_fraction": 0.02, "recon_drop": None,
              "sample_tokens": 128}
    return {"pre_rope": S4RConfig(**common), "post_rope": S4RConfig.fast(2.5).with_overrides(common)}


@pytest.fixture(scope="module")
def staged_and_compressed() -> dict[str, tuple[list[tuple[torch.Tensor, torch.Tensor]], CompressedCache]]:
    """Per key space: the staged (exact) keys and values of every layer, and the compressed cache."""
    model = tiny_model("llama")
    install(model)
    shape = KVShape.from_config(model.config, 4)
    ids = torch.randint(3, 120, (TOKENS,), generator=torch.Generator().manual_seed(7))
    out = {}
    for space, cfg in _configs().items():
        cache = CompressedCache(shape.layers, shape, query_window=cfg.query_window)
        with torch.inference_mode():
            prefill(model, cache, ids, 0, chunk_size=96)
            staged = [(layer.keys_view[0].clone(), layer.values_view[0].clone()) for layer in cache.layers]
            S4RMethod(cfg).compress(cache, CompressContext(model_rope_fn(model), 1.0))
        out[space] = (staged, cache)
    return out


@pytest.mark.parametrize("space", ["pre_rope", "post_rope"])
def test_stored_sinks_are_the_models_keys_and_values_exactly(staged_and_compressed, space):
    """Sinks take a large share of every query's attention: they are kept, never projected on a basis."""
    staged, cache = staged_and_compressed[space]
    for (keys, values), layer in zip(staged, cache.layers, strict=True):
        assert isinstance(layer, LowRankLayer) and layer.sinks == 4
        assert torch.equal(layer.sink_k, keys[:, :4]) and torch.equal(layer.sink_v, values[:, :4])


@pytest.mark.parametrize("space", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_step_rebuilds_the_most_recent_stored_tokens(staged_and_compressed, space, seed):
    """Whatever a query scores, the `local_window` most recent stored tokens are among those it attends
    (the buffer is empty right after compression, so all of the window comes from the stored tokens)."""
    _, cache = staged_and_compressed[space]
    shape = cache.shape
    gen = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        assert layer.buffered == 0
        query = torch.randn(1, shape.q_heads, 1, shape.head_dim, generator=gen)
        with torch.inference_mode():
            layer.attend(query, None, None, shape.head_dim**-0.5)
        n = layer.stored_coefs
        recent = set(range(n - WINDOW, n))
        for head_selection in layer.selected.tolist():
            assert recent <= set(head_selection)
            assert len(head_selection) < n // 4  # a sparse step: the window is forced, not everything
