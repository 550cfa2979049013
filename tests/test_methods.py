"""The benchmark's baselines: eviction (streaming, snapkv), full online SVD and offline calibrated bases.

Tiny random models keep these fast; what is checked is structure (which tokens are kept, which bases
are used), exactness where a method is lossless, and the measured byte ratio.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import s4r.core.compress
from s4r.core.budget import KVShape
from s4r.core.compress import fit_layer_bases
from s4r.core.rope import model_rope_fn
from s4r.errors import BudgetError, S4RError
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import forward_tokens, prefill
from s4r.layers.eviction import EvictedLayer, eviction_budget
from s4r.layers.full import StagingLayer
from s4r.methods import METHODS, CompressContext, OfflineMethod, make_method
from s4r.methods.offline import clear_calibrations, registered_calibration
from s4r.methods.snapkv import snapkv_indices
from s4r.methods.streaming import streaming_indices
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model
from tests.test_exactness import assert_close, reference_logits

BYTES = 4  # tiny models run in fp32


@pytest.fixture(autouse=True)
def _fresh_calibrations():
    """Calibrations are registered per model shape; every tiny model here has the same shape."""
    clear_calibrations()
    yield
    clear_calibrations()


_MODELS: dict[str, torch.nn.Module] = {}


def model_for(arch: str = "llama"):
    """One tiny model per architecture for the whole module (building them is the slow part)."""
    if arch not in _MODELS:
        model = tiny_model(arch)
        install(model)
        _MODELS[arch] = model
    return _MODELS[arch]


def random_ids(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def staged(model, ids: torch.Tensor, query_window: int = 64) -> CompressedCache:
    """An uncompressed cache of `ids`, keeping the last queries as a Session's staging cache does."""
    shape = KVShape.from_config(model.config, BYTES)
    cache = CompressedCache(shape.layers, shape, query_window=query_window)
    with torch.inference_mode():
        prefill(model, cache, ids, 0, chunk_size=256)
    cache.prompt_ids = ids.tolist()  # what kvzip re-reads (a Session passes its own)
    return cache


def compressed(model, source: CompressedCache, method, ratio: float) -> tuple[CompressedCache, dict]:
    cache = source.copy_staged()
    ctx = CompressContext(model_rope_fn(model), ratio, model=model, tokenizer=CharTokenizer(),
                          ids=getattr(source, "prompt_ids", None))
    with torch.inference_mode():
        info = method.compress(cache, ctx)
    return cache, info


def calibrated(model, ratio: float, overrides: dict | None = None, seed: int = 99) -> OfflineMethod:
    method = make_method("offline", ratio, overrides)
    method.calibrate(model, random_ids(1024, seed))
    return method


# --- eviction ------------------------------------------------------------------------------------------

def test_eviction_budget_reserves_the_question():
    shape = KVShape(layers=2, kv_heads=2, q_heads=4, head_dim=16, dtype_bytes=2)
    assert eviction_budget(shape, 2000, 5.0, 64) == 400 - 64
    assert eviction_budget(shape, 2001, 2.0, 64) == 1000 - 64
    with pytest.raises(BudgetError, match="not reachable"):
        eviction_budget(shape, 300, 5.0, 64)


def test_streaming_indices():
    assert streaming_indices(10, 6, 4).tolist() == [0, 1, 2, 3, 8, 9]
    assert streaming_indices(10, 3, 4).tolist() == [0, 1, 2]
    assert streaming_indices(5, 9, 4).tolist() == [0, 1, 2, 3, 4]


