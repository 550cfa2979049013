"""S4R at full rank, with every token sampled and reconstructed, must equal the full cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from s4r.config import S4RConfig
from s4r.core.budget import KVShape
from s4r.core.rope import model_rope_fn
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import forward_tokens, prefill
from s4r.methods import CompressContext, S4RMethod
from tests.helpers import ARCHS, tiny_model

SPACES = ["post_rope", "pre_rope"]
GRANULARITIES = ["head", "layer"]


def exact_config(model, key_space: str, granularity: str) -> S4RConfig:
    shape = KVShape.from_config(model.config, 4)
    width = shape.head_dim if granularity == "head" else shape.head_dim * shape.kv_heads
    # a tiny buffer so the second turn exercises folding tokens into coefficients
    return S4RConfig(ratio=None, rank_k=width, rank_v=width, sample_tokens=None, recon_fraction=1.0,
                     key_space=key_space, granularity=granularity, buffer_tokens=8, fold_tokens=4,
                     coef_dtype="model", outlier_fraction=0.05)


def compressed_cache(model, ids: torch.Tensor, cfg: S4RConfig) -> CompressedCache:
    install(model)
    shape = KVShape.from_config(model.config, 4)
    cache = CompressedCache(shape.layers, shape, query_window=cfg.query_window)
    with torch.inference_mode():
        prefill(model, cache, ids, 0, chunk_size=96)
        S4RMethod(cfg).compress(cache, CompressContext(model_rope_fn(model), 1.0))
    return cache


def reference_logits(model, cache: DynamicCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of the last token with transformers' own DynamicCache and SDPA attention."""
    model.set_attn_implementation("sdpa")
    try:
        positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
        return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits[0, -1]
    finally:
        install(model)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("key_space", SPACES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_logits_match_full_cache(arch, key_space, granularity):
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    doc = torch.randint(0, vocab, (400,), generator=gen)
    cache = compressed_cache(model, doc, exact_config(model, key_space, granularity))
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        reference_logits(model, ref, doc[None], 0)
        pos = doc.shape[0]
        # a question, 20 decode steps of the answer, then a second user turn
        turns = [torch.randint(0, vocab, (1, 12), generator=gen)]
        turns += [torch.randint(0, vocab, (1, 1), generator=gen) for _ in range(20)]
        turns += [torch.randint(0, vocab, (1, 15), generator=gen)]
        for ids in turns:
            expected = reference_logits(model, ref, ids, pos)
            got = forward_tokens(model, cache, ids, pos)
            pos += ids.shape[1]
            assert_close(got, expected)
            assert cache.logical_length() == pos
    # the buffer folded tokens into coefficients along the way, and outliers were kept exact
    assert cache.layers[0].stored_coefs > doc.shape[0] - 4
    assert cache.layers[0].out_idx.numel() == int(0.05 * (doc.shape[0] - 4))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_token_for_token(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    for key_space, granularity in [("post_rope", "layer"), ("pre_rope", "head")]:
        cache = compressed_cache(model, ids[0, :-1], exact_config(model, key_space, granularity))
        out = model.generate(ids, cache=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert torch.equal(out, expected)
