"""Coefficient bands: spec parsing, byte-aligned plans, the quantizer's error, and a banded layer that
attends like the coefficients it stores."""

from __future__ import annotations

import pytest
import torch

from s4r.config import HIGH_RATIO_VALUE_BANDS, S4RConfig
from s4r.core.budget import KVShape, solve_ranks, token_coef_bytes
from s4r.core.coef_bands import decode_tails, encode_tails, parse_band_spec, plan_bands
from s4r.core.compress import compress_layer
from s4r.core.subspace import column_rms, project, project_scaled, reconstruct, scale_columns, unit_columns


def test_spec_parsing_and_errors():
    assert parse_band_spec("8:1,4:3,2:4") == ((8, 1.0), (4, 3.0), (2, 4.0))
    for bad in ("4:1,8:1", "8:1,2:1,4:1", "8:1,3:1", "8:x", "8:1,4:0", "8:1,4:1,4:1"):
        with pytest.raises(ValueError):
            parse_band_spec(bad)
    assert S4RConfig(coef_bands="8:1,4:1", coef_dtype="model").bands is None  # bands split int8 only


@pytest.mark.parametrize("rank", [1, 2, 5, 13, 64, 97, 192])
def test_plans_cover_the_rank_in_whole_bytes(rank):
    plan = plan_bands(rank, "8:1,4:3,2:4")
    assert plan.rank == rank and plan.lead >= 1
    assert all(width * bits % 8 == 0 for bits, width in plan.tails)
    assert plan_bands(rank, None).lead == rank


def test_band_quantizer_error_is_near_the_gaussian_optimum():
    torch.manual_seed(0)
    coef = torch.randn(1, 4000, 64) * torch.linspace(4.0, 0.5, 64)  # energy falling along the rank
    plan = plan_bands(64, "8:1,4:3,2:4")
    codes, steps = encode_tails(coef, plan, torch.bfloat16)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == plan.tail_bytes
    back = decode_tails(codes, steps, plan)
    at = plan.lead
    for bits, width in plan.tails:
        band = coef[..., at : at + width]
        err = (back[..., at - plan.lead : at - plan.lead + width] - band).pow(2).sum() / band.pow(2).sum()
        # Max's uniform quantizer on a Gaussian: 0.0095 (4 bits) and 0.119 (2 bits) relative MSE
        assert err < {4: 0.02, 2: 0.15}[bits], (bits, float(err))
        at += width


def test_bands_buy_rank_at_the_same_bytes():
    shape = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype_bytes=2)
    plain = solve_ranks(shape, S4RConfig(ratio=5.0, coef_bands=None), tokens=4096)
    banded = solve_ranks(shape, S4RConfig(ratio=5.0, coef_bands="8:1,4:3,2:4"), tokens=4096)
    assert banded.rank_k > 1.6 * plain.rank_k and banded.ratio >= 5.0


def decaying_mix(width: int) -> torch.Tensor:
    """A mixing matrix whose outputs have a decaying spectrum, like real keys and values."""
    return torch.randn(width, width) * torch.linspace(3.0, 0.1, width)