def test_streaming_keeps_exactly_sinks_and_recent_tokens():
    model = model_for()
    tokens, ratio = 1000, 4.0
    source = staged(model, random_ids(tokens, 1))
    cache, info = compressed(model, source, make_method("streaming", ratio), ratio)
    budget = tokens // 4 - 64
    expected = list(range(4)) + list(range(tokens - (budget - 4), tokens))
    assert info == {"kept_tokens": budget, "sinks": 4, "recent": budget - 4, "reserve": 64}
    for full, layer in zip(source.layers, cache.layers, strict=True):
        assert isinstance(layer, EvictedLayer)
        assert layer.get_seq_length() == tokens and layer.stored_length() == budget
        assert torch.equal(layer.keys_view, full.keys_view[0][:, expected])
        assert torch.equal(layer.values_view, full.values_view[0][:, expected])
        assert layer.nbytes() == budget * source.shape.full_bytes_per_token()
    assert cache.logical_length() == tokens


def planted_cache(tokens: int, planted: dict[int, int], seed: int = 5) -> CompressedCache:
    """A one-layer staged cache of random keys in which KV head h's key at planted[h] lines up with the
    observation window's queries of that head's query group."""
    gen = torch.Generator().manual_seed(seed)
    heads, q_heads, dim, window = 2, 4, 16, 32
    shape = KVShape(layers=1, kv_heads=heads, q_heads=q_heads, head_dim=dim, dtype_bytes=BYTES)
    keys = torch.randn(heads, tokens, dim, generator=gen)
    values = torch.randn(heads, tokens, dim, generator=gen)
    direction = torch.nn.functional.normalize(torch.randn(heads, dim, generator=gen), dim=-1)
    # query heads 2h and 2h+1 read KV head h: both look along that head's direction
    queries = 4 * direction.repeat_interleave(2, dim=0)[:, None] + 0.3 * torch.randn(q_heads, window, dim,
                                                                                        generator=gen)
    for h, pos in planted.items():
        keys[h, pos] = 10 * direction[h]
    cache = CompressedCache(1, shape, query_window=window)
    layer = cache.layers[0]
    layer.update(keys[None], values[None])
    layer.queries = queries[None]
    return cache


def test_snapkv_keeps_a_planted_high_attention_token_per_head():
    tokens, ratio, planted = 1000, 5.0, {0: 100, 1: 500}
    cache = planted_cache(tokens, planted)
    keys, queries = cache.layers[0].keys_view[0].clone(), cache.layers[0].queries[0].clone()
    method = make_method("snapkv", ratio)
    info = method.compress(cache, CompressContext(None, ratio))
    budget = tokens // 5 - 64
    assert info["kept_tokens"] == budget
    layer = cache.layers[0]
    assert isinstance(layer, EvictedLayer) and layer.stored_length() == budget
    idx = snapkv_indices(keys, queries, budget, pool=method.pool)
    assert idx.shape == (2, budget)
    for h, pos in planted.items():
        assert pos in idx[h].tolist(), f"head {h} lost its planted token"
        kept = layer.keys_view[h]
        assert torch.equal(kept, keys[h, idx[h]])
        # the observation window itself is kept, last
        assert torch.equal(kept[-32:], keys[h, -32:])
    # each head votes with its own query group, so the heads keep different tokens
    assert not torch.equal(idx[0], idx[1])


def test_snapkv_indices_pool_and_window():
    keys = torch.randn(1, 50, 8, generator=torch.Generator().manual_seed(0))
    queries = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    for pool in ("avg", "max"):
        idx = snapkv_indices(keys, queries, 12, kernel=7, pool=pool)
        assert idx.shape == (1, 12) and idx[0, -4:].tolist() == [46, 47, 48, 49]
        assert torch.equal(idx, idx.sort(dim=-1).values) and idx.unique().numel() == 12
    # a budget inside the window keeps the last tokens only
    assert snapkv_indices(keys, queries, 3)[0].tolist() == [47, 48, 49]


