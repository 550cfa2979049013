"""The selection path of S4R's decode, tested directly: latent scores, pooling, top-k with a planted token,
outlier choice, the hybrid sample and the int8 round trip (constructed cases, no model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.compress import compress_layer, compressible_parts, outlier_tokens
from s4r.core.selection import latent_scores, mass_budget, pool_scores, ranked_candidates, select_tokens
from s4r.core.subspace import dequantize_int8, hybrid_sample_indices, project, project_queries, quantize_int8
from s4r.hf.attention import causal_attention
from s4r.layers.full import to_groups

HEADS, N_REP, DIM = 2, 3, 16  # 2 KV heads, each shared by 3 query heads


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def orthonormal(groups: int, width: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(groups, width, width, generator=rng(seed)))[0]


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_latent_scores_equal_dense_logits_at_full_rank(granularity):
    keys = torch.randn(HEADS, 50, DIM, generator=rng(0))
    query = torch.randn(HEADS * N_REP, DIM, generator=rng(1))
    groups, width = (HEADS, DIM) if granularity == "head" else (1, HEADS * DIM)
    basis = orthonormal(groups, width, 2)
    coef_t = project(to_groups(keys, groups), basis).transpose(1, 2)  # [G, r, N]
    q_lat = project_queries(query.view(HEADS, N_REP, DIM), basis).reshape(HEADS * N_REP, -1)
    # the dense logit of each query head on its KV head's keys, summed over the heads of a group
    dense = torch.einsum("hrd,hnd->hn", query.view(HEADS, N_REP, DIM), keys)
    torch.testing.assert_close(latent_scores(coef_t, None, q_lat, HEADS), dense, rtol=1e-4, atol=1e-4)


def test_pool_scores_spreads_a_peak_to_its_neighbours():
    scores = torch.zeros(1, 9)
    scores[0, 4] = 3.0
    assert pool_scores(scores, 3, "max").tolist() == [[0, 0, 0, 3, 3, 3, 0, 0, 0]]
    assert pool_scores(scores, 1, "max") is scores
    avg = pool_scores(torch.tensor([[3.0, 0, 0, 0, 6]]), 3, "avg")
    torch.testing.assert_close(avg, torch.tensor([[1.5, 1.0, 0.0, 2.0, 3.0]]))  # edges: no padding counted


def test_select_tokens_takes_the_forced_tail_and_the_top_k():
    scores = torch.tensor([[5.0, 1, 9, 2, 0, 0], [0.0, 8, 1, 7, 0, 0]])
    idx = select_tokens(scores, 2, 2)
    assert [sorted(row) for row in idx.tolist()] == [[0, 2, 4, 5], [1, 3, 4, 5]]


def planted_layer(positions: dict[int, int], *, shared: bool) -> tuple:
    """A compressed layer (full rank, exact coefficients, no outliers, a small reconstruction share) of
    random keys where KV head h's key at positions[h] is what its query heads look for; the queries."""
    total = 400
    keys = torch.randn(HEADS, total, DIM, generator=rng(3))
    values = torch.randn(HEADS, total, DIM, generator=rng(4))
    directions = torch.nn.functional.normalize(torch.randn(HEADS, DIM, generator=rng(5)), dim=-1)
    for head, pos in positions.items():
        keys[head, pos] = 8 * directions[head]
    query = (8 * directions).repeat_interleave(N_REP, dim=0).view(1, HEADS * N_REP, 1, DIM)
    cfg = S4RConfig(key_space="post_rope",
                    ratio=None, rank_k=DIM, rank_v=DIM, granularity="head", coef_dtype="model",
                    outlier_fraction=0.0, recon_fraction=0.02, local_window=0, pool_kernel=1,
                    sample_tokens=None, shared_selection=shared)
    layer = compress_layer(keys, values, None, cfg, DIM, DIM, None)
    return layer, keys, values, query


@pytest.mark.parametrize("shared", [True, False])
def test_a_planted_token_is_selected_with_a_small_reconstruction_share(shared):
    planted = {0: 123, 1: 123}
    layer, keys, values, query = planted_layer(planted, shared=shared)
    out = layer.attend(query, None, None, DIM**-0.5)
    assert layer.selected.shape[1] == 8  # 2% of the 396 stored tokens
    for head, pos in planted.items():
        assert pos - layer.sinks in layer.selected[head].tolist()
    dense = causal_attention(query, keys.unsqueeze(0), values.unsqueeze(0), DIM**-0.5)
    torch.testing.assert_close(out, dense, rtol=0, atol=0.05)


def test_each_kv_head_selects_for_its_own_query_heads():
    """Planted tokens at different positions per KV head: a selection that mixed up which query heads
    belong to which KV head would pick the other head's token and miss the attention's mass."""
    planted = {0: 50, 1: 300}
    layer, keys, values, query = planted_layer(planted, shared=False)
    out = layer.attend(query, None, None, DIM**-0.5)
    selected = layer.selected.tolist()
    assert planted[0] - layer.sinks in selected[0] and planted[1] - layer.sinks in selected[1]
    assert planted[1] - layer.sinks not in selected[0] and planted[0] - layer.sinks not in selected[1]
    dense = causal_attention(query, keys.unsqueeze(0), values.unsqueeze(0), DIM**-0.5)
    torch.testing.assert_close(out, dense, rtol=0, atol=0.05)


