"""Pre-RoPE keys at decode: the selected keys rebuilt dimension-major from the stored bands, rotated by the
half-angle tables, against the plain reference (decoded rows times the basis, `apply_rope`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from s4r.config import S4RConfig
from s4r.core.coef_bands import decode_tails
from s4r.core.compress import compress_layer
from s4r.core.latent import chunked_latent_logits, latent_logits
from s4r.core.rope import (
    ANGLE_STEP,
    angle_parts,
    angle_rows,
    apply_rope,
    chunk_rotations,
    half_angles,
    model_rope_fn,
    rope_rows,
    rotate_dim_major,
    shifted,
)
from s4r.core.subspace import head_blocks
from tests.helpers import tiny_model


def token_rows(store: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The rows idx [B, k] of a per-token store [G, N, x]: [B, k, x]."""
    if store.shape[0] == 1:
        return store[0][idx]
    return torch.gather(store, 1, idx.unsqueeze(-1).expand(-1, -1, store.shape[-1]))


def decoded_key_rows(layer, idx: torch.Tensor) -> torch.Tensor:
    """fp32 key coefficients [B, k, r] of the stored tokens `idx` [B, k], decoded code by code (the int8
    band times its scale, the lower bands by `decode_tails`): the reference the planes must match."""
    n = layer._n

    def pick(store: torch.Tensor) -> torch.Tensor:
        return token_rows(store, idx)

    rows = pick(layer._ck[..., :n].transpose(1, 2)).float()
    if layer._sk is not None:
        rows = rows * pick(layer._sk[:, :n, None]).float()
    if layer._tk is None:
        return rows
    tails = decode_tails(pick(layer._tk[:, :n]), pick(layer._tsk[:, :n]), layer.plan_k)
    return torch.cat([rows, tails], dim=-1)


def rope_of(arch: str = "llama", **overrides):
    return model_rope_fn(tiny_model(arch, **overrides))


@pytest.mark.parametrize("overrides", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                                       {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 1024}}])
def test_half_angles_are_the_models_own_tables(overrides):
    rope = rope_of(**overrides)
    positions = torch.tensor([0, 5, 17, 900, 3000])
    cos, sin = rope(positions)
    half = cos.shape[-1] // 2
    fast = half_angles(rope, positions)
    del rope.rotary  # the fallback: halves of the model's tables
    slow = half_angles(rope, positions)
    for got in (fast, slow):
        torch.testing.assert_close(got[0], cos[:, :half].float().T, rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], sin[:, :half].float().T, rtol=0, atol=1e-6)
    # the two halves of the model's tables are one angle per pair, which the half tables rely on
    assert torch.equal(cos[:, :half], cos[:, half:])


def test_the_angle_table_gives_the_computed_angles_and_regrows():
    rope = rope_of(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 1024})
    positions = torch.tensor([0, 5, 17, 900, 3000])
    for upto in (3001, 5000):  # within the first table, then past it after a regrowth
        positions[-1] = upto - 1
        computed = half_angles(rope, positions)
        tabled = half_angles(rope, positions, upto)
        assert torch.equal(tabled[0], computed[0]) and torch.equal(tabled[1], computed[1])
    assert rope.rotary.s4r_angle_table[2].shape[1] > 5000
    moved = shifted(rope, 7000)  # a segment's positions: the offset joins the table's index
    assert all(torch.equal(a, b) for a, b in zip(half_angles(moved, positions, 5000),
                                                 half_angles(rope, positions + 7000), strict=True))


