"""Attention kernels of the decode step: folded grouped heads, latent-space logits and attention,
and the selection of a token that wins the attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from s4r.config import S4RConfig
from s4r.core.compress import compress_layer
from s4r.core.latent import latent_logits
from s4r.core.subspace import head_blocks
from s4r.hf.attention import MATMUL_MIN_KEYS, causal_attention, causal_mask
from s4r.layers.full import to_groups

HEADS, GROUP, DIM = 3, 3, 16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_gqa(query, key, value, scaling, prefix=None):
    """enable_gqa SDPA with an explicit bottom-right causal mask (the unfolded computation)."""
    mask = causal_mask(query.shape[-2], key.shape[-2], prefix)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


@pytest.mark.parametrize("q_len", [1, 2, 5, 16])
@pytest.mark.parametrize("prefix", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", [40, MATMUL_MIN_KEYS + 88])  # bf16 past the threshold: two products
def test_folded_heads_equal_enable_gqa(q_len, prefix, dtype, keys):
    g = gen(q_len)
    query = torch.randn(1, HEADS * GROUP, q_len, DIM, generator=g).to(dtype)
    key = torch.randn(1, HEADS, keys, DIM, generator=g).to(dtype)
    value = torch.randn(1, HEADS, keys, DIM, generator=g).to(dtype)
    got = causal_attention(query, key, value, 0.3, prefix=prefix)
    expected = reference_gqa(query, key, value, 0.3, prefix)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # the causal part matters: the first query must not see the last key
    if q_len > 1:
        changed = value.clone()
        changed[:, :, -1] += 10
        again = causal_attention(query, key, changed, 0.3, prefix=prefix)
        torch.testing.assert_close(again[:, :, 0], got[:, :, 0])
        assert not torch.allclose(again[:, :, -1], got[:, :, -1])


@pytest.mark.parametrize("groups", [1, HEADS])
def test_latent_logits_equal_dense_logits_at_full_rank(groups):
    g = gen(1)
    width = DIM if groups == HEADS else DIM * HEADS
    basis = torch.linalg.qr(torch.randn(groups, width, width, generator=g))[0]
    keys = torch.randn(HEADS, 50, DIM, generator=g)
    query = torch.randn(HEADS, GROUP, DIM, generator=g)  # folded query rows per KV head
    grouped = keys if groups == HEADS else keys.transpose(0, 1).reshape(1, 50, width)
    coef = grouped @ basis  # [G, N, r]
    q_lat = query @ head_blocks(basis, HEADS)
    got = latent_logits(q_lat, coef.transpose(1, 2).contiguous(), None, 0.25)
    expected = (query @ keys.transpose(1, 2)) * 0.25
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_int8_latent_logits_track_the_float_ones():
    g = gen(2)
    coef = torch.randn(1, 64, 300, generator=g)
    scale = coef.abs().amax(dim=1) / 127
    q8 = torch.round(coef / scale.unsqueeze(1)).to(torch.int8)
    q_lat = torch.randn(HEADS, GROUP, 64, generator=g)
    got = latent_logits(q_lat, q8, scale, 1.0)
    expected = latent_logits(q_lat, q8.float() * scale.unsqueeze(1), None, 1.0)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 0.02


def layer_and_dense(cfg: S4RConfig, seed: int = 0, tokens: int = 200):
    """A compressed layer of random keys/values, its dense K/V and a query window."""
    g = gen(seed)
    keys = torch.randn(HEADS, tokens, DIM, generator=g)
    values = torch.randn(HEADS, tokens, DIM, generator=g)
    queries = torch.randn(HEADS * GROUP, 8, DIM, generator=g)
    width = DIM * HEADS if cfg.granularity == "layer" else DIM
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k or width, cfg.rank_v or width, None)
    return layer, keys, values


def step(layer, keys, values, query, new_k, new_v):
    """Append one token and attend; also return the dense reference over every token."""
    layer.update(new_k, new_v)
    out = layer.attend(query, None, None, DIM**-0.5)
    all_k = torch.cat([keys, new_k[0]], dim=1).unsqueeze(0)
    all_v = torch.cat([values, new_v[0]], dim=1).unsqueeze(0)
    return out, causal_attention(query, all_k, all_v, DIM**-0.5)


@pytest.mark.parametrize("scoring", ["query", "max", "mean", "summed"])
@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("shared", [True, False])
def test_latent_attention_equals_full_attention_at_full_rank(scoring, granularity, shared):
    width = DIM * HEADS if granularity == "layer" else DIM
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=width, rank_v=width, coef_dtype="model", sample_tokens=None,
                    recon_fraction=1.0, granularity=granularity, scoring=scoring, outlier_fraction=0.05,
                    shared_selection=shared)
    layer, keys, values = layer_and_dense(cfg)
    g = gen(5)
    query = torch.randn(1, HEADS * GROUP, 1, DIM, generator=g)
    new = torch.randn(1, HEADS, 1, DIM, generator=g)
    out, expected = step(layer, keys, values, query, new, new)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize(("coef_dtype", "bands"), [("model", None), ("int8", None), ("int8", "8:2,4:3,2:3")],
                         ids=["model", "int8", "bands"])
def test_latent_attention_equals_reconstructing_attention(granularity, shared, coef_dtype, bands):
    """At a partial selection, the latent path gives what exact attention gives over the inputs' sinks,
    outliers and new token and the selected tokens' input keys and values projected on the layer's
    bases. The expectation comes from the inputs, not from what the layer stored: a layer that stored
    its sinks, outliers or buffer wrongly fails here. Stored coefficients in the model's dtype are the
    projection itself; int8 and banded ones round it (hence their wider tolerance)."""
    width = DIM * HEADS if granularity == "layer" else DIM
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=width // 2, rank_v=width // 2, coef_dtype=coef_dtype, coef_bands=bands,
                    sample_tokens=None, recon_fraction=0.3, granularity=granularity, outlier_fraction=0.05,
                    shared_selection=shared)
    layer, keys, values = layer_and_dense(cfg, seed=3)
    g = gen(6)
    query = torch.randn(1, HEADS * GROUP, 1, DIM, generator=g)
    new_k, new_v = torch.randn(2, 1, HEADS, 1, DIM, generator=g)
    layer.update(new_k, new_v)
    out = layer.attend(query, None, None, DIM**-0.5)
    idx, s = layer.selected, layer.sinks
    assert (layer.tail_k is not None) == (bands is not None)

    def projected(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        """The selected tokens of input `x` [H, T, d] projected on `basis`, per head [H, k, d]."""
        coef = to_groups(x[:, s:], basis.shape[0]).float() @ basis.float()  # [G, N, r]
        rows = coef[0][idx] if coef.shape[0] == 1 else torch.gather(
            coef, 1, idx.unsqueeze(-1).expand(-1, -1, coef.shape[-1]))
        return rows @ head_blocks(basis.float(), HEADS).transpose(1, 2)

    outliers = s + layer.out_idx.long()
    all_k = torch.cat([keys[:, :s], keys[:, outliers], projected(keys, layer.basis_k), new_k[0]], dim=1)
    all_v = torch.cat([values[:, :s], values[:, outliers], projected(values, layer.basis_v), new_v[0]], dim=1)
    expected = causal_attention(query, all_k.unsqueeze(0), all_v.unsqueeze(0), DIM**-0.5)
    tol = {"model": 1e-4, "int8": 2e-2, "bands": 6e-2}["bands" if bands else coef_dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    if shared:
        assert bool((idx == idx[:1]).all())


@pytest.mark.parametrize("scoring", ["query", "max", "mean", "summed"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("bands", [None, "8:2,4:3,2:3"])
def test_a_token_planted_to_win_the_attention_is_selected(scoring, shared, bands):
    """With sparse reconstruction (recon_fraction < 1) and no outliers, a stored token whose key
    matches the query is among the reconstructed ones, and dominates the output as it should (with
    coefficient bands the scoring sees only the int8 band)."""
    width = DIM * HEADS
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=width, rank_v=width, coef_dtype="int8", sample_tokens=None,
                    recon_fraction=0.05, recon_drop=None, outlier_fraction=0.0, scoring=scoring,
                    local_window=4, shared_selection=shared, coef_bands=bands)
    g = gen(9)
    tokens, planted = 400, 123
    keys = torch.randn(HEADS, tokens, DIM, generator=g) * 0.3
    values = torch.randn(HEADS, tokens, DIM, generator=g)
    direction = torch.randn(HEADS, DIM, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    keys[:, planted] = 12 * direction
    query = (4 * direction).repeat_interleave(GROUP, dim=0).view(1, HEADS * GROUP, 1, DIM)
    layer = compress_layer(keys, values, query[0], cfg, width, width, None)
    new = torch.zeros(1, HEADS, 1, DIM)
    layer.update(new, new)
    out = layer.attend(query, None, None, DIM**-0.5)
    stored = planted - cfg.sinks
    assert layer.selected.shape[1] < 0.1 * layer.stored_coefs
    assert bool((layer.selected == stored).any(dim=1).all())
    # the output is (close to) the planted value, as in full attention
    all_k, all_v = torch.cat([keys, new[0]], 1)[None], torch.cat([values, new[0]], 1)[None]
    expected = causal_attention(query, all_k, all_v, DIM**-0.5)
    if bands is None:
        torch.testing.assert_close(out, expected, atol=0.05, rtol=0.05)  # int8 coefficients: ~1% off
    else:  # these random values have a flat spectrum: the 2- and 4-bit bands round them coarsely
        cos = torch.nn.functional.cosine_similarity(out.flatten(), expected.flatten(), dim=0)
        assert cos > 0.9, float(cos)


@pytest.mark.parametrize("scoring", ["query", "max", "summed"])
@pytest.mark.parametrize("q_len", [5, 12])
def test_a_chunk_of_queries_attends_causally_and_exactly_at_full_rank(scoring, q_len):
    """Several new tokens at once (a question): each sees the stored tokens and the chunk up to itself;
    a chunk longer than the query window takes the gathered-logits path."""
    width = DIM * HEADS
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=width, rank_v=width, coef_dtype="model", sample_tokens=None,
                    recon_fraction=1.0, scoring=scoring, query_window=8, buffer_tokens=8, fold_tokens=4)
    layer, keys, values = layer_and_dense(cfg, seed=4)
    g = gen(7)
    for _ in range(2):  # the second chunk folds part of the first into coefficients
        query = torch.randn(1, HEADS * GROUP, q_len, DIM, generator=g)
        new_k = torch.randn(1, HEADS, q_len, DIM, generator=g)
        new_v = torch.randn(1, HEADS, q_len, DIM, generator=g)
        out, expected = step(layer, keys, values, query, new_k, new_v)
        keys, values = torch.cat([keys, new_k[0]], dim=1), torch.cat([values, new_v[0]], dim=1)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert layer.stored_coefs > 200 - cfg.sinks


def test_relevance_keeps_a_sharp_query_and_forgets_it_slowly():
    from s4r.core.selection import decay_factor, update_relevance

    decay = decay_factor(4)  # weight halves every 4 queries
    sharp = torch.zeros(1, 2, 1, 5)
    sharp[0, 1, 0, 2] = 0.9  # one head of the group attends token 2 sharply
    flat = torch.full((1, 2, 1, 5), 0.2)
    rel = update_relevance(None, sharp, decay, "max")
    assert rel.argmax().item() == 2 and rel[0, 2].item() == pytest.approx(0.9)
    for _ in range(4):
        rel = update_relevance(rel, flat, decay, "max")
    assert rel[0, 2].item() == pytest.approx(0.45, rel=1e-5)  # halved after 4 queries, still the top
    assert update_relevance(rel, sharp, decay, "query")[0, 2].item() == pytest.approx(0.9)
    mean = update_relevance(None, sharp, decay, "mean")
    assert mean[0, 2].item() == pytest.approx(0.45 * (1 - decay))  # group mean, weighted 1 - decay


def test_the_cast_route_for_int8_coefficients_matches_the_int8_matmul(monkeypatch):
    """GPUs cast int8 coefficients instead of `torch._int_mm` (CPU only): both routes agree."""
    import s4r.core.latent

    g = gen(11)
    coef = torch.randint(-127, 128, (1, 48, 500), generator=g, dtype=torch.int8)
    scale = torch.rand(1, 500, generator=g) / 100
    q_lat = torch.randn(HEADS, GROUP, 48, generator=g)
    fast = latent_logits(q_lat, coef, scale, 0.5)
    monkeypatch.setattr(s4r.core.latent, "int8_matmul_available", lambda device: False)
    cast = latent_logits(q_lat, coef, scale, 0.5)
    exact = latent_logits(q_lat, coef.float(), scale, 0.5)
    for got in (fast, cast):
        assert ((got - exact).abs().max() / exact.abs().max()).item() < 0.02


def test_a_full_layer_attends_over_bucketed_spare_rows_exactly():
    """A bf16 decode step over many keys runs on a key count rounded up into the layer's spare rows,
    zeroed the first time they are read (they start uninitialized) or holding forgotten tokens: either
    way masked out, SDPA's attention."""
    from s4r.hf.attention import KEY_BUCKET
    from s4r.layers.full import FullLayer

    g = gen(3)
    layer = FullLayer()
    n = MATMUL_MIN_KEYS + 100
    layer.update(torch.randn(1, HEADS, n, DIM, generator=g).bfloat16(),
                 torch.randn(1, HEADS, n, DIM, generator=g).bfloat16())
    keys, values = layer.update(torch.randn(1, HEADS, 1, DIM, generator=g).bfloat16(),
                                torch.randn(1, HEADS, 1, DIM, generator=g).bfloat16())
    width = -(-(n + 1) // KEY_BUCKET) * KEY_BUCKET
    assert layer._k.shape[2] >= width > n + 1  # room to pad into
    layer._k[:, :, n + 1 :] = float("nan")  # uninitialized capacity: zeroed before it is read
    layer._v[:, :, n + 1 :] = float("nan")
    query = torch.randn(1, HEADS * GROUP, 1, DIM, generator=g).bfloat16()
    expected = causal_attention(query, keys, values, DIM**-0.5, sdpa_only=True)
    got = layer.attend(query, keys, values, DIM**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert not layer._k[:, :, : width].isnan().any() and layer._k[:, :, width:].isnan().all()
    layer.truncate(n - 10)  # forgotten tokens stay in the rows the next steps pad with
    layer._v[:, :, n - 10 : width] = 1e4
    keys, values = layer.update(keys[:, :, :1], values[:, :, :1])
    expected = causal_attention(query, keys, values, DIM**-0.5, sdpa_only=True)
    got = layer.attend(query, keys, values, DIM**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