def mixed_tokens(n: int, mix: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads, n, dim] keys or values drawn through `mix`."""
    return (torch.randn(n, mix.shape[0]) @ mix.T).view(n, heads, -1).transpose(0, 1).contiguous()


def exact_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of `query` [1, 2H, q, d] over every token of keys/values [H, T, d], two query heads per
    KV head."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys.unsqueeze(0).repeat_interleave(2, 1), values.unsqueeze(0).repeat_interleave(2, 1))


def test_banded_layer_attends_close_to_exact_at_full_rank():
    """Every token reconstructed at full rank: the output error is the bands' rounding alone, far below
    a rank cut to the same bytes; a broken band decoder (wrong order, offset or step) fails this."""
    torch.manual_seed(1)
    heads, total, dim = 2, 300, 32
    mix = decaying_mix(heads * dim)
    keys, values = mixed_tokens(total, mix, heads), mixed_tokens(total, mix, heads)
    query = torch.randn(1, 2 * heads, 1, dim) * 0.1
    new_k, new_v = torch.randn(1, heads, 1, dim), torch.randn(1, heads, 1, dim)
    ref = exact_attention(query, torch.cat([keys, new_k[0]], 1), torch.cat([values, new_v[0]], 1))

    def error(rank: int, bands: str | None, value_bands: str | None = None) -> float:
        cfg = S4RConfig(key_space="post_rope",
                        ratio=None, rank_k=rank, rank_v=rank, coef_bands=bands, value_bands=value_bands,
                        outlier_fraction=0.0, recon_fraction=1.0, local_window=0)
        layer = compress_layer(keys, values, None, cfg, rank, rank, None)
        k, v = layer.update(new_k, new_v)
        out = layer.attend(query, k, v, dim**-0.5)
        return float((out - ref).norm() / ref.norm())

    bands = "8:1,4:3,2:4"
    per_token = token_coef_bytes(S4RConfig(coef_bands=bands), heads * dim, 2)
    plain = S4RConfig(coef_bands=None)
    same_bytes = max(r for r in range(1, heads * dim) if token_coef_bytes(plain, r, 2) <= per_token)
    banded, cut = error(heads * dim, bands), error(same_bytes, None)
    assert banded < 0.3 and banded < 0.6 * cut, (banded, cut)  # measured 0.20 against 0.40
    # bands on the values only: int8 keys, the values' own plan decoded by the value path
    values_banded = error(heads * dim, None, value_bands=bands)
    assert values_banded < 0.3 and values_banded < 0.6 * cut, (values_banded, cut)


def test_folded_tokens_keep_value_bands_beside_plain_int8_keys():
    """Tokens folded from the buffer get the values' lower bands even when the keys have none (plain int8
    keys beside banded values, as past HIGH_RATIO with `coef_bands=None`): every stored token has its value
    codes, and attention stays close to the exact one."""
    torch.manual_seed(2)
    heads, total, dim, extra = 2, 200, 32, 40
    mix = decaying_mix(heads * dim)
    keys, values, new_k, new_v = (mixed_tokens(n, mix, heads) for n in (total, total, extra, extra))
    rank = heads * dim
    cfg = S4RConfig(key_space="post_rope", ratio=None, rank_k=rank, rank_v=rank, coef_bands=None,
                    value_bands="8:1,4:3,2:4", outlier_fraction=0.0, recon_fraction=1.0, local_window=0,
                    buffer_tokens=8, fold_tokens=4)
    layer = compress_layer(keys, values, None, cfg, rank, rank, None)
    assert layer.tail_k is None and layer.tail_v is not None
    for i in range(extra):
        k, v = layer.update(new_k[:, i : i + 1].unsqueeze(0), new_v[:, i : i + 1].unsqueeze(0))
    assert layer.stored_coefs > total and layer.tail_v.shape[1] == layer.stored_coefs
    query = torch.randn(1, 2 * heads, 1, dim) * 0.1
    out = layer.attend(query, k, v, dim**-0.5)
    ref = exact_attention(query, torch.cat([keys, new_k], 1), torch.cat([values, new_v], 1))
    assert float((out - ref).norm() / ref.norm()) < 0.3


def test_value_bands_are_their_own_plan_and_bytes():
    shape = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype_bytes=2)
    same = S4RConfig(ratio=5.0)
    own = S4RConfig(ratio=5.0, value_bands="8:1,4:3,2:4")
    assert own.band_spec(values=False) == same.band_spec(values=True) == "8:2,4:3,2:3"
    assert own.band_spec(values=True) == "8:1,4:3,2:4"
    assert S4RConfig(coef_dtype="model", value_bands="8:1,4:3,2:4").band_spec(values=True) is None
    # a narrower int8 lead costs fewer bytes per value column, so the same budget holds more rank
    assert token_coef_bytes(own, 97, 2, values=True) < token_coef_bytes(own, 97, 2)
    a, b = solve_ranks(shape, same, tokens=4096), solve_ranks(shape, own, tokens=4096)
    assert b.rank_k + b.rank_v > a.rank_k + a.rank_v and b.ratio >= 5.0
    with pytest.raises(ValueError, match="first coefficient band"):
        S4RConfig(value_bands="4:1")


def test_past_five_x_values_default_to_two_bits():
    """Past HIGH_RATIO the values' preset is a narrow int8 lead and 2 bits, with scaled lower columns and
    more of the rank to the values; an explicit setting still wins, 5x keeps the keys' bands, and the
    preset's bytes stay within the ratio."""
    shape = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype_bytes=2)
    assert S4RConfig(ratio=5.0).band_spec(values=True) == "8:2,4:3,2:3"
    assert S4RConfig(ratio=8.0).band_spec(values=True) == HIGH_RATIO_VALUE_BANDS == "8:1,2:22"
    assert (S4RConfig(ratio=5.0).tails_normed, S4RConfig(ratio=8.0).tails_normed) == (False, True)
    assert S4RConfig(ratio=8.0, tail_norm=False).tails_normed is False
    assert (S4RConfig(ratio=5.0).rank_key_share, S4RConfig(ratio=8.0).rank_key_share) == (0.4, 0.35)
    assert S4RConfig(ratio=8.0, key_share=0.5).rank_key_share == 0.5
    assert S4RConfig(ratio=8.0).band_spec(values=False) == "8:2,4:3,2:3"
    assert S4RConfig(ratio=8.0, value_bands="8:2,4:3,2:3").band_spec(values=True) == "8:2,4:3,2:3"
    assert S4RConfig(ratio=8.0, coef_dtype="model").band_spec(values=True) is None
    preset = solve_ranks(shape, S4RConfig(ratio=8.0), tokens=4096)
    same = solve_ranks(shape, S4RConfig(ratio=8.0, value_bands="8:2,4:3,2:3"), tokens=4096)
    assert preset.rank_v > same.rank_v and preset.ratio >= 8.0