def test_rope_rows_are_a_calls_rows_for_those_positions_and_regrow():
    rope = rope_of(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 1024})
    for start, end in ((0, 10), (100, 3000), (4000, 9000)):  # within the first table, then past it
        got, want = rope_rows(rope, start, end), rope(torch.arange(start, end))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert rope.s4r_rope_rows[0].shape[0] >= 9000
    moved = shifted(rope, 700)  # a segment's rows: the same table, from its offset on
    got, want = rope_rows(moved, 5, 50), rope(torch.arange(705, 750))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    del rope.rotary  # frequencies that may change with the length: every call goes to the model
    got, want = rope_rows(rope, 3, 8), rope(torch.arange(3, 8))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_angle_parts_compose_every_positions_angles_and_regrow():
    rope = rope_of(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 1024})
    for upto in (3001, 9000):  # within the first tables, then past them after a regrowth
        coarse, fine = angle_parts(rope.rotary, upto)
        assert coarse.shape[0] * ANGLE_STEP > upto
        positions = torch.tensor([0, 1, 63, 64, 65, 900, 3000, upto - 1])
        a, b = coarse[positions // ANGLE_STEP], fine[positions % ANGLE_STEP]
        half = a.shape[1] // 2
        cos = a[:, :half] * b[:, :half] - a[:, half:] * b[:, half:]
        sin = a[:, half:] * b[:, :half] + a[:, :half] * b[:, half:]
        table = angle_rows(rope.rotary, upto)[positions]
        assert float(table[:, :half].abs().max()) > 1.0  # yarn's attention scaling rides on the coarse rows
        # the table's fp32 phase of position 9,000 is off by up to 2.4e-4 rad (half an ulp), the sum not
        torch.testing.assert_close(torch.cat([cos, sin], 1), table, rtol=0, atol=6e-4)
        torch.testing.assert_close(torch.cat([cos, sin], 1)[:5], table[:5], rtol=0, atol=1e-6)


def test_dimension_major_rotation_is_apply_rope():
    rope = rope_of()
    positions = torch.arange(40, 70)
    x = torch.randn(3, positions.numel(), 16)
    cos, sin = rope(positions)
    expected = apply_rope(x, cos, sin)
    got = rotate_dim_major(x.transpose(1, 2).contiguous(), *half_angles(rope, positions))
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=1e-5, atol=1e-6)


def pre_rope_layer(seed: int, total: int, granularity: str, bands: str | None, shared: bool,
                   dtype: torch.dtype = torch.float32, rebuild: str = "model"):
    """(layer, rope, cfg): a pre-RoPE layer of 2 KV heads x 16 over `total` low-rank random keys, handed
    over post-RoPE as the model does, in `dtype`, its selected keys rebuilt as `rebuild` says."""
    torch.manual_seed(seed)
    rope = rope_of()
    heads, dim = 2, 16
    mix = torch.randn(heads * dim, heads * dim) * torch.linspace(3.0, 0.1, heads * dim)
    keys = (torch.randn(total, heads * dim) @ mix.T).view(total, heads, dim).transpose(0, 1).contiguous()
    cos, sin = rope(torch.arange(total))
    keys = apply_rope(keys, cos, sin).to(dtype)
    values = torch.randn(heads, total, dim).to(dtype)
    rank = 12 if granularity == "head" else 24
    cfg = S4RConfig(ratio=None, rank_k=rank, rank_v=rank, key_space="pre_rope", granularity=granularity,
                    coef_bands=bands, outlier_fraction=0.0, shared_selection=shared, rebuild_dtype=rebuild)
    return compress_layer(keys, values, None, cfg, rank, rank, rope), rope, cfg


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("bands", [None, "8:2,4:3,2:3", "8:1,4:7"])
@pytest.mark.parametrize("shared", [True, False])
def test_rebuilt_keys_and_logits_match_the_row_reference(granularity, bands, shared):
    layer, rope, _ = pre_rope_layer(0, 260, granularity, bands, shared)
    heads, dim = 2, 16
    n = layer._n
    idx = torch.randperm(n)[:50].sort().values[None]
    if not shared:
        idx = torch.stack([torch.randperm(n)[:50].sort().values for _ in range(heads)])
    rows = decoded_key_rows(layer, idx)
    expected = torch.matmul(rows, head_blocks(layer.basis_k, heads).float().transpose(1, 2))  # [H, k, d]
    got = layer._rebuilt_keys(idx)
    torch.testing.assert_close(got.transpose(1, 2), expected.expand_as(got.transpose(1, 2)), rtol=1e-4,
                               atol=1e-4)
    qf = torch.randn(heads, 3, dim)
    c, s = rope(idx.reshape(-1) + layer.sinks)
    rotated = apply_rope(expected.expand(heads, -1, -1), c.view(*idx.shape, -1), s.view(*idx.shape, -1))
    reference = torch.matmul(qf, rotated.transpose(1, 2)) * 0.25
    torch.testing.assert_close(layer._rebuilt_key_logits(qf, idx, 0.25), reference, rtol=1e-4, atol=1e-4)
    # a segment the step's top-k gave no token (two documents): empty, not an error
    none = torch.zeros(idx.shape[0], 0, dtype=torch.long)
    assert layer._rebuilt_key_logits(qf, none, 0.25).shape == (heads, 3, 0)


