"""`fit_basis`: the top right-singular vectors of a sample (through its Gram matrix), orthonormal, the
rank honoured when the sample has fewer tokens than it."""

from __future__ import annotations

import torch

from s4r.core.subspace import fit_basis


def sample(groups: int, tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Rows with a decaying spectrum (distinct singular values), as keys and values have."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -3, width)
    return torch.randn(groups, tokens, width, generator=g) * scales


def test_the_basis_is_the_svds_leading_right_singular_vectors():
    x = sample(3, 900, 48)
    basis = fit_basis(x, 20)
    assert basis.shape == (3, 48, 20) and basis.dtype == torch.float32
    want = torch.linalg.svd(x.double(), full_matrices=False)[2].transpose(1, 2)[:, :, :20]
    cosines = (basis.double() * want).sum(dim=1).abs()  # column by column, up to sign
    assert cosines.min() > 1 - 1e-5
    eye = torch.eye(20).expand(3, 20, 20)
    torch.testing.assert_close(basis.transpose(1, 2) @ basis, eye, atol=1e-5, rtol=0)


def test_a_sample_shorter_than_the_rank_is_completed_orthonormally():
    x = sample(2, 5, 16)
    basis = fit_basis(x, 9)
    torch.testing.assert_close(basis.transpose(1, 2) @ basis, torch.eye(9).expand(2, 9, 9), atol=1e-5, rtol=0)
    # the sample's own five directions come first, spanning its rows
    rows = x[0].double()
    lead = basis[0, :, :5].double()
    assert (rows - rows @ lead @ lead.T).norm() < 1e-4 * rows.norm()
    assert torch.equal(fit_basis(x, 9), basis)
