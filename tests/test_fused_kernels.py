"""The fused CPU decode step (`s4r.kernels`) against the eager step it replaces: outputs, logsumexps and
the chosen tokens over key spaces, bands, granularities, head groupings, dtypes and segments."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.compress import compress_layer
from s4r.core.rope import model_rope_fn, shifted
from s4r.kernels import jit
from s4r.layers.segments import SegmentedLayer
from tests.helpers import tiny_model

pytest.importorskip("numba")

D = 32


def rope_for(q_heads: int, kv_heads: int):
    return model_rope_fn(tiny_model(head_dim=D, hidden_size=D * q_heads, num_attention_heads=q_heads,
                                    num_key_value_heads=kv_heads, num_hidden_layers=1))


def kv_data(kv_heads: int, q_heads: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    """Low-rank-ish keys (what a basis captures, plus noise), random values and recent queries."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(kv_heads, D, 12, generator=g)
    keys = torch.randn(kv_heads, tokens, 12, generator=g) @ basis.transpose(1, 2)
    keys = keys + 0.1 * torch.randn(kv_heads, tokens, D, generator=g)
    values = torch.randn(kv_heads, tokens, D, generator=g)
    queries = torch.randn(q_heads, 32, D, generator=g)
    return keys.to(dtype), values.to(dtype), queries.to(dtype)


def eager_twin(layer):
    twin = copy.deepcopy(layer)
    for seg in getattr(twin, "segments", [twin]):
        seg.cfg = replace(seg.cfg, kernels="eager")
    return twin


def step_both(layer, q_heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 1, positions: int = 1):
    """One step of `positions` new tokens (a decode step: one) through the fused path and through the
    eager twin of `layer`: both outputs."""
    twin = eager_twin(layer)
    g = torch.Generator().manual_seed(seed)
    new_k = torch.randn(1, kv_heads, positions, D, generator=g).to(dtype)
    new_v = torch.randn(1, kv_heads, positions, D, generator=g).to(dtype)
    query = torch.randn(1, q_heads, positions, D, generator=g).to(dtype)
    from s4r.kernels.s4r_step import usable

    assert all(usable(seg, query) for seg in getattr(layer, "segments", [layer]))
    outs = []
    for lay in (layer, twin):
        lay.update(new_k, new_v)
        outs.append(lay.attend(query, None, None, D ** -0.5).float())
    assert not jit._state["failed"], "a fused kernel failed, so the eager path ran instead"
    return outs[0], outs[1], twin


def selected_sets(layer):
    segs = getattr(layer, "segments", [layer])
    return [set(s.selected[0].tolist()) if s.selected is not None else set() for s in segs]


