"""The `quant` and `kvzip` baselines: byte budgets, exactness where nothing is lost, the registry."""

from __future__ import annotations

import pytest
import torch

from s4r.core.budget import KVShape
from s4r.core.quantize import (
    dequantize_groups,
    pack_bits,
    quant_bytes_per_token,
    quantize_groups,
    unpack_bits,
)
from s4r.errors import BudgetError, S4RError
from s4r.hf.generation import forward_tokens
from s4r.layers.quant import QuantLayer
from s4r.methods import METHODS, REGISTRY, make_method
from s4r.methods.kvzip import KVzipMethod, kvzip_indices
from s4r.methods.kvzip_scoring import RepeatChunk, kvzip_scores
from s4r.methods.quant import QuantMethod, plan_quant
from tests.helpers import CharTokenizer
from tests.test_methods import compressed, model_for, random_ids, staged


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


SMOL = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype_bytes=2)


# --- quantization primitives ----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trips(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_bits(packed, bits).long(), codes)


@pytest.mark.parametrize("dim", [-2, -1])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_group_quantization_error_is_within_half_a_step(bits, dim):
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))
    q = quantize_groups(x, bits, 16, dim)
    y = dequantize_groups(q, 16, dim, torch.float32)
    step = q.scale.float().max().item()
    assert (y - x).abs().max().item() <= 0.5 * step * 1.01 + 1e-3
    # codes plus one fp16 scale and zero per group: exactly what nbytes counts
    assert q.nbytes() == x.numel() * bits // 8 + 2 * 2 * (x.numel() // 16)


# --- quant -------------------------------------------------------------------------------------------
def test_bit_width_follows_the_ratio():
    assert plan_quant(SMOL, 4096, 1.5, 64).bits == 8
    assert plan_quant(SMOL, 4096, 2.5, 64).bits == 4
    assert plan_quant(SMOL, 4096, 5.0, 64).bits == 2
    with pytest.raises(BudgetError):
        plan_quant(SMOL, 4096, 8.0, 64)
    best = QuantMethod().max_ratio(SMOL, 4096)
    assert 5.0 < best < 7.0 and plan_quant(SMOL, 4096, best * 0.999, 64).bits == 2
    for ratio in (1.5, 2.5, 5.0):
        plan = plan_quant(SMOL, 4096, ratio, 64)
        assert plan.planned_bytes <= plan.full_bytes / ratio


@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_quant_keeps_its_byte_budget_through_a_long_answer(ratio):
    model = model_for()
    cache, info = compressed(model, staged(model, random_ids(1500, 3)), make_method("quant", ratio), ratio)
    assert all(isinstance(layer, QuantLayer) for layer in cache.layers)
    assert cache.ratio() >= ratio
    # every byte counted: packed codes, fp16 scales and zero points, the full-precision residual
    layer = cache.layers[0]
    per_token = quant_bytes_per_token(2, 16, info["bits"], info["key_group"], info["value_group"])
    assert layer.nbytes() == layer.quantized * per_token + layer.res_k.shape[1] * 2 * 2 * 16 * 4
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for _ in range(100):  # more than the reserve: folds happen on the way
            forward_tokens(model, cache, torch.randint(3, 128, (1, 1), generator=gen), cache.logical_length())
    assert cache.logical_length() == 1600
    assert cache.layers[0].quantized % info["key_group"] == 0 and cache.layers[0].quantized > 1500 - 64


def test_quant_at_eight_bits_is_close_to_the_full_cache():
    model = model_for()
    source = staged(model, random_ids(600, 5))
    full, _ = compressed(model, source, make_method("full", 1.0), 1.0)
    quant, info = compressed(model, source, QuantMethod(ratio=1.5), 1.5)
    assert info["bits"] == 8
    question = random_ids(12, 6)[None]
    with torch.inference_mode():
        ref = forward_tokens(model, full, question, 600)
        got = forward_tokens(model, quant, question, 600)
    assert rel_error(got, ref) < 0.02


def test_quant_truncation_inside_a_group_keeps_the_rest():
    keys = torch.randn(2, 100, 16, generator=torch.Generator().manual_seed(1))
    layer = QuantLayer(keys, keys.clone(), bits=8, key_group=32, value_group=16, reserve=32)
    assert layer.quantized == 96 and layer.stored_length() == 100
    layer.truncate(70)
    assert layer.logical == 70 and layer.stored_length() == 70 and layer.quantized == 64
    old_k, _ = layer.dequantized()
    rebuilt = torch.cat([old_k, layer.res_k], dim=1)
    assert (rebuilt - keys[:, :70]).abs().max() < 0.05