def test_evicted_layer_keeping_everything_is_exact_and_truncates():
    model = model_for()
    tokens = 300
    doc = random_ids(tokens, 2)
    cache = staged(model, doc)
    cache.compress(lambda i, layer: EvictedLayer.from_staged(layer, torch.arange(tokens)))
    ref = DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        reference_logits(model, ref, doc[None], 0)
        pos = tokens
        # a question, 10 decode steps, then a turn longer than one growth step of the storage
        turns = [torch.randint(3, 128, (1, 12), generator=gen)]
        turns += [torch.randint(3, 128, (1, 1), generator=gen) for _ in range(10)]
        turns += [torch.randint(3, 128, (1, 150), generator=gen)]
        for ids in turns:
            expected = reference_logits(model, ref, ids, pos)
            assert_close(forward_tokens(model, cache, ids, pos), expected)
            pos += ids.shape[1]
        assert cache.logical_length() == pos and cache.layers[0].appended == pos - tokens
        # forget the last turn, then continue differently: still exact
        cache.truncate(tokens + 15)
        ref.crop(tokens + 15 - pos)  # transformers 5 crops by a negative count
        assert cache.logical_length() == tokens + 15 and cache.layers[0].stored_length() == tokens + 15
        ids = torch.randint(3, 128, (1, 7), generator=gen)
        assert_close(forward_tokens(model, cache, ids, tokens + 15), reference_logits(model, ref, ids,
                                                                                         tokens + 15))
    # the kept prompt block is never cut into
    cache.truncate(10)
    assert cache.logical_length() == tokens and cache.layers[0].appended == 0


# --- svd -----------------------------------------------------------------------------------------------

def test_svd_settings_and_clash():
    method = make_method("svd", 3.0, {"coef_dtype": "int8"})
    assert method.name == "svd"
    assert method.config.sample_tokens is None and method.config.normalize is False
    assert method.config.coef_dtype == "int8"
    with pytest.raises(ValueError, match="cannot set normalize"):
        make_method("svd", 3.0, {"normalize": True})


def test_svd_full_rank_is_exact():
    model = model_for()
    shape = KVShape.from_config(model.config, BYTES)
    width = shape.kv_heads * shape.head_dim
    method = make_method("svd", 1.0, {"ratio": None, "rank_k": width, "rank_v": width, "recon_fraction": 1.0,
                                      "buffer_tokens": 8, "fold_tokens": 4, "coef_dtype": "model"})
    doc = random_ids(400, 4)
    cache, info = compressed(model, staged(model, doc, method.query_window), method, 1.0)
    assert info["rank_k"] == info["rank_v"] == [width] * shape.layers
    ref = DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        reference_logits(model, ref, doc[None], 0)
        pos = doc.shape[0]
        turns = [torch.randint(3, 128, (1, 12), generator=gen)]
        turns += [torch.randint(3, 128, (1, 1), generator=gen) for _ in range(15)]
        for ids in turns:
            expected = reference_logits(model, ref, ids, pos)
            assert_close(forward_tokens(model, cache, ids, pos), expected)
            pos += ids.shape[1]


# --- offline -------------------------------------------------------------------------------------------

def test_offline_needs_calibration():
    model = model_for()
    with pytest.raises(S4RError, match="calibrat"):
        compressed(model, staged(model, random_ids(400, 6)), make_method("offline", 2.0), 2.0)


def projector_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest entry of the difference of the projectors on two bases' spans (sign-free comparison)."""
    return (a @ a.transpose(-1, -2) - b @ b.transpose(-1, -2)).abs().max().item()


