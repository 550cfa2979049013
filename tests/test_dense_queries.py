"""A block of queries attends every stored token rebuilt (`s4r.layers.lowrank_dense`): the same attention
as the selection path with every token selected, exact at full rank, the fused rebuild
(`lowrank_dense.rebuild_fused`) equal to its torch reference, over key spaces, bands, head groupings,
dtypes and segments."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.compress import compress_layer
from s4r.core.rope import shifted
from s4r.hf.attention import causal_attention
from s4r.kernels import jit
from s4r.layers import lowrank_dense
from s4r.layers.segments import SegmentedLayer
from tests.test_fused_kernels import D, kv_data, rope_for

Q_HEADS, KV_HEADS = 9, 3
BLOCK = 24  # queries in a block (at least the configs' `dense_queries`)
DENSE = 2  # every block of two or more queries attends every stored token (the default sends prompts through
# the selection: `test_short_blocks_and_single_tokens_select`)
# every stored token selected, so the selection path attends what the dense path does, its keys rebuilt
# in the model's dtype as a block rebuilds them
EVERY_TOKEN = dict(recon_fraction=1.0, recon_cap=1.0, recon_drop=None, recon_token_cap=0,
                   rebuild_dtype="model")

CONFIGS = {
    "pre-rope": S4RConfig(ratio=None, rank_k=24, rank_v=24, dense_queries=DENSE),
    "pre-rope-int8": S4RConfig(ratio=None, rank_k=24, rank_v=24, coef_bands=None, dense_queries=DENSE),
    "post-rope": replace(S4RConfig.fast(5.0), ratio=None, rank_k=24, rank_v=24, dense_queries=DENSE),
    "per-head-bases": S4RConfig(ratio=None, rank_k=16, rank_v=16, granularity="head", dense_queries=DENSE),
    "post-rope-per-head": replace(S4RConfig.fast(5.0), ratio=None, rank_k=16, rank_v=16, granularity="head",
                                  dense_queries=DENSE),
    "post-rope-model-dtype": replace(S4RConfig.fast(5.0), ratio=None, rank_k=24, rank_v=24,
                                     coef_dtype="model", dense_queries=DENSE),
}


def close_to_selection(dense: torch.Tensor, chosen: torch.Tensor, cfg: S4RConfig) -> None:
    """Post-RoPE selection with int8 coefficients scores its logits with the query rounded (int8 or
    bf16, `s4r.core.latent`), the dense path dots the rebuilt keys in float: a looser bound there."""
    if cfg.key_space == "post_rope" and cfg.coef_dtype == "int8":
        assert (dense - chosen).abs().max() <= 0.05 * chosen.abs().max()
    else:
        torch.testing.assert_close(dense, chosen, rtol=2e-4, atol=2e-4)


def compressed(cfg: S4RConfig, tokens: int = 700, dtype: torch.dtype = torch.float32, seed: int = 0,
               heads: tuple[int, int] = (Q_HEADS, KV_HEADS)):
    q_heads, kv_heads = heads
    keys, values, queries = kv_data(kv_heads, q_heads, tokens, dtype, seed=seed)
    return compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(q_heads, kv_heads))


def block(dtype: torch.dtype, q_len: int = BLOCK, seed: int = 1,
          heads: tuple[int, int] = (Q_HEADS, KV_HEADS)):
    """A block of `q_len` new tokens: their keys, values and queries."""
    q_heads, kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    new_k = torch.randn(1, kv_heads, q_len, D, generator=g).to(dtype)
    new_v = torch.randn(1, kv_heads, q_len, D, generator=g).to(dtype)
    query = torch.randn(1, q_heads, q_len, D, generator=g).to(dtype)
    return new_k, new_v, query


def attend_block(layer, new_k, new_v, query) -> torch.Tensor:
    layer.update(new_k, new_v)
    return layer.attend(query, None, None, D ** -0.5).float()


def with_cfg(layer, **changes):
    """A deep copy of `layer` whose segments have the settings `changes`."""
    twin = copy.deepcopy(layer)
    for seg in getattr(twin, "segments", [twin]):
        seg.cfg = replace(seg.cfg, **changes)
    return twin


@pytest.fixture(autouse=True)
def _no_kept_rows():
    lowrank_dense.forget_rebuilt()
    yield
    lowrank_dense.forget_rebuilt()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("heads", [(9, 3), (2, 2)])
def test_dense_block_is_the_selection_of_every_token(name, heads):
    cfg = replace(CONFIGS[name], **EVERY_TOKEN)
    layer = compressed(cfg, heads=heads)
    selecting = with_cfg(layer, dense_queries=0)
    args = block(torch.float32, heads=heads)
    dense = attend_block(layer, *args)
    chosen = attend_block(selecting, *args)
    assert layer.selected.shape[-1] == layer._n
    # the reference really attended every token (the outliers: their exact rows)
    assert selecting.selected.shape[-1] == selecting._n - selecting._n_out
    close_to_selection(dense, chosen, cfg)


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_dense_block_at_full_rank_is_exact_attention(key_space):
    """Full rank, coefficients in the model's dtype: the rebuilt tokens are the tokens, so the block's
    attention is exact attention over every key it was given (sinks, stored, buffer, its own)."""
    rope = rope_for(Q_HEADS, KV_HEADS)
    cfg = S4RConfig(ratio=None, rank_k=KV_HEADS * D, rank_v=KV_HEADS * D, coef_dtype="model",
                    key_space=key_space, dense_queries=DENSE)
    keys, values, queries = kv_data(KV_HEADS, Q_HEADS, 500, torch.float32, seed=5)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope)
    new_k, new_v, query = block(torch.float32)
    out = attend_block(layer, new_k, new_v, query)
    all_k = torch.cat([keys.unsqueeze(0), new_k], dim=2)  # the model's keys (RoPE applied)
    all_v = torch.cat([values.unsqueeze(0), new_v], dim=2)
    want = causal_attention(query, all_k, all_v, D ** -0.5).float()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [name for name, cfg in CONFIGS.items() if cfg.coef_dtype == "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rebuild_is_the_reference(name, dtype):
    pytest.importorskip("numba")
    layer = compressed(CONFIGS[name], dtype=dtype)
    assert lowrank_dense.fused_usable(layer)
    n, heads = layer._n, layer.heads
    k1, v1 = (torch.empty(heads, n, D, dtype=dtype) for _ in range(2))
    k2, v2 = (torch.full((heads, n, D), float("nan"), dtype=dtype) for _ in range(2))
    lowrank_dense.layer_tokens_reference(layer, k1, v1)
    lowrank_dense.rebuild_fused(layer, k2, v2)
    assert not jit._state["failed"]
    # bf16: the fused path rounds a rotated key once, the reference twice (rebuilt, then rotated)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((k2, k1), (v2, v1)):
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= tol * scale


def test_the_eager_setting_rebuilds_through_the_reference(monkeypatch):
    layer = compressed(replace(CONFIGS["pre-rope"], kernels="eager"))
    assert not lowrank_dense.fused_usable(layer)
    calls = []
    reference = lowrank_dense.layer_tokens_reference
    monkeypatch.setattr(lowrank_dense, "layer_tokens_reference", lambda *a: calls.append(1) or reference(*a))
    attend_block(layer, *block(torch.float32))
    assert calls == [1]


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_dense_block_over_segments_is_the_selection_of_every_token(key_space):
    rope = rope_for(Q_HEADS, KV_HEADS)
    cfg = S4RConfig(ratio=None, rank_k=24, rank_v=24, key_space=key_space, dense_queries=DENSE, **EVERY_TOKEN)
    k1, v1, q1 = kv_data(KV_HEADS, Q_HEADS, 600, torch.float32, seed=3)
    k2, v2, q2 = kv_data(KV_HEADS, Q_HEADS, 500, torch.float32, seed=4)
    first = compress_layer(k1, v1, q1, cfg, 24, 24, rope)
    second = compress_layer(k2, v2, q2, replace(cfg, sinks=0), 20, 20, shifted(rope, 600))
    layer = SegmentedLayer([first, second])
    selecting = with_cfg(layer, dense_queries=0)
    args = block(torch.float32)
    dense = attend_block(layer, *args)
    chosen = attend_block(selecting, *args)
    assert [s.shape[-1] for s in layer.selected] == [first._n, second._n]
    close_to_selection(dense, chosen, cfg)


def test_blocks_of_one_layer_reuse_its_rebuilt_tokens_and_a_truncation_forgets_them(monkeypatch):
    """The second block of an appended text attends the stored tokens rebuilt for the first; after a
    truncation and different tokens, the rows are rebuilt again (as a fresh layer computes them)."""
    cfg = CONFIGS["pre-rope"]
    layer = compressed(cfg)
    rebuilds = []
    stored = lowrank_dense.stored_tokens
    monkeypatch.setattr(lowrank_dense, "stored_tokens", lambda *a: rebuilds.append(1) or stored(*a))
    layer.collecting = True  # an appended document: its blocks stay in the buffer
    first, second = block(torch.float32, seed=1), block(torch.float32, seed=2)
    attend_block(layer, *first)
    fresh = copy.deepcopy(layer)
    out = attend_block(layer, *second)
    assert len(rebuilds) == 1
    lowrank_dense.forget_rebuilt()
    torch.testing.assert_close(out, attend_block(fresh, *second))
    assert len(rebuilds) == 2

    logical = layer.logical
    layer.truncate(logical - 2 * BLOCK)
    other = block(torch.float32, seed=3)
    twin = copy.deepcopy(layer)
    out = attend_block(layer, *other)
    assert len(rebuilds) == 3
    lowrank_dense.forget_rebuilt()
    torch.testing.assert_close(out, attend_block(twin, *other))


def test_short_blocks_and_single_tokens_select():
    assert S4RConfig().dense_queries > 100  # a question's prompt selects by default
    cfg = replace(CONFIGS["pre-rope"], dense_queries=S4RConfig().dense_queries)
    layer = compressed(cfg)
    out = attend_block(layer, *block(torch.float32, q_len=cfg.dense_queries - 1))
    assert layer.selected.shape[-1] < layer._n and torch.isfinite(out).all()
    assert not lowrank_dense.attends_every_token(layer, 1)
    assert lowrank_dense.attends_every_token(layer, cfg.dense_queries)
    assert not lowrank_dense.attends_every_token(replace_cfg(layer, dense_queries=0), 10**6)
    assert not lowrank_dense.attends_every_token(replace_cfg(layer, scoring="max"), 10**6)


def test_every_block_of_a_document_being_read_attends_every_token():
    """An appended document's last, shorter block attends every stored token as its earlier blocks did;
    once the document is settled a short block (a question's prompt) selects again."""
    cfg = replace(CONFIGS["pre-rope"], dense_queries=S4RConfig().dense_queries)
    layer = compressed(cfg)
    layer.collecting = True
    assert lowrank_dense.attends_every_token(layer, 1)
    out = attend_block(layer, *block(torch.float32, q_len=5))
    assert layer.selected.shape[-1] == layer._n and torch.isfinite(out).all()
    layer.collecting = False
    attend_block(layer, *block(torch.float32, q_len=5, seed=4))
    assert layer.selected.shape[-1] < layer._n
    layer.collecting = True  # `dense_queries=0`: every block selects, a document's too
    assert not lowrank_dense.attends_every_token(replace_cfg(layer, dense_queries=0), 10**6)


def replace_cfg(layer, **changes):
    layer.cfg = replace(layer.cfg, **changes)
    return layer


def test_negative_dense_queries_is_refused():
    with pytest.raises(ValueError, match="dense_queries"):
        S4RConfig(dense_queries=-1)


def test_every_layers_segment_rope_shares_one_answer_per_offset():
    """`last_answer` keeps a step's rotations on the model's rope: the shifted ropes of one segment (one
    per layer) share an answer, and another offset never gets it."""
    from s4r.core.rope import last_answer

    rope = rope_for(Q_HEADS, KV_HEADS)
    calls = []

    def answer(tag):
        def compute():
            calls.append(tag)
            return tag
        return compute

    layer_a, layer_b, other = shifted(rope, 600), shifted(rope, 600), shifted(rope, 900)
    assert last_answer(rope, "test_memo", (1,), answer("base")) == "base"
    assert last_answer(layer_a, "test_memo", (1,), answer("600")) == "600"
    assert last_answer(layer_b, "test_memo", (1,), answer("again")) == "600"  # the other layer's rope
    assert last_answer(other, "test_memo", (1,), answer("900")) == "900"
    assert last_answer(rope, "test_memo", (1,), answer("base again")) == "base"
    assert last_answer(layer_a, "test_memo", (2,), answer("600 new step")) == "600 new step"
    assert calls == ["base", "600", "900", "600 new step"]


def test_settling_an_appended_text_lets_its_layers_rebuilt_tokens_go():
    from s4r.core.budget import KVShape
    from s4r.layers.segments import settle_appended

    layer = compressed(CONFIGS["pre-rope"])
    layer.collecting = True
    attend_block(layer, *block(torch.float32))
    assert lowrank_dense._kept  # held for the text's next block
    settle_appended(layer, KVShape(layers=1, kv_heads=KV_HEADS, q_heads=Q_HEADS, head_dim=D, dtype_bytes=4))
    assert not lowrank_dense._kept


def test_blocks_that_outgrow_the_kept_buffers_still_reuse_the_rebuilt_tokens(monkeypatch):
    layer = compressed(CONFIGS["pre-rope"])
    rebuilds = []
    stored = lowrank_dense.stored_tokens
    monkeypatch.setattr(lowrank_dense, "stored_tokens", lambda *a: rebuilds.append(1) or stored(*a))
    layer.collecting = True
    capacity = None
    for seed in range(14):  # 14 blocks of 24: past the room the first block's buffers left (256 rows)
        args = block(torch.float32, seed=seed)
        fresh = copy.deepcopy(layer)
        out = attend_block(layer, *args)
        capacity = capacity or lowrank_dense._kept[0].k.shape[1]
        if seed in (0, 13):
            kept = lowrank_dense._kept[:]
            lowrank_dense.forget_rebuilt()
            torch.testing.assert_close(out, attend_block(fresh, *args))
            lowrank_dense._kept[:] = kept
    assert lowrank_dense._kept[0].k.shape[1] > capacity  # the buffers grew
    assert len(rebuilds) == 3  # the first block and the two fresh copies checked: none when they grew