def test_chunk_rotations_are_the_mean_rotation_over_each_chunks_distances():
    rope = rope_of()
    bounds, cos, sin = chunk_rotations(rope, 700, 256, 750)
    assert bounds == [0, 256, 512, 700]
    c, s = rope(torch.arange(800))
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        far = slice(750 - (hi - 1), 750 - lo + 1)  # stored token j sits 750 - j before the query
        torch.testing.assert_close(cos[i], c[far].mean(0), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[i], s[far].mean(0), rtol=0, atol=1e-6)
    del rope.rotary  # without the model's static frequencies: no expected scoring
    assert chunk_rotations(rope, 700, 128, 750) is None


@pytest.mark.parametrize("scoring", ["expected", "aligned"])
def test_a_planted_far_token_is_selected_by_pre_rope_scoring(scoring):
    """A stored token whose key points along the query (in the slowly rotating dimensions, where a
    relevant far token's match lives) is among the 2% rebuilt, 400 tokens before the query."""
    torch.manual_seed(0)
    rope = rope_of()
    heads, total, dim = 2, 500, 16
    cos, sin = rope(torch.arange(total + 1))
    slow = torch.zeros(dim)
    slow[[6, 7, 14, 15]] = 1.0  # RoPE pairs (6, 14) and (7, 15): the two slowest frequencies
    q_pre = torch.randn(heads, 1, dim) * slow
    keys = apply_rope(torch.randn(heads, total, dim) * 0.1, cos[:total], sin[:total])
    planted = 100
    q_post = apply_rope(q_pre, cos[total:], sin[total:])
    keys[:, planted] = 8 * q_post[:, 0]  # its logit with the query is large at its real position
    values = torch.randn(heads, total, dim)
    cfg = S4RConfig(ratio=None, rank_k=32, rank_v=32, key_space="pre_rope", rope_scoring=scoring,
                    rope_chunk=128, coef_dtype="model", coef_bands=None, outlier_fraction=0.0,
                    recon_fraction=0.02, local_window=0, pool_kernel=1, sample_tokens=None)
    layer = compress_layer(keys, values, None, cfg, 32, 32, rope)
    new_k = apply_rope(torch.randn(heads, 1, dim) * 0.1, cos[total:], sin[total:]).unsqueeze(0)
    layer.update(new_k, torch.randn(1, heads, 1, dim))
    query = q_post.repeat_interleave(2, dim=0).unsqueeze(0)  # 4 query heads over 2 KV heads
    layer.attend(query, None, None, dim**-0.5)
    assert planted - layer.sinks in layer.selected[0].tolist()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
@pytest.mark.parametrize(("groups", "stored", "chunk"),
                         [(1, 300, 64), (1, 256, 64), (1, 50, 64), (2, 300, 64)])