def test_offline_reuses_its_bases_across_prompts(monkeypatch):
    model = model_for()
    ratio = 3.0  # ranks below the full width, so the two bases can differ
    method = calibrated(model, ratio)
    first = staged(model, random_ids(600, 7))
    second = staged(model, random_ids(600, 8))
    width = first.shape.kv_heads * first.shape.head_dim
    # the first prompt's own bases, fitted as s4r would (before fitting is forbidden below)
    rope = model_rope_fn(model)
    own = [fit_layer_bases(layer.keys_view[0], layer.values_view[0], method.config, rope, width, width)
           for layer in first.layers]

    def no_refit(*args, **kwargs):
        raise AssertionError("offline must not fit bases on the prompt")

    monkeypatch.setattr(s4r.core.compress, "fit_basis", no_refit)
    cache_a, info_a = compressed(model, first, method, ratio)
    cache_b, info_b = compressed(model, second, method, ratio)
    # a method built by name (as Session.fork does) finds the registered calibration
    cache_c, info_c = compressed(model, second, make_method("offline", ratio), ratio)
    assert info_a["calibration_tokens"] == 1024
    # ranks come from the calibration's spectra and the length: equal lengths, equal ranks
    assert info_a["rank_k"] == info_b["rank_k"] == info_c["rank_k"]
    assert registered_calibration(cache_a.shape, method.config) is method.calibration
    for i, (a, b, c) in enumerate(zip(cache_a.layers, cache_b.layers, cache_c.layers, strict=True)):
        bases = method.calibration.bases(i, info_a["rank_k"][i], info_a["rank_v"][i])
        for x in (a, b, c):
            assert x.basis_k.data_ptr() == bases.k.data_ptr() and x.basis_v.data_ptr() == bases.v.data_ptr()
        # the prompt's own bases of the same ranks span other subspaces
        assert projector_gap(own[i].k[..., : a.basis_k.shape[-1]], a.basis_k) > 0.05
        assert projector_gap(own[i].v[..., : a.basis_v.shape[-1]], a.basis_v) > 0.05
    # the coefficients do depend on the prompt
    assert not torch.equal(cache_a.layers[0].coef_k, cache_b.layers[0].coef_k)


# --- every method --------------------------------------------------------------------------------------

_RATIO_DOC = 2048


@pytest.fixture(scope="module")
def ratio_source():
    model = model_for()
    return staged(model, random_ids(_RATIO_DOC, 10))


@pytest.mark.parametrize("ratio", [2.0, 5.0])
@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_measured_ratio_meets_the_request(ratio_source, name, ratio):
    model = model_for()
    method = calibrated(model, ratio) if name == "offline" else make_method(name, ratio)
    cache, _ = compressed(model, ratio_source, method, ratio)
    assert cache.ratio() >= ratio
    # the question (within the reserved buffer) keeps every method within 1/ratio of the full cache
    with torch.inference_mode():
        logits = forward_tokens(model, cache, random_ids(48, 11)[None], _RATIO_DOC)
    assert cache.logical_length() == _RATIO_DOC + 48
    assert cache.ratio() >= ratio and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_prefills_and_decodes(arch, name):
    model = model_for(arch)
    ratio = 3.0
    method = calibrated(model, ratio) if name == "offline" else make_method(name, ratio)
    doc = random_ids(400, 12)
    cache, _ = compressed(model, staged(model, doc), method, ratio)
    gen = torch.Generator().manual_seed(13)
    with torch.inference_mode():
        logits = forward_tokens(model, cache, torch.randint(3, 128, (1, 12), generator=gen), 400)
        assert torch.isfinite(logits).all()
        for _ in range(10):
            token = torch.argmax(logits).view(1, 1)
            logits = forward_tokens(model, cache, token, cache.logical_length())
            assert torch.isfinite(logits).all()
    assert cache.logical_length() == 400 + 12 + 10


def test_session_forks_every_baseline_from_one_prefill():
    model = model_for()
    loaded = SimpleNamespace(model=model, tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    base = Session(loaded, method="full")
    base.ingest("The quick brown fox jumps over the lazy dog. " * 30, compress=False)
    OfflineMethod().calibrate(base, "Two households, both alike in dignity, in fair Verona. " * 20)
    for name in ("streaming", "snapkv", "svd", "offline"):
        fork = base.fork(method=name, ratio=2.0)
        _, stats = fork.ask("Who jumps?", max_new_tokens=5)
        assert stats.memory.ratio >= 2.0, name
    # the staged prefill is untouched by the forks
    assert all(type(layer) is StagingLayer for layer in base.cache.layers)
