"""Pure tensor functions of S4R's prefill: hybrid sampling, normalization, bases, coefficients."""

from __future__ import annotations

import torch


def hybrid_sample_indices(n: int, sample: int | None, recent_share: float) -> torch.Tensor:
    """Indices of a hybrid sample of `n` tokens: uniform picks over the early part + the recent block.

    Returns every index when `sample` is None or covers all tokens.
    """
    if sample is None or sample >= n:
        return torch.arange(n)
    recent = min(n, int(round(sample * recent_share)))
    early = sample - recent
    start_recent = n - recent
    picks = torch.linspace(0, max(start_recent - 1, 0), steps=early).round().long() if early > 0 else None
    recent_idx = torch.arange(start_recent, n)
    if picks is None or start_recent == 0:
        return recent_idx
    return torch.unique(torch.cat([picks, recent_idx]))


def normalize_rows(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale each token vector (last dim) to unit L2 norm so large-norm tokens do not dominate the SVD."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def fit_basis(sample: torch.Tensor, rank: int) -> torch.Tensor:
    """Orthonormal basis [groups, width, rank] of the top right-singular vectors of `sample`.

    `sample` is [groups, tokens, width]. The right-singular vectors are the eigenvectors of its Gram
    matrix [width, width] (an fp32 product, then an fp64 eigendecomposition), found in a fraction of an
    SVD's time over thousands of tokens. When the sample has fewer tokens than `rank`, the basis is
    completed with an orthonormal complement so the rank is always honoured.
    """
    x = sample.float()
    groups, tokens, width = x.shape
    rank = min(rank, width)
    _, vectors = torch.linalg.eigh(torch.matmul(x.transpose(1, 2), x).double())  # ascending eigenvalues
    basis = vectors.flip(-1)[:, :, : min(rank, tokens)].float()
    if basis.shape[-1] < rank:
        # fewer sampled tokens than the rank: complete with an orthonormal complement (seeded, so
        # the same input always gives the same basis)
        gen = torch.Generator(device="cpu").manual_seed(0)
        extra = torch.randn(groups, width, rank - basis.shape[-1], generator=gen).to(x.device)
        basis, _ = torch.linalg.qr(torch.cat([basis, extra], dim=-1))
    return basis.contiguous()


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Coefficients of token vectors `x` [groups, tokens, width] on an orthonormal `basis`."""
    return torch.matmul(x.to(basis.dtype), basis)


def project_scaled(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Coefficients of `x` [groups, tokens, width] on a basis of orthogonal columns of any length (an
    orthonormal one whose columns were scaled, `scale_columns`): x . b_j / |b_j|^2, so that
    `reconstruct(coef, basis)` is the projection of `x` on their span."""
    basis = basis.float()
    return torch.matmul(x.float(), basis) / basis.pow(2).sum(dim=-2, keepdim=True).clamp_min(1e-30)


def coefficients(x: torch.Tensor, basis: torch.Tensor, scaled: bool) -> torch.Tensor:
    """Coefficients of `x` on `basis`: `project_scaled` when its columns carry scales (`scale_columns`),
    else `project`."""
    return project_scaled(x, basis) if scaled else project(x, basis)


def column_rms(sample: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """RMS [G, r] over the tokens of `sample` [G, n, width] of its coefficients on `basis` [G, width, r]."""
    return torch.matmul(sample.float(), basis.float()).pow(2).mean(dim=1).sqrt()


def scale_columns(basis: torch.Tensor, rms: torch.Tensor, first: int) -> torch.Tensor:
    """An orthonormal `basis` [G, width, r] whose columns from `first` on are scaled by `rms` [G, r] (the
    RMS of a sample's coefficients on them, `column_rms`): coded on this basis (`project_scaled`) those
    columns' coefficients have unit variance, so one quantizer step per token fits every column of a band."""
    scale = rms.float().clamp_min(1e-12).clone()
    scale[:, :first] = 1.0
    return basis * scale.unsqueeze(1)


def unit_columns(basis: torch.Tensor) -> torch.Tensor:
    """`basis` with every column scaled to unit length (an orthonormal basis is returned as it is, up to
    rounding): undoes `scale_columns`."""
    return basis / basis.pow(2).sum(dim=-2, keepdim=True).sqrt().clamp_min(1e-30)


def reconstruct(coef: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Token vectors from coefficients: coef [groups, tokens, rank] @ basis^T."""
    return torch.matmul(coef, basis.transpose(-1, -2))


def quantize_int8(coef: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token (last dim): returns (int8 values, scale [.., 1])."""
    amax = coef.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8)
    scale = amax / 127.0
    q = torch.round(coef.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(scale_dtype)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_int8`, in `dtype`."""
    return q.to(dtype) * scale.to(dtype)


def relative_residual(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Per token [N]: squared projection error over squared norm, summed over basis groups.

    The basis is orthonormal, so the error is the energy the coefficients do not capture; no residual
    as large as `x` is built (it would be the biggest transient of a long layer's compression).
    """
    total = torch.linalg.vector_norm(x, dim=-1).pow(2).sum(dim=0)
    captured = torch.matmul(x, basis).pow(2).sum(dim=(0, 2))
    return (total - captured).clamp_min(0) / total.clamp_min(1e-12)


def head_blocks(basis: torch.Tensor, heads: int) -> torch.Tensor:
    """[G, width, r] basis -> [H, d, r]: the rows of the basis that belong to each KV head (a view)."""
    if basis.shape[0] == heads:
        return basis
    return basis[0].view(heads, -1, basis.shape[-1])


def project_queries(queries: torch.Tensor, basis_k: torch.Tensor) -> torch.Tensor:
    """Query coefficients [H, rows, r_k] (fp32) of queries [H, rows, d] (the query heads of each KV head
    as its rows) on the key basis [G, width, r_k]: each KV head's block of the basis."""
    return torch.matmul(queries.float(), head_blocks(basis_k, queries.shape[0]).float())