def test_chunked_logits_are_each_chunks_own_latent_logits(dtype, groups, stored, chunk):
    gen = torch.Generator().manual_seed(stored + groups)
    heads, rows, rank = 2, 3, 8
    bounds = [*range(0, stored, chunk), stored]
    queries = torch.randn(len(bounds) - 1, heads, rows, rank, generator=gen)
    coef = torch.randn(groups, rank, stored + 7, generator=gen) * 40  # spare capacity, as stored
    coef = coef.round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else coef
    coef_t = coef[..., :stored]
    scale = torch.rand(groups, stored, generator=gen) + 0.5
    out = torch.empty(heads, rows, stored + 5)  # the front of a wider buffer, as scoring writes it
    chunked_latent_logits(queries, bounds, coef_t, scale, 0.25, out[..., :stored])
    for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        expected = latent_logits(queries[c], coef_t[..., lo:hi], scale[:, lo:hi], 0.25)
        # int8 queries (CPU int8 path) and bf16 products (the batched path) round alike: ~1%
        torch.testing.assert_close(out[..., lo:hi], expected, rtol=0.02, atol=0.02 * expected.abs().max())


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("bands", [None, "8:2,4:3,2:3"])
@pytest.mark.parametrize("shared", [True, False])
def test_int8_rebuild_is_the_integer_product_of_the_decoded_rows(granularity, bands, shared):
    """`rebuild_dtype="int8"`: the logits are those of keys rebuilt from each token's decoded row rounded to
    its lead band's step (the lead codes unchanged) times the basis in int8 per key dimension, computed
    here from the rows by hand; with the lead band alone they are within the basis' int8 rounding of fp32."""
    layer, rope, cfg = pre_rope_layer(2, 300, granularity, bands, shared, rebuild="int8")
    assert layer.rebuild_int8
    heads, dim = 2, 16
    n = layer._n
    sets = 1 if shared else heads
    idx = torch.stack([torch.randperm(n)[:64].sort().values for _ in range(sets)])
    rows = decoded_key_rows(layer, idx)  # [B, k, r]
    step = token_rows(layer._sk[:, :n, None], idx).float()  # [B, k, 1]
    codes = torch.round(rows * (1 / step)).clamp(-127, 127)
    lead = layer.plan_k.lead
    assert torch.equal(codes[..., :lead], token_rows(layer._ck[..., :n].transpose(1, 2), idx).float())
    blocks = head_blocks(layer.basis_k, heads).float()  # [H, d, r]
    bscale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    bcodes = torch.round(blocks / bscale).clamp(-127, 127)
    keys = torch.matmul(codes, bcodes.transpose(1, 2)) * step * bscale.transpose(1, 2)  # [H, k, d]
    c, s = rope(idx.reshape(-1) + layer.sinks)
    rotated = apply_rope(keys, c.view(*idx.shape, -1), s.view(*idx.shape, -1))
    qf = torch.randn(heads, 3, dim)
    reference = torch.matmul(qf, rotated.transpose(1, 2)) * 0.25
    got = layer._rebuilt_key_logits(qf, idx, 0.25)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    if bands is None:  # lower bands rounded to the lead's step lose more where the lead is this narrow
        layer.cfg = replace(cfg, rebuild_dtype="float32")
        exact = layer._rebuilt_key_logits(qf, idx, 0.25)
        assert 0 < ((got - exact).norm() / exact.norm()).item() < 0.01


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("bands", [None, "8:2,4:3,2:3"])
@pytest.mark.parametrize("shared", [True, False])
def test_bf16_rebuild_matches_the_fp32_reference_to_bf16_rounding(granularity, bands, shared):
    """A bf16 layer rebuilds its keys in bf16 (decoded coefficients, one product); its logits agree with
    the fp32 reference (decoded rows times the basis, `apply_rope`) to bf16's rounding, and
    `rebuild_dtype="float32"` gives the fp32 path's logits."""
    layer, rope, cfg = pre_rope_layer(1, 300, granularity, bands, shared, torch.bfloat16)
    heads, dim = 2, 16
    n = layer._n
    sets = 1 if shared else heads
    idx = torch.stack([torch.randperm(n)[:64].sort().values for _ in range(sets)])
    rows = decoded_key_rows(layer, idx)
    expected = torch.matmul(rows, head_blocks(layer.basis_k, heads).float().transpose(1, 2))  # [H, k, d]
    c, s = rope(idx.reshape(-1) + layer.sinks)
    rotated = apply_rope(expected.expand(heads, -1, -1), c.view(*idx.shape, -1), s.view(*idx.shape, -1))
    qf = torch.randn(heads, 3, dim)
    reference = torch.matmul(qf, rotated.transpose(1, 2)) * 0.25
    assert layer.rebuild_dtype == torch.bfloat16
    got = layer._rebuilt_key_logits(qf, idx, 0.25)
    assert got.dtype == torch.float32 and got.shape == reference.shape
    error = (got - reference).norm() / reference.norm()
    assert 0 < error < 4e-3  # bf16's rounding of the keys (2^-8 relative per element at most)
    layer.cfg = replace(cfg, rebuild_dtype="float32")
    assert layer.rebuild_dtype == torch.float32
    torch.testing.assert_close(layer._rebuilt_key_logits(qf, idx, 0.25), reference, rtol=1e-4, atol=1e-4)
    none = torch.zeros(idx.shape[0], 0, dtype=torch.long)  # a segment given no token: empty, no error
    layer.cfg = cfg
    assert layer._rebuilt_key_logits(qf, none, 0.25).shape == (heads, 3, 0)