def test_mass_budget_grows_with_flat_attention_and_stays_in_its_bounds():
    peaked = torch.full((1, 1, 100), 0.001)
    peaked[0, 0, 7] = 0.9
    flat = torch.full((1, 1, 100), 0.009)
    for probs in (peaked, flat):
        scores = probs[:, 0].clone()
        assert mass_budget(scores, probs, 0, 100, 0, 0.5) <= mass_budget(scores, probs, 0, 100, 0, 0.05)
    # the peak alone leaves 0.099 out: one token suffices for 0.1, none more for the floor of 1
    assert mass_budget(peaked[:, 0], peaked, 1, 50, 0, 0.1) == 1
    # flat: 0.9 of mass over 100 tokens; dropping at most 0.09 needs 90 tokens, capped at 50
    assert mass_budget(flat[:, 0], flat, 1, 100, 0, 0.09 + 1e-6) == 90
    assert mass_budget(flat[:, 0], flat, 1, 50, 0, 0.09 + 1e-6) == 50
    assert mass_budget(flat[:, 0], flat, 60, 100, 0, 0.5) == 60  # the fixed count is the floor


def test_mass_budget_counts_the_worst_row_and_skips_exact_and_forced_tokens():
    probs = torch.zeros(1, 2, 10)
    probs[0, 0, 0] = 0.5  # row 0: one sharp token
    probs[0, 1, 2:8] = 0.1  # row 1: six tokens of 0.1
    scores = probs.amax(dim=1)
    assert mass_budget(scores, probs, 0, 10, 0, 0.05) == 7  # row 1 needs all six after row 0's token
    scores[0, 2] = float("-inf")  # token 2 is an exact outlier: its mass is never dropped
    assert mass_budget(scores, probs, 0, 10, 0, 0.05) == 6
    assert mass_budget(scores, probs, 0, 10, 3, 0.05) == 5  # tokens 7-9 are the forced local window


def test_one_ranked_top_k_gives_the_budget_and_the_selection_of_two_searches():
    torch.manual_seed(3)
    layer = compress_layer(torch.randn(2, 310, DIM), torch.randn(2, 310, DIM), None,
                           S4RConfig(key_space="post_rope", ratio=None, rank_k=8, rank_v=8,
                                     recon_drop=0.05), 8, 8, None)
    for _ in range(20):
        scores = torch.randn(1, 300)
        scores[0, torch.randint(0, 300, (5,))] = float("-inf")  # exact outliers
        probs = torch.softmax(torch.randn(1, 6, 300) * 2, dim=-1)
        count = mass_budget(scores, probs, 30, 150, 16, 0.05)
        ranked = ranked_candidates(scores, 150, 16)
        assert mass_budget(scores, probs, 30, 150, 16, 0.05, ranked=ranked) == count
        chosen = layer.choose_tokens(scores, probs, (30, 150, 16))
        two_searches = select_tokens(scores, count, 16)
        assert torch.equal(chosen.sort().values, two_searches.sort().values)


@pytest.mark.parametrize("bad", [{"recon_drop": 0.0}, {"recon_drop": 1.0}, {"recon_max": 0.0},
                                 {"recon_max": 1.5}])
def test_drop_bound_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="recon_"):
        S4RConfig(**bad)


def test_the_fast_and_paper_presets_keep_a_fixed_reconstruction_share():
    assert S4RConfig().recon_drop is not None
    assert S4RConfig.fast().recon_drop is None and S4RConfig.paper().recon_drop is None


def test_a_layer_with_a_drop_bound_rebuilds_more_tokens_for_flat_attention():
    """With `recon_drop`, a query that attends evenly gets more than the fixed fraction, one that finds
    its planted token keeps the fixed count; both attend closer to dense than the fixed fraction does."""
    layer, keys, values, query = planted_layer({0: 123, 1: 123}, shared=True)
    adaptive = dataclasses.replace(layer.cfg, scoring="query", recon_drop=0.05, recon_max=1.0)
    flat_query = torch.zeros_like(query)
    for q, more in ((query, False), (flat_query, True)):
        fixed_out = layer.attend(q, None, None, DIM**-0.5)
        fixed = layer.selected.shape[1]
        layer.cfg = adaptive
        out = layer.attend(q, None, None, DIM**-0.5)
        layer.cfg = dataclasses.replace(adaptive, recon_drop=None)
        assert (layer.selected.shape[1] > 3 * fixed) is more
        dense = causal_attention(q, keys.unsqueeze(0), values.unsqueeze(0), DIM**-0.5)
        assert (out - dense).abs().max() <= (fixed_out - dense).abs().max() + 1e-6