def test_scaled_columns_project_as_the_orthonormal_basis():
    """`scale_columns` folds each lower column's RMS into the basis: coefficients on it (`project_scaled`)
    have unit RMS on the sample past `first`, rebuild the same projection, and `unit_columns` undoes it."""
    torch.manual_seed(3)
    x = torch.randn(1, 400, 16) * torch.linspace(4.0, 0.05, 16)
    basis = torch.linalg.qr(torch.randn(1, 16, 8)).Q
    scaled = scale_columns(basis, column_rms(x, basis), first=2)
    coef = project_scaled(x, scaled)
    rms = coef.pow(2).mean(dim=1).sqrt()[0]
    assert torch.allclose(rms[2:], torch.ones(6), atol=1e-4)
    assert torch.allclose(coef[..., :2], project(x, basis)[..., :2], atol=1e-5)
    assert torch.allclose(reconstruct(coef, scaled), reconstruct(project(x, basis), basis), atol=1e-4)
    assert torch.allclose(unit_columns(scaled), basis, atol=1e-5)


def test_tail_norm_codes_decaying_columns_closer_and_folds_alike():
    """Columns whose variance decays within a band share one step per token; in units of their own RMS
    (`tail_norm`) the small ones are no longer rounded to half a step, so attention over a full-rank
    banded layer lands closer to the exact one, and tokens folded from the buffer later are coded on the
    same scaled basis (a fold that projected them as on an orthonormal one would be far off)."""
    torch.manual_seed(4)
    heads, total, dim, extra = 2, 300, 32, 40
    mix = decaying_mix(heads * dim)
    keys, values, new_k, new_v = (mixed_tokens(n, mix, heads) for n in (total, total, extra, extra))
    query = torch.randn(1, 2 * heads, 1, dim) * 0.1
    ref = exact_attention(query, torch.cat([keys, new_k], 1), torch.cat([values, new_v], 1))
    rank = heads * dim

    def error(tail_norm: bool) -> float:
        cfg = S4RConfig(key_space="post_rope", ratio=None, rank_k=rank, rank_v=rank, coef_bands="8:1,2:7",
                        tail_norm=tail_norm, outlier_fraction=0.0, recon_fraction=1.0, local_window=0,
                        buffer_tokens=8, fold_tokens=4)
        layer = compress_layer(keys, values, None, cfg, rank, rank, None)
        for i in range(extra):
            k, v = layer.update(new_k[:, i : i + 1].unsqueeze(0), new_v[:, i : i + 1].unsqueeze(0))
        assert layer.stored_coefs > total
        out = layer.attend(query, k, v, dim**-0.5)
        return float((out - ref).norm() / ref.norm())

    plain, normed = error(False), error(True)
    assert normed < 0.8 * plain, (normed, plain)