CONFIGS = {
    "pre-rope": S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1),
    "pre-rope-budget": S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1, recon_token_cap=0),
    "pre-rope-int8-rebuild": S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1,
                                       rebuild_dtype="int8"),
    "pre-rope-model-rebuild": S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1,
                                        rebuild_dtype="model"),
    "pre-rope-aligned-int8": S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1, coef_bands=None,
                                       rope_scoring="aligned", recon_drop=None),
    "post-rope": replace(S4RConfig.fast(5.0), ratio=None, rank_k=24, rank_v=24, pool_kernel=1),
    "post-rope-int8": replace(S4RConfig.fast(5.0), ratio=None, rank_k=24, rank_v=24, pool_kernel=1,
                              coef_bands=None),
    "per-head-bases": S4RConfig(ratio=None, rank_k=16, rank_v=16, pool_kernel=1, granularity="head"),
    "per-head-bases-int8-rebuild": S4RConfig(ratio=None, rank_k=16, rank_v=16, pool_kernel=1,
                                             granularity="head", rebuild_dtype="int8"),
    "post-rope-per-head": replace(S4RConfig.fast(5.0), ratio=None, rank_k=16, rank_v=16, pool_kernel=1,
                                  granularity="head"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("heads", [(9, 3), (4, 2), (2, 2)])
def test_fused_step_is_the_eager_step(name, heads):
    q_heads, kv_heads = heads
    cfg = CONFIGS[name]
    keys, values, queries = kv_data(kv_heads, q_heads, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(q_heads, kv_heads))
    auto = cfg.rebuild_dtype == "auto" and jit.int8_products()
    assert layer.rebuild_int8 == (cfg.rebuild_dtype == "int8" or auto)
    fused, eager, twin = step_both(layer, q_heads, kv_heads, torch.float32)
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    assert layer.rebuilt_tokens == twin.rebuilt_tokens and layer.scored_tokens == twin.scored_tokens


@pytest.mark.parametrize("name", ["pre-rope-int8-rebuild", "pre-rope-model-rebuild", "per-head-bases",
                                  "post-rope"])
def test_fused_step_in_blocks_is_the_eager_step(name, monkeypatch):
    """The selected tokens rebuilt a block at a time (blocks of 64: three and a partial one)."""
    from s4r.kernels import s4r_step

    monkeypatch.setattr(s4r_step, "BLOCK", 64)
    cfg = CONFIGS[name]
    keys, values, queries = kv_data(3, 9, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    fused, eager, twin = step_both(layer, 9, 3, torch.float32)
    assert layer.selected.shape[-1] > 3 * 64
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


def reference_choice(scores, k, k_max, forced, drop, budget, logits, lse, candmass):
    """`choose_tokens` as its docstring says, in plain numpy: rank the candidates by score (ties: lower
    index first), keep the top k, or with the budget the shortest prefix of the top k_max that leaves
    every row at most `drop` of its candidate mass outside (at least k), then the forced tail."""
    import numpy as np

    n = scores.shape[0]
    forced = min(forced, n)
    cand = n - forced
    order = sorted(range(cand), key=lambda t: (-float(scores[t]), t))
    if budget and k_max > k:
        top = order[: min(k_max, cand)]
        need = 0
        for r in range(logits.shape[0]):
            kept = np.cumsum(np.exp(logits[r, top].astype(np.float64) - float(lse[r])))
            outside = float(candmass[r]) - kept > drop
            need = max(need, int(outside.sum()) + 1)
        chosen = top[: min(max(need, min(k, len(top))), len(top))]
    else:
        chosen = order[: min(k, cand)]
    return sorted(chosen) + list(range(cand, n))


@pytest.mark.parametrize("seed", range(6))
def test_choose_tokens_kernel_is_the_ranked_selection(seed):
    """The partial top-k, ties by index, the adaptive budget and the forced tail, in index order."""
    import numpy as np

    from s4r.kernels.token_selection import choose_tokens

    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, rows = int(rng.integers(1, 300)), int(rng.integers(1, 10))
        logits = (rng.standard_normal((rows, n)) * rng.uniform(0.5, 6)).astype(np.float32)
        if seed % 2:
            logits = np.round(logits)  # runs of equal scores
        lse = np.log(np.exp(logits.astype(np.float64)).sum(1)).astype(np.float32)
        forced = int(rng.integers(0, 12))
        candmass = np.exp(logits[:, : max(n - forced, 0)] - lse[:, None]).sum(1).astype(np.float32)
        scores = (logits.max(0) - lse.max()).astype(np.float32)
        k = int(rng.integers(0, n + 1))
        k_max = int(rng.integers(k, n + 1))
        drop = float(rng.choice([0.01, 0.05, 0.3]))
        for budget in (True, False):
            picked = np.full(n, -1, np.int64)
            work = np.zeros(2 * n, np.float32)
            count = choose_tokens(scores, n, k, k_max, forced, np.float32(drop), budget, logits, lse,
                                  candmass, work, picked)
            want = reference_choice(scores, k, k_max, forced, drop, budget, logits, lse, candmass)
            assert picked[:count].tolist() == want


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_fused_step_over_segments_is_the_eager_step(key_space):
    q_heads, kv_heads = 9, 3
    rope = rope_for(q_heads, kv_heads)
    cfg = S4RConfig(ratio=None, rank_k=24, rank_v=24, pool_kernel=1, key_space=key_space)
    k1, v1, q1 = kv_data(kv_heads, q_heads, 600, torch.float32, seed=3)
    k2, v2, q2 = kv_data(kv_heads, q_heads, 500, torch.float32, seed=4)
    first = compress_layer(k1, v1, q1, cfg, 24, 24, rope)
    second = compress_layer(k2, v2, q2, replace(cfg, sinks=0), 20, 20, shifted(rope, 600))
    layer = SegmentedLayer([first, second])
    fused, eager, twin = step_both(layer, q_heads, kv_heads, torch.float32)
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_fused_bf16_step_with_pooling_stays_close(key_space):
    """bf16 storage and the default max pooling (runs of equal scores, whose order the two top-k
    searches break differently): nearly the same tokens, nearly the same output."""
    q_heads, kv_heads = 9, 3
    cfg = S4RConfig(ratio=None, rank_k=24, rank_v=24, key_space=key_space)
    keys, values, queries = kv_data(kv_heads, q_heads, 900, torch.bfloat16)
    layer = compress_layer(keys, values, queries, cfg, 24, 24, rope_for(q_heads, kv_heads))
    fused, eager, twin = step_both(layer, q_heads, kv_heads, torch.bfloat16)
    mine, theirs = selected_sets(layer)[0], selected_sets(twin)[0]
    assert len(mine ^ theirs) <= 0.05 * len(theirs)
    assert (fused - eager).abs().max() < 0.05 * eager.abs().max()


def test_the_eager_setting_and_a_missing_numba_run_the_eager_path(monkeypatch, caplog):
    q_heads, kv_heads = 4, 2
    keys, values, queries = kv_data(kv_heads, q_heads, 300, torch.float32)
    cfg = S4RConfig(ratio=None, rank_k=16, rank_v=16, kernels="eager")
    layer = compress_layer(keys, values, queries, cfg, 16, 16, rope_for(q_heads, kv_heads))
    from s4r.kernels.s4r_step import usable

    query = torch.randn(1, q_heads, 1, D)
    assert not usable(layer, query)
    layer.cfg = replace(cfg, kernels="auto")
    assert usable(layer, query)
    monkeypatch.setattr(jit, "numba", None)
    monkeypatch.setitem(jit._state, "warned", False)
    with caplog.at_level(logging.WARNING, logger="s4r.kernels"):
        assert not usable(layer, query) and not usable(layer, query)
    assert len([r for r in caplog.records if "eager path" in r.getMessage()]) == 1


@pytest.mark.parametrize("n", [1, 511, 512, 513, 1300])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("parts", [1, 3])
def test_latent_logits_kernel_is_the_integer_product(n, groups, rows, parts):
    """Every token's int8 logit over tile edges, chunk bounds, an offset, per-head groups, row counts
    that the kernel's blocks of three rows do not divide, and the tokens split into runs (some empty)."""
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.latent_scoring import latent_logits

    g = torch.Generator().manual_seed(n)
    lead, chunks, off = 22, 2, 5
    q8 = torch.randint(-127, 128, (chunks, 3 * rows, lead), generator=g, dtype=torch.int8)
    qscale = torch.rand(chunks, 3 * rows, generator=g)
    ck = torch.randint(-127, 128, (groups, lead, n + 40), generator=g, dtype=torch.int8)  # spare capacity
    sk = torch.rand(groups, n + 40, generator=g).to(torch.bfloat16)
    bounds = torch.tensor([0, n // 3, n])
    logits = torch.full((3 * rows, off + n), float("nan"))
    latent_logits(q8.numpy(), qscale.numpy(), bounds.numpy(), ck.numpy(), as_numpy(sk), n, rows,
                  logits.numpy(), off, parts)
    chunk_of = (torch.arange(n) >= n // 3).long()
    group_of = torch.arange(3 * rows) // rows if groups > 1 else torch.zeros(3 * rows, dtype=torch.long)
    dots = torch.einsum("crj,rjt->crt", q8.double(), ck[group_of, :, :n].double())  # [C, R, n]
    want = dots.gather(0, chunk_of.expand(3 * rows, n).unsqueeze(0))[0]
    want = want * qscale.double()[chunk_of].T * sk[group_of, :n].double()
    torch.testing.assert_close(logits[:, off:].double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("token_last", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tails", [((4, 32), (2, 32)), ((4, 36), (2, 68)), ((2, 8),), ((8, 4), (4, 8)), ()])
def test_decode_rows_kernel_is_the_band_decoder(token_last, dtype, tails):
    """Selected coefficient rows (lead band times scale, then every lower band) as `decode_tails`
    decodes them, rounded once to the output dtype; rows past the selection zeroed. The bands' bytes fill
    whole vector runs, runs and bytes past them (18 and 17 bytes), or bytes alone."""
    from s4r.core.band_plan import BandPlan
    from s4r.core.coef_bands import decode_tails
    from s4r.core.quantize import pack_bits
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.sparse_attention import decode_rows

    g = torch.Generator().manual_seed(len(tails))
    groups, n, lead, k = 2, 300, 12, 37
    plan = BandPlan(lead, tails)
    codes = [pack_bits(torch.randint(0, 1 << b, (groups, n, w), generator=g), b) for b, w in tails]
    tail_codes = torch.cat(codes, -1) if codes else torch.zeros(groups, n, 0, dtype=torch.uint8)
    tail_steps = torch.rand(groups, n, max(len(tails), 1), generator=g).to(torch.bfloat16)
    lead_codes = torch.randint(-127, 128, (groups, n, lead), generator=g, dtype=torch.int8)
    scale = torch.rand(groups, n, generator=g).to(torch.bfloat16)
    idx = torch.randperm(n, generator=g)[:k]
    stored = lead_codes.transpose(1, 2).contiguous() if token_last else lead_codes
    out = torch.full((groups, k + 11, plan.rank), 7.0, dtype=dtype)
    bits = torch.tensor([b for b, _ in tails], dtype=torch.int64)
    widths = torch.tensor([w for _, w in tails], dtype=torch.int64)
    decode_rows(idx.numpy(), k, stored.numpy(), as_numpy(scale), tail_codes.numpy(), as_numpy(tail_steps),
                bits.numpy(), widths.numpy(), token_last, as_numpy(out))
    want = lead_codes[:, idx].float() * scale[:, idx, None].float()
    if tails:
        want = torch.cat([want, decode_tails(tail_codes[:, idx], tail_steps[:, idx], plan)], -1)
    torch.testing.assert_close(out[:, :k], want.to(dtype), rtol=0, atol=0)
    assert (out[:, k:] == 0).all()


def random_bands(tails, groups: int = 2, n: int = 300, lead: int = 12):
    """Random stored bands: (lead codes [G, n, lead], scales [G, n] bf16, packed tail codes, tail steps)."""
    from s4r.core.quantize import pack_bits

    g = torch.Generator().manual_seed(len(tails) + 7)
    codes = [pack_bits(torch.randint(0, 1 << b, (groups, n, w), generator=g), b) for b, w in tails]
    tail_codes = torch.cat(codes, -1) if codes else torch.zeros(groups, n, 0, dtype=torch.uint8)
    tail_steps = (0.05 * torch.rand(groups, n, max(len(tails), 1), generator=g)).to(torch.bfloat16)
    lead_codes = torch.randint(-127, 128, (groups, n, lead), generator=g, dtype=torch.int8)
    scale = (0.01 * torch.rand(groups, n, generator=g) + 1e-3).to(torch.bfloat16)
    return lead_codes, scale, tail_codes, tail_steps


@pytest.mark.parametrize("tails", [((4, 32), (2, 32)), ((2, 8),), ((8, 4), (4, 8)), ()])
@pytest.mark.parametrize("parts", [1, 2, 5])
def test_decode_rows_int8_kernel_is_the_int8_rows_reference(tails, parts):
    """Selected key rows as one int8 row each on the lead band's step: the lead codes as stored, the lower
    bands as `int8_rows` rounds the band decoder's values (some past +-127, clamped); rows past k zeroed;
    the rows split into runs or not."""
    from s4r.core.band_plan import BandPlan
    from s4r.core.coef_bands import decode_tails
    from s4r.core.int8_rebuild import int8_rows
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.sparse_attention import decode_rows_int8

    lead_codes, scale, tail_codes, tail_steps = random_bands(tails)
    plan = BandPlan(12, tails)
    idx = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:37]
    k = idx.shape[0]
    out = torch.full((2, k + 11, plan.rank), 5, dtype=torch.int8)
    out_scale = torch.full((2, k + 11), 7.0)
    bits = torch.tensor([b for b, _ in tails], dtype=torch.int64)
    widths = torch.tensor([w for _, w in tails], dtype=torch.int64)
    decode_rows_int8(idx.numpy(), k, lead_codes.transpose(1, 2).contiguous().numpy(), as_numpy(scale),
                     tail_codes.numpy(), as_numpy(tail_steps), bits.numpy(), widths.numpy(), out.numpy(),
                     out_scale.numpy(), parts)
    rows = lead_codes[:, idx].float() * scale[:, idx, None].float()
    if tails:
        rows = torch.cat([rows, decode_tails(tail_codes[:, idx], tail_steps[:, idx], plan)], -1)
    want = int8_rows(rows.transpose(1, 2), scale[:, None, idx]).transpose(1, 2)
    assert torch.equal(out[:, :k], want)
    assert torch.equal(out[:, :k, :12], lead_codes[:, idx])
    if tails:
        assert (want.abs() == 127).any() and (want[..., 12:] != 0).any()
    assert torch.equal(out_scale[:, :k], scale[:, idx].float())
    assert (out[:, k:] == 0).all() and (out_scale[:, k:] == 0).all()


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("tails", [((4, 32), (2, 32)), ()])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_weighted_value_rows_kernel_is_decoded_rows_times_probabilities(groups, tails, parts):
    """z[b, m] = probabilities times the decoded value rows of the selected tokens, each group's rows
    weighted by its own query rows, over a count that is not a multiple of the kernel's token block, the
    tokens split into runs whose sums are added (one run empty at 4) or not."""
    from s4r.core.band_plan import BandPlan
    from s4r.core.coef_bands import decode_tails
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.sparse_attention import weighted_value_rows

    lead_codes, scale, tail_codes, tail_steps = random_bands(tails, groups=groups)
    plan = BandPlan(12, tails)
    idx = torch.randperm(300, generator=torch.Generator().manual_seed(4))[:45].sort().values
    k, rows = idx.shape[0], 9 // groups
    probs = torch.rand(9, k + 5)
    z = torch.randn(groups, rows, plan.rank)  # what an earlier step left: overwritten
    bits = torch.tensor([b for b, _ in tails], dtype=torch.int64).numpy()
    widths = torch.tensor([w for _, w in tails], dtype=torch.int64).numpy()
    weighted_value_rows(probs.numpy(), idx.numpy(), k, lead_codes.numpy(), as_numpy(scale),
                        tail_codes.numpy(), as_numpy(tail_steps), bits, widths, z.numpy(), parts)
    decoded = lead_codes[:, idx].float() * scale[:, idx, None].float()
    if tails:
        decoded = torch.cat([decoded, decode_tails(tail_codes[:, idx], tail_steps[:, idx], plan)], -1)
    want = torch.matmul(probs[:, :k].view(groups, rows, k), decoded)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 24])
def test_add_value_basis_kernel_is_a_batched_product(d):
    """out[h] += z's rows of head h times head h's block of the value basis, for the head sizes with
    their own loops and one without."""
    from s4r.kernels.step_output import add_value_basis

    gen = torch.Generator().manual_seed(d)
    heads, rows, rank = 3, 3, 37
    z, basis = torch.randn(heads * rows, rank, generator=gen), torch.randn(heads, rank, d, generator=gen)
    out = torch.randn(heads, rows, d, generator=gen)
    want = out + torch.bmm(z.view(heads, rows, rank), basis)
    add_value_basis(z.numpy(), basis.numpy(), out.numpy())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_query_rows_kernel_widens_the_steps_query(dtype):
    """The step's query [1, H * M, 1, d] as fp32 rows [H, M, d], bf16 widened exactly."""
    from s4r.kernels.jit import as_numpy
    from s4r.kernels.latent_scoring import query_rows

    query = torch.randn(1, 9, 1, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full((3, 3, 64), float("nan"))
    query_rows(as_numpy(query), out.numpy())
    assert torch.equal(out, query.float().view(3, 3, 64))


def test_the_shared_scratch_serves_steps_inside_and_outside_inference_mode():
    """Every layer of a thread shares the step's buffers: one made under inference_mode serves a step
    outside it (torch refuses writes there into a tensor or a view made inside)."""
    rope = rope_for(4, 2)
    keys, values, queries = kv_data(2, 4, 300, torch.float32)
    layers = [compress_layer(keys, values, queries, CONFIGS["pre-rope-int8-rebuild"], 24, 24, rope)
              for _ in range(2)]
    with torch.inference_mode():
        inside = step_both(layers[0], 4, 2, torch.float32)
    outside = step_both(layers[1], 4, 2, torch.float32)
    for fused, eager, _ in (inside, outside):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
