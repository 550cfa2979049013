"""Codes that run at S4R's bits: the Gaussian codebooks, the allocation over a menu, the coded vectors."""

from __future__ import annotations

import pytest
import torch

from research.coding_floor import charged_bound
from research.practical_code import (
    SCALE_BITS,
    allocate,
    gaussian_codebook,
    menu_quantizers,
    practical_code,
    quantize_band,
)
from tests.test_coding_oracle import eigenvalues, gaussian_tokens, relative_error


@pytest.mark.parametrize(("dim", "scalar_error"), [(8, 0.3634), (16, 1.0)])
def test_a_gaussian_codebook_beats_scalar_codes_and_not_the_bound(dim, scalar_error):
    book, err = gaussian_codebook(dim)
    assert book.shape == (256, dim)
    rate = 8.0 / dim
    # above the rate-distortion bound, below what a scalar code of that rate keeps (1 bit: Max's 0.363;
    # half a bit: a scalar code must leave every other component uncoded)
    assert 2.0 ** (-2 * rate) < err < min(scalar_error, 0.5 + 0.5 * 0.3634)


def test_the_allocation_stays_in_its_bits_and_codes_the_large_components_finer():
    lam = torch.logspace(0, -4, 96, dtype=torch.float64)
    menu = menu_quantizers("vector")
    for bits in (40.0, 150.0, 400.0):
        choice = allocate(lam, bits, 0.75, menu)
        used = {c for c in choice if c >= 0 and menu[c].dim == 1}
        spent = sum(menu[c].bits + 0.75 for c in choice if c >= 0) + SCALE_BITS * len(used)
        assert 0 < spent <= bits
        rates = [menu[c].bits if c >= 0 else 0.0 for c in choice]
        assert rates == sorted(rates, reverse=True)  # larger variance, never fewer bits
        for index, q in enumerate(menu):
            assert sum(c == index for c in choice) % q.dim == 0  # vector bands in whole blocks
    assert allocate(lam, 0.0, 0.75, menu) == [-1] * 96
    assert set(allocate(lam, 1e5, 0.75, menu)) == {0}  # bits to spare: every component in int8


def test_a_band_of_int8_keeps_its_coefficients():
    u = torch.randn(300, 24)
    assert relative_error(u, quantize_band(u, menu_quantizers("scalar")[0])) < 1e-4


@pytest.mark.parametrize("menu", ["scalar", "vector"])
def test_the_practical_code_sits_between_the_bound_and_no_code(menu):
    x = gaussian_tokens(6000, 48)
    column = 0.75
    errors = [relative_error(x, practical_code(x, bits, column, menu)) for bits in (30.0, 90.0, 200.0)]
    assert errors[0] > errors[1] > errors[2]
    for bits, err in zip((30.0, 90.0, 200.0), errors, strict=True):
        # no code beats the bound of its bits with its basis paid; the menu's coarse steps (8, 4, 2 bits)
        # keep it within 10 dB of it
        bound, _ = charged_bound(eigenvalues(x), bits, 0, column)
        assert bound < err < 10 * bound


def test_vector_codes_beat_scalar_ones_on_a_gaussian_at_a_bit_or_less_per_component():
    x = gaussian_tokens(6000, 96)
    vector, scalar = (relative_error(x, practical_code(x, 60.0, 0.1, menu)) for menu in ("vector", "scalar"))
    assert vector < 0.95 * scalar
