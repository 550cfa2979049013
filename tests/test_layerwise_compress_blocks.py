"""A layer compressed in token blocks stores exactly what whole-layer compression stored before blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import s4r.core.compress as compress_mod
from s4r.config import S4RConfig
from s4r.core.coef_bands import encode_coefficients
from s4r.core.compress import (
    compress_layer,
    compressible_parts,
    extend_layer_bases,
    fit_layer_bases,
    layer_parts,
    outlier_tokens,
    token_blocks,
)
from s4r.core.subspace import fit_basis, hybrid_sample_indices, normalize_rows, project
from s4r.layers.lowrank import LowRankLayer
from s4r.runtime.session import Session
from tests.helpers import CharTokenizer, tiny_model

HEADS, DIM = 2, 16
TEXT = "".join(chr(97 + (i * 7919) % 26) for i in range(900))


def toy_rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float().unsqueeze(1) * torch.linspace(0.01, 1.0, DIM // 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def layer_inputs(tokens: int, seed: int = 0):
    """Keys/values [H, T, d] of a low-rank structure plus heavy-tailed spikes (outliers to find)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(HEADS, tokens, 4, generator=g) @ torch.randn(HEADS, 4, DIM, generator=g)
    spikes = torch.randn(HEADS, tokens, DIM, generator=g).pow(3)
    keys = (3 * low + 0.3 * spikes).bfloat16()
    values = (torch.randn(HEADS, tokens, 6, generator=g) @ torch.randn(HEADS, 6, DIM, generator=g)
              + 0.2 * spikes).bfloat16()
    queries = torch.randn(2 * HEADS, 8, DIM, generator=g).bfloat16()
    return keys, values, queries


def whole_layer_reference(keys, values, queries, cfg, rank_k, rank_v, rope) -> LowRankLayer:
    """compress_layer without blocks: every non-sink token in fp32 at once, bases from the
    sample of those fp32 copies, outliers from the whole layer's residuals."""
    s = min(cfg.sinks, keys.shape[1])
    k_groups, v_groups = compressible_parts(keys, values, cfg, rope)
    idx = hybrid_sample_indices(k_groups.shape[1], cfg.sample_tokens, cfg.recent_share)
    bases = []
    for groups, rank in ((k_groups, rank_k), (v_groups, rank_v)):
        sample = groups[:, idx]
        bases.append(fit_basis(normalize_rows(sample) if cfg.normalize else sample, rank))
    basis_k, basis_v = bases
    coef_k, scale_k, tail_k, step_k = encode_coefficients(project(k_groups, basis_k), cfg, keys.dtype)
    coef_v, scale_v, tail_v, step_v = encode_coefficients(project(v_groups, basis_v), cfg, keys.dtype)
    out = outlier_tokens(k_groups, v_groups, basis_k, basis_v, cfg.outlier_count(k_groups.shape[1]),
                         cfg.local_window)
    full = compress_layer(keys, values, queries, cfg, rank_k, rank_v, rope)  # for the query part only
    return LowRankLayer(cfg=cfg, sink_k=keys[:, :s].clone(), sink_v=values[:, :s].clone(),
                        basis_k=basis_k.bfloat16(), basis_v=basis_v.bfloat16(), coef_k=coef_k, coef_v=coef_v,
                        scale_k=scale_k, scale_v=scale_v, query_coef=full.query_coef, rope=rope,
                        out_idx=out.to(torch.int32), out_k=keys[:, s + out], out_v=values[:, s + out],
                        tail_k=tail_k, tail_v=tail_v, tail_step_k=step_k, tail_step_v=step_v)


def assert_same_state(a: LowRankLayer, b: LowRankLayer) -> None:
    sa, sb = a.state(), b.state()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def test_token_blocks_cover_every_row_once_and_none_is_short():
    for n, block in [(0, 64), (5, 64), (64, 64), (65, 64), (127, 64), (128, 64), (200, 64), (1000, 7)]:
        blocks = token_blocks(n, block)
        assert [i for rows in blocks for i in range(n)[rows]] == list(range(n))
        assert all(rows.stop - rows.start >= min(block, n) for rows in blocks)
        assert all(rows.stop - rows.start < 2 * block for rows in blocks) or len(blocks) == 1


