"""Rebuilding pre-RoPE keys by one int8 product: plain tensor functions, the reference of the fused step's
`decode_rows_int8` and `torch._int_mm` or `vnni_key_logits` (`s4r.kernels.s4r_step`).

A token's coefficients become one int8 row on its lead band's step: the lead band's codes as stored (they
are that step's multiples), the lower bands rounded to it. The basis is int8 with one scale per key
dimension. Their product is exact in integers (and in fp32 while rank x 127^2 < 2^24), so the keys are
(basis codes . row codes) x dimension scale x token step.
"""

from __future__ import annotations

import torch

from s4r.core.subspace import quantize_int8


def int8_rows(coefs: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Decoded coefficients [B, r, k] (token axis last) as int8 codes on each token's lead step [B, 1, k]:
    times the step's reciprocal, rounded to nearest even, clamped to +-127."""
    return torch.round(coefs.float() * torch.reciprocal(step.float())).clamp_(-127, 127).to(torch.int8)


def int8_basis(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A basis [H, d, r] as int8 codes with one fp32 scale per key dimension [H, d, 1]."""
    return quantize_int8(blocks.float(), torch.float32)


def int8_keys(basis_codes: torch.Tensor, basis_scale: torch.Tensor, rows: torch.Tensor,
              step: torch.Tensor) -> torch.Tensor:
    """Keys [H, d, k] in fp32: basis codes [H, d, r] times row codes [B, r, k] (B = 1: shared by every
    head), scaled by the basis' scales [H, d, 1] and the tokens' steps [B, 1, k]."""
    heads, d, _ = basis_codes.shape
    if rows.shape[0] == 1:
        sums = torch.matmul(basis_codes.float().reshape(heads * d, -1), rows[0].float()).view(heads, d, -1)
    else:
        sums = torch.matmul(basis_codes.float(), rows.float())
    return sums.mul_(basis_scale).mul_(step.float())