F32, BF16 = torch.float32, torch.bfloat16
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (BF16, F32)]


@pytest.mark.parametrize("x_dtype,table_dtype", DTYPE_PAIRS)
def test_undo_rope_is_the_formula_and_inverts_apply_rope(x_dtype, table_dtype):
    """(x cos - rotate_half(x) sin) / (cos^2 + sin^2) to the bit, with tables that carry a scaling, and
    the keys `apply_rope` turned come back."""
    from s4r.core.rope import rotate_half, undo_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 16, generator=g).to(x_dtype)
    angles = torch.rand(50, 8, generator=g) * 40
    cos = (1.2 * torch.cat([angles.cos()] * 2, -1)).to(table_dtype)
    sin = (1.2 * torch.cat([angles.sin()] * 2, -1)).to(table_dtype)
    want = (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
    assert torch.equal(undo_rope(x, cos, sin), want)
    plain = torch.randn(3, 50, 16, generator=g)
    turned = apply_rope(plain, cos.float(), sin.float())
    torch.testing.assert_close(undo_rope(turned, cos.float(), sin.float()), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("large", [True, False])
def test_auto_rebuild_takes_amx_bf16_only_for_a_large_bf16_basis(dtype, amx, large, monkeypatch):
    """`rebuild_dtype="auto"` on a CPU with int8 products: int8, except a bf16 model's basis of at least
    `AMX_REBUILD_MACS` on AMX-BF16, which rebuilds in bf16."""
    from s4r.kernels import jit
    from s4r.layers import lowrank_rebuild

    layer, _, _ = pre_rope_layer(3, 300, "layer", "8:2,4:3,2:3", True, dtype, rebuild="auto")
    monkeypatch.setattr(jit, "int8_products", lambda: True)
    monkeypatch.setattr(jit, "cpu_flags", lambda: ["avx512f", "amx_bf16"] if amx else ["avx512f"])
    size = layer.basis_k.numel()
    monkeypatch.setattr(lowrank_rebuild, "AMX_REBUILD_MACS", size if large else size + 1)
    assert layer.rebuild_int8 == (not (amx and large and dtype == torch.bfloat16))
    assert layer.rebuild_dtype == dtype
