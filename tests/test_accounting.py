"""The achieved byte ratio holds at prefill and through a long answer; nbytes hides nothing."""

from __future__ import annotations

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape, solve_ranks
from s4r.core.rope import model_rope_fn
from s4r.errors import BudgetError
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import forward_tokens, prefill, sample_token
from s4r.methods import CompressContext, make_method
from tests.helpers import tiny_model


def all_tensor_bytes(layer) -> int:
    """Independent count: the memory behind every tensor attribute the layer holds, spare capacity
    included, each storage once (an expanded or sliced view costs no memory of its own)."""
    # `selected` is the last step's scratch (which tokens it rebuilt, kept for inspection): a step's
    # working memory, like its activations, replaced by the next step and up to every stored token's
    # index with the adaptive budget
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and k != "selected"}
    return sum(storages.values())


def assert_counts_everything(cache) -> None:
    """nbytes counts every stored tensor: what the layers allocate is that plus bounded growth room
    (the exact workspace's free slots, whose buffer part the rank budget counts as full, and a few spare
    coefficient rows so appends do not copy everything)."""
    token = cache.shape.full_bytes_per_token()
    for layer in cache.layers:
        allocated = all_tensor_bytes(layer)
        # the exact workspace's free slots: the buffer's room, and spare rows once folded outliers grow it
        free_slots = (layer._ek.shape[1] - layer.exact_length) * token
        assert layer.nbytes() <= allocated <= 1.1 * layer.nbytes() + free_slots, (layer.nbytes(), allocated)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", num_hidden_layers=2, head_dim=32, hidden_size=128)
    install(m)
    return m


@pytest.fixture(scope="module")
def staged_doc(model):
    return torch.randint(0, model.config.vocab_size, (4096,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("ratio", [2, 3, 5, 8])
@pytest.mark.parametrize("storage", [{"coef_dtype": "model"}, {"coef_dtype": "int8", "coef_bands": None},
                                     {"coef_bands": "8:1,4:3,2:4"}, {"value_bands": "8:1,4:3,2:4"}],
                         ids=["model", "int8", "bands", "value-bands"])
def test_ratio_holds_after_prefill_and_500_tokens(model, staged_doc, ratio, storage):
    method = make_method("s4r", ratio, storage)
    shape = KVShape.from_config(model.config, 4)
    cache = CompressedCache(shape.layers, shape, query_window=method.query_window)
    with torch.inference_mode():
        logits = prefill(model, cache, staged_doc, 0, chunk_size=512)
        method.compress(cache, CompressContext(model_rope_fn(model), ratio))
        assert cache.ratio() >= ratio
        assert_counts_everything(cache)
        for _ in range(500):
            token = sample_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(4))
            logits = forward_tokens(model, cache, torch.tensor([[token]]), cache.logical_length())
            assert cache.ratio() >= ratio
    assert cache.logical_length() == 4096 + 500
    assert_counts_everything(cache)
    # the buffer stayed within its cap: the answer was folded into coefficients
    assert cache.layers[0].buf_k.shape[1] <= method.config.buffer_tokens


def test_full_cache_reports_ratio_one(model, staged_doc):
    method = make_method("full", 1.0)
    shape = KVShape.from_config(model.config, 4)
    cache = CompressedCache(shape.layers, shape, query_window=method.query_window)
    with torch.inference_mode():
        prefill(model, cache, staged_doc[:1000], 0, chunk_size=256)
    method.compress(cache, CompressContext(None, 1.0))
    assert cache.nbytes() == cache.full_nbytes() == shape.full_bytes(1000)
    assert cache.ratio() == 1.0


def test_impossible_ratio_is_a_budget_error():
    shape = KVShape(layers=2, kv_heads=2, q_heads=4, head_dim=16, dtype_bytes=2)
    with pytest.raises(BudgetError, match="not reachable"):
        solve_ranks(shape, S4RConfig(ratio=50.0), tokens=200)
    with pytest.raises(ValueError):
        S4RConfig(ratio=0.5)


def test_solver_uses_int8_for_more_rank():
    shape = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype_bytes=2)
    model_dtype = solve_ranks(shape, S4RConfig(ratio=5.0, coef_dtype="model"), tokens=4096)
    int8 = solve_ranks(shape, S4RConfig(ratio=5.0, coef_dtype="int8"), tokens=4096)
    assert int8.rank_k + int8.rank_v > 1.6 * (model_dtype.rank_k + model_dtype.rank_v)
    assert model_dtype.ratio >= 5.0 and int8.ratio >= 5.0