def test_the_drop_bound_stops_at_its_ceiling_for_a_chunk_too():
    """The budget grows up to `recon_max`, by default twice the storage fraction (2/ratio)."""
    layer, _, _, query = planted_layer({0: 123, 1: 123}, shared=True)
    # two query tokens attending evenly, through the selection (a block would attend every token)
    layer.cfg = dataclasses.replace(layer.cfg, scoring="query", recon_drop=0.05, recon_max=0.3,
                                    dense_queries=0)
    flat_chunk = torch.zeros(1, query.shape[1], 2, DIM)
    layer.attend(flat_chunk, None, None, DIM**-0.5)
    assert layer.selected.shape[1] == int(0.3 * layer.stored_coefs)
    assert S4RConfig(ratio=5).recon_ceiling() == 0.4 and S4RConfig(ratio=2.5).recon_ceiling() == 0.8
    assert S4RConfig(ratio=1.5).recon_ceiling() == 1.0 and S4RConfig(recon_max=0.3).recon_ceiling() == 0.3
    # past 5x the ceiling stays at 5x's: smaller ranks make each rebuilt token cheaper
    assert S4RConfig(ratio=8).recon_ceiling() == 0.4 and S4RConfig(ratio=10).recon_ceiling() == 0.4


def test_the_token_cap_bounds_the_fixed_count_and_the_ceiling():
    layer, _, _, query = planted_layer({0: 123, 1: 123}, shared=True)
    flat_chunk = torch.zeros(1, query.shape[1], 2, DIM)
    for drop in (None, 0.05):  # the fixed share, then the budget that grows to its ceiling
        layer.cfg = dataclasses.replace(layer.cfg, scoring="query", recon_drop=drop, recon_fraction=0.5,
                                        recon_max=0.9, recon_token_cap=40, dense_queries=0)
        layer.attend(flat_chunk, None, None, DIM**-0.5)
        assert layer.selected.shape[1] == 40
        layer.cfg = dataclasses.replace(layer.cfg, recon_token_cap=0)  # no limit
        layer.attend(flat_chunk, None, None, DIM**-0.5)
        assert layer.selected.shape[1] > 40
    with pytest.raises(ValueError, match="recon_token_cap"):
        S4RConfig(recon_token_cap=-1)
    # unset, the cap is the same at every ratio; the fixed-share presets keep no limit
    assert S4RConfig(ratio=5).token_cap() == 1536 and S4RConfig(ratio=2.5).token_cap() == 1536
    assert S4RConfig(ratio=8).token_cap() == 1536 and S4RConfig(ratio=10).token_cap() == 1536
    assert S4RConfig(ratio=5, recon_token_cap=0).token_cap() is None
    assert S4RConfig.fast(5).token_cap() is None and S4RConfig.paper(5).token_cap() is None


def test_outlier_tokens_are_the_worst_represented_ones():
    basis = torch.eye(4)[:, :2].unsqueeze(0)  # spans the first two axes
    x = torch.zeros(1, 10, 4)
    x[0, :, 0] = 1.0
    x[0, 3, 2] = 5.0  # mostly off the basis
    x[0, 7, 3] = 0.5  # a little off it
    x[0, 9, 2] = 9.0  # the worst, but in the local window's tail
    assert outlier_tokens(x, x, basis, basis, 2).tolist() == [3, 9]
    assert outlier_tokens(x, x, basis, basis, 2, exclude_tail=1).tolist() == [3, 7]
    effect = torch.arange(10.0)
    assert outlier_tokens(x, x, basis, basis, 3, exclude_tail=2, effect=effect).tolist() == [5, 6, 7]


def test_hybrid_sample_indices():
    idx = hybrid_sample_indices(1000, 200, 0.25)
    assert idx.numel() == 200 and torch.equal(idx, idx.unique())  # sorted, no repeats
    assert idx.min() == 0 and idx.max() == 999
    assert torch.equal(idx[-50:], torch.arange(950, 1000))  # the recent block, whole
    early = idx[:-50]
    assert early.max() < 950 and early.diff().min() >= 5  # uniform over the earlier part
    assert torch.equal(hybrid_sample_indices(100, None, 0.25), torch.arange(100))
    assert torch.equal(hybrid_sample_indices(100, 500, 0.25), torch.arange(100))


def test_the_sample_never_holds_the_sinks():
    keys = torch.arange(2 * 20 * 4, dtype=torch.float32).view(2, 20, 4)
    k_groups, v_groups = compressible_parts(keys, keys, S4RConfig(key_space="post_rope",
                                                                  sinks=4, granularity="head"), None)
    assert k_groups.shape == (2, 16, 4) and torch.equal(k_groups, keys[:, 4:])


def test_int8_round_trip_error_is_at_most_half_a_step():
    coef = torch.randn(3, 100, 24, generator=rng(6)) * torch.rand(3, 100, 1, generator=rng(7)) * 10
    q, scale = quantize_int8(coef, torch.float32)
    assert q.dtype == torch.int8 and scale.shape == (3, 100, 1)
    error = (dequantize_int8(q, scale, torch.float32) - coef).abs()
    assert (error <= scale / 2 + 1e-6).all()
    assert torch.equal(q.abs().amax(dim=-1), torch.full((3, 100), 127, dtype=torch.int8))  # range used