@pytest.mark.parametrize("overrides", [
    {},  # the default: layer basis, int8 + 4/2-bit bands, residual outliers
    {"granularity": "head"},
    {"key_space": "pre_rope"},
    {"coef_dtype": "model", "coef_bands": None},
    {"coef_bands": None, "outlier_fraction": 0.1},
])
def test_blocked_compression_stores_what_the_whole_layer_did(overrides):
    cfg = S4RConfig(ratio=2.0, sample_tokens=96, local_window=8, **overrides)
    keys, values, queries = layer_inputs(700)
    rank = 12 if cfg.granularity == "layer" else 8
    want = whole_layer_reference(keys, values, queries, cfg, rank, rank - 2, toy_rope)
    # 696 stored tokens in blocks of 64 (the last one 120): eleven blocks
    got = compress_layer(keys, values, queries, cfg, rank, rank - 2, toy_rope, block_tokens=64)
    assert got.out_idx is not None and got.out_idx.numel() > 0
    assert_same_state(got, want)


def test_attention_scored_outliers_are_unchanged_by_blocks():
    cfg = S4RConfig(key_space="post_rope",
                    ratio=2.0, sample_tokens=96, local_window=8, outlier_score="attention")
    keys, values, queries = layer_inputs(500, seed=1)
    one = compress_layer(keys, values, queries, cfg, 12, 10, None, block_tokens=10_000)
    assert_same_state(compress_layer(keys, values, queries, cfg, 12, 10, None, block_tokens=50), one)


def test_bases_come_from_the_sampled_tokens_as_before():
    cfg = S4RConfig(ratio=2.0, sample_tokens=96, key_space="pre_rope")
    keys, values, _ = layer_inputs(400, seed=2)
    k_groups, v_groups = compressible_parts(keys, values, cfg, toy_rope)
    idx = hybrid_sample_indices(k_groups.shape[1], cfg.sample_tokens, cfg.recent_share)
    bases = fit_layer_bases(keys, values, cfg, toy_rope, 10, 9)
    assert torch.equal(bases.k, fit_basis(normalize_rows(k_groups[:, idx]), 10))
    assert torch.equal(bases.v, fit_basis(normalize_rows(v_groups[:, idx]), 9))


def test_one_conversion_of_a_short_layer_serves_its_sample_bases_and_coefficients():
    """A layer of one compression block is converted once (`layer_parts`): bases fitted or extended from
    its rows, and the layer it stores, are those of converting the sample and the block apart."""
    cfg = S4RConfig(ratio=2.0, sample_tokens=96, local_window=8, key_space="pre_rope")
    keys, values, queries = layer_inputs(300, seed=3)
    parts = layer_parts(keys, values, cfg, toy_rope)
    assert parts is not None and layer_parts(keys, values, cfg, toy_rope, block_tokens=64) is None
    assert all(torch.equal(a, b) for a, b in zip(parts, compressible_parts(keys, values, cfg, toy_rope),
                                                 strict=True))
    fitted, apart = fit_layer_bases(keys, values, cfg, toy_rope, 10, 9, parts), fit_layer_bases(
        keys, values, cfg, toy_rope, 10, 9)
    assert torch.equal(fitted.k, apart.k) and torch.equal(fitted.v, apart.v)
    prefix_k, prefix_v = fitted.k[..., :6], fitted.v[..., :5]
    extended = extend_layer_bases(keys, values, cfg, toy_rope, prefix_k, prefix_v, 12, 10, parts)
    alone = extend_layer_bases(keys, values, cfg, toy_rope, prefix_k, prefix_v, 12, 10)
    assert torch.equal(extended.k, alone.k) and torch.equal(extended.v, alone.v)
    # the same layer through several blocks converts each block apart
    blocked = compress_layer(keys, values, queries, cfg, 12, 10, toy_rope, block_tokens=64)
    assert_same_state(compress_layer(keys, values, queries, cfg, 12, 10, toy_rope, parts=parts), blocked)


def test_layerwise_ingest_is_the_same_with_small_compression_blocks(monkeypatch):
    loaded = SimpleNamespace(model=tiny_model("llama", num_hidden_layers=3), tokenizer=CharTokenizer(),
                             name="tiny", device="cpu", dtype=torch.float32, context_length=4096)

    def run():
        session = Session(loaded, method="s4r", ratio=2.0, chunk_size=128)
        assert session.ingest(TEXT).mode == "layerwise"
        answer, _ = session.ask("what?", max_new_tokens=6)
        return session, answer

    whole, whole_answer = run()
    # the defaults compress these 900 tokens in one block; 64-token blocks go through every path
    monkeypatch.setattr(compress_mod, "COMPRESS_BLOCK", 64)
    blocked, blocked_answer = run()
    assert blocked_answer == whole_answer
    for a, b in zip(blocked.cache.layers, whole.cache.layers, strict=True):
        assert_same_state(a, b)