# --- kvzip -------------------------------------------------------------------------------------------
def test_scoring_forward_matches_a_plain_forward_and_leaves_the_cache_alone():
    """The scoring layers' attention is the model's: the repeat chunk's logits equal a plain forward."""
    model = model_for()
    ids = random_ids(300, 7)
    source = staged(model, ids)
    before = source.layers[0].keys_view.clone()
    chunk = random_ids(40, 8)
    plain, _ = compressed(model, source, make_method("full", 1.0), 1.0)
    with torch.inference_mode():
        ref = forward_tokens(model, plain, chunk[None], 300)
    scores = kvzip_scores(model, source, [RepeatChunk(0, 300, chunk.tolist())])
    assert torch.equal(source.layers[0].keys_view, before) and source.logical_length() == 300
    assert len(scores) == len(source.layers) and scores[0].shape == (2, 300)
    assert float(scores[0].min()) >= 0.0 and float(scores[0].max()) <= 1.0
    # the same forward through a scoring cache, checked via its last-token logits
    from s4r.hf.cache import CompressedCache
    from s4r.methods.kvzip_scoring import ScoringLayer

    scoring = CompressedCache(len(source.layers), source.shape, query_window=0)
    scoring.layers = [ScoringLayer(layer.keys_view[0], layer.values_view[0]) for layer in source.layers]
    with torch.inference_mode():
        got = forward_tokens(model, scoring, chunk[None], 300)
    assert rel_error(got, ref) < 1e-4


def test_kvzip_without_eviction_is_exact():
    model = model_for()
    source = staged(model, random_ids(500, 9))
    full, _ = compressed(model, source, make_method("full", 1.0), 1.0)
    kept, info = compressed(model, source, KVzipMethod(ratio=1.0, reserve=0), 1.0)
    assert info["kept_tokens"] == 500
    question = random_ids(10, 10)[None]
    with torch.inference_mode():
        assert rel_error(forward_tokens(model, kept, question, 500),
                         forward_tokens(model, full, question, 500)) < 1e-5


def test_kvzip_keeps_the_sinks_and_the_best_scores():
    scores = torch.tensor([[0.0, 0.0, 0.9, 0.1, 0.8, 0.2], [0.0, 0.5, 0.0, 0.0, 0.0, 0.7]])
    idx = kvzip_indices(scores, budget=3, sinks=1)
    assert idx.tolist() == [[0, 2, 4], [0, 1, 5]]


@pytest.mark.parametrize("ratio", [2.0, 5.0])
def test_kvzip_keeps_its_byte_budget(ratio):
    model = model_for()
    cache, _ = compressed(model, staged(model, random_ids(2048, 11)), make_method("kvzip", ratio), ratio)
    assert cache.ratio() >= ratio
    with torch.inference_mode():
        forward_tokens(model, cache, random_ids(48, 12)[None], 2048)
    assert cache.ratio() >= ratio


def test_kvzip_refuses_without_the_model():
    from s4r.methods import CompressContext

    model = model_for()
    cache = staged(model, random_ids(300, 13))
    with pytest.raises(S4RError, match="kvzip"):
        make_method("kvzip", 2.0).compress(cache, CompressContext(None, 2.0))


# --- registry ----------------------------------------------------------------------------------------
def test_every_registered_method_builds_and_unknown_names_are_refused():
    assert {"quant", "kvzip", "s4r", "full"} <= set(METHODS)
    for name in METHODS:
        assert make_method(name, 3.0).name == name
    with pytest.raises(ValueError, match="unknown method"):
        make_method("nope", 3.0)


def test_a_method_is_one_registry_line(monkeypatch):
    monkeypatch.setitem(REGISTRY, "quant8", lambda r, o: QuantMethod(name="quant8", ratio=1.5))
    assert make_method("quant8", 5.0).name == "quant8"


def test_session_runs_kvzip_from_its_own_prompt():
    from types import SimpleNamespace

    from s4r.runtime.session import Session

    loaded = SimpleNamespace(model=model_for(), tokenizer=CharTokenizer(), name="tiny", device="cpu",
                             dtype=torch.float32, context_length=4096)
    base = Session(loaded, method="full")
    base.ingest("The quick brown fox jumps over the lazy dog. " * 30, compress=False)
    fork = base.fork(method="kvzip", ratio=2.0)
    assert fork.memory().ratio >= 2.0
    answer, _ = fork.ask("What jumps?", max_new_tokens=4)
    assert isinstance(answer, str)


def test_quant_reports_its_own_ratio_limit():
    # ratio_limits must ask quant (it has a reserve field but does not evict: ~126x would be wrong)
    from s4r.runtime.ratio_limits import method_max_ratio

    method = make_method("quant", 2.0)
    best = method_max_ratio(method, SMOL, 4096)
    assert best == pytest.approx(method.max_ratio(SMOL, 4096))
    assert 5.0 < best < 8.0
    plan_quant(SMOL, 4096, best * 0.99, method.reserve)  # reachable just under the limit
    with pytest.raises(BudgetError):
        plan_quant(SMOL, 4096, best * 1.05, method.reserve)
