"""The coding floor: the Gaussian rate-distortion bound and where a stored layer stands against it."""

from __future__ import annotations

import pytest
import torch

from research.coding_floor import charged_bound, gaussian_bound, layer_errors
from s4r.config import S4RConfig
from s4r.core.budget import token_coef_bytes
from tests.test_coef_bands import decaying_mix, mixed_tokens


def test_the_bound_is_reverse_water_filling():
    # n equal components share the bits: error 2^(-2b/n)
    assert gaussian_bound(torch.ones(8), 16.0) == pytest.approx(2.0 ** (-4.0), rel=1e-6)
    # a component below the water level gets no bits and keeps all its energy
    eig = torch.tensor([16.0, 1.0, 1e-6])
    theta = 16.0 * 2.0 ** (-2 * 1.0)  # 1 bit, all to the first, which stays above the second's 1.0
    assert gaussian_bound(eig, 1.0) == pytest.approx((theta + 1.0 + 1e-6) / 17.000001, rel=1e-6)
    # 3 bits: the water level 0.5 falls below the second too, which now gets some
    assert gaussian_bound(eig, 3.0) == pytest.approx((0.5 + 0.5 + 1e-6) / 17.000001, rel=1e-6)
    assert gaussian_bound(eig, 0.0) == pytest.approx(1.0)
    assert gaussian_bound(eig, 40.0) < gaussian_bound(eig, 20.0) < gaussian_bound(eig, 3.0)


def test_a_stored_layer_sits_above_the_bound_at_its_own_bits():
    torch.manual_seed(5)
    heads, dim = 2, 32
    mix = decaying_mix(heads * dim)
    keys, values = mixed_tokens(400, mix, heads), mixed_tokens(400, mix, heads)
    cfg = S4RConfig(ratio=8.0, key_space="post_rope", outlier_fraction=0.0)
    out = layer_errors(keys, values, cfg, 24, 32, None)
    assert out["V"]["bits"] == 8 * token_coef_bytes(cfg, 32, 4, values=True)
    for kind in ("K", "V"):
        assert 0.0 < out[kind]["bound"] < out[kind]["error"] < 1.0, out[kind]
        # the same bits on the stored rank's best subspace alone lose more than spread over every component
        assert out[kind]["bound"] < out[kind]["bound_in_rank"] < out[kind]["error"], out[kind]
        assert 0.0 < out[kind]["bound_charged"] <= out[kind]["bound_in_rank"], out[kind]
        assert out[kind]["gap_db"] > 0.0


def test_the_charged_bound_pays_for_basis_columns_past_the_rank():
    eig = torch.logspace(0, -4, 64, dtype=torch.float64)
    for bits in (20.0, 80.0, 200.0):
        # free columns: water-filling over every component, as the plain bound
        assert charged_bound(eig, bits, 16, 0.0)[0] == pytest.approx(gaussian_bound(eig, bits), rel=1e-6)
        top = eig[:16]
        in_rank = (gaussian_bound(top, bits) * float(top.sum()) + float(eig[16:].sum())) / float(eig.sum())
        # dropping a column gives its bits back, so it can also beat the plain bound, but no code over m
        # components has more than bits + 16 columns' worth
        charged, _ = charged_bound(eig, bits, 16, 2.0)
        assert gaussian_bound(eig, bits + 32.0) < charged <= in_rank + 1e-9
        # dear columns: none past the stored rank
        assert charged_bound(eig, bits, 16, 1e6)[1] <= 16
    assert charged_bound(eig, 0.0, 0, 2.0)[0] == pytest.approx(1.0)
    # the closed form against water-filling by bisection over every count of components
    total = float(eig.sum())
    brute = [(gaussian_bound(eig[:m], 80.0 - (m - 16) * 1.5) * float(eig[:m].sum()) + float(eig[m:].sum()))
             / total for m in range(1, 65) if 80.0 - (m - 16) * 1.5 > 0]
    error, used = charged_bound(eig, 80.0, 16, 1.5)
    assert error == pytest.approx(min(brute), rel=1e-6) and used == 1 + brute.index(min(brute))
