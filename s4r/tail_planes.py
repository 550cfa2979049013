"""The lower coefficient bands of selected tokens, used without unpacking them code by code.

A packed byte `B` of b-bit codes holds `c_s = (B >> s*b) & mask` at shift s. Masking and interleaving the
codes of every selected token costs more, per decode step, than all the matmuls they feed (tens of
small ops over strided tensors). Instead the bytes are shifted whole into *planes* `P_s = B >> s*b`
(one contiguous op per shift, token axis last), and the codes are a fixed linear map of the planes:
`c_s = P_s - 2^b P_{s+1}` (the last plane is the last code). Decoded coefficients are
`step * (c - offset)`, so with each band's planes scaled by its tokens' steps and the step rows appended,
one constant matrix `A` turns the planes into decoded coefficients: `decoded = planes_ext^T @ A`. `A`
moves to the small side of each product: the query (keys) or the probability-weighted sum (values).
Pure tensor functions; `coef_bands.decode_tails` stays the reference they are tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .coef_bands import BandPlan


@functools.lru_cache(maxsize=32)
def plane_map(plan: BandPlan, device: str) -> torch.Tensor:
    """A [w + bands, w] (w = rank - lead): decoded lower bands = (planes scaled by steps, then the step
    rows) @ A, with the codes in their own order. Rows < w: the codes as a combination of planes; row
    w + b: minus band b's mid-rise offset (2^bits / 2 - 0.5) on its columns."""
    width_all = plan.rank - plan.lead
    a = torch.zeros(width_all + plan.tail_count, width_all)
    col = 0
    for band, (bits, width) in enumerate(plan.tails):
        nbytes, per = width * bits // 8, 8 // bits
        for shift in range(per):
            plane = col + shift * nbytes + torch.arange(nbytes)  # this shift's plane, one row per byte
            codes = col + torch.arange(nbytes) * per + shift  # the code each byte holds at this shift
            a[plane, codes] += 1.0
            if shift + 1 < per:  # minus the higher bits that the plane still carries
                a[plane + nbytes, codes] -= float(1 << bits)
        a[width_all + band, col : col + width] = -((1 << bits) / 2 - 0.5)
        col += width
    return a.to(device)


def byte_planes(codes: torch.Tensor, steps: torch.Tensor, plan: BandPlan) -> torch.Tensor:
    """fp32 [B, w + bands, k]: the planes of packed codes [B, k, bytes] (uint8), each band's rows times
    its tokens' steps (steps [B, k, bands]), then the step rows. The token axis is last, so every op
    runs on contiguous rows."""
    batch, k, _ = codes.shape
    width_all = plan.rank - plan.lead
    planes = codes.new_empty(batch, width_all, k)
    col = at = 0
    for bits, width in plan.tails:
        nbytes, per = width * bits // 8, 8 // bits
        band = planes[:, col : col + nbytes]
        band.copy_(codes[..., at : at + nbytes].transpose(1, 2))  # the shifts below read contiguous rows
        for shift in range(1, per):
            start = col + shift * nbytes
            torch.bitwise_right_shift(band, shift * bits, out=planes[:, start : start + nbytes])
        at += nbytes
        col += width
    out = torch.empty(batch, width_all + plan.tail_count, k, dtype=torch.float32, device=codes.device)
    out[:, :width_all] = planes
    out[:, width_all:] = steps.transpose(1, 2)
    col = 0
    for band, (_, width) in enumerate(plan.tails):
        out[:, col : col + width].mul_(out[:, width_all + band : width_all + band + 1])
        col += width
    return out


def _batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [H, M, x] times b [H or 1, x, y] (1: shared by every head): [H, M, y]."""
    if b.shape[0] == 1 and a.shape[0] != 1:
        heads, m, x = a.shape
        return torch.matmul(a.reshape(heads * m, x), b[0]).view(heads, m, -1)
    return torch.matmul(a, b)


@dataclass
class PlanarTail:
    """The lower bands of k selected tokens as planes: what their logits and weighted values need."""

    planes: torch.Tensor  # [B, w + bands, k] fp32 (see `byte_planes`)
    plan: BandPlan

    @classmethod
    def gather(cls, codes: torch.Tensor, steps: torch.Tensor, idx: torch.Tensor,
               plan: BandPlan) -> PlanarTail:
        """The tokens `idx` [B, k] of stored codes [G, N, bytes] and steps [G, N, bands] (G = 1: one
        layer basis; B = 1: one token set for every head)."""
        if codes.shape[0] == 1:
            flat = idx.reshape(-1)
            # explicit widths: idx may be empty
            codes = codes[0].index_select(0, flat).view(*idx.shape, codes.shape[-1])
            steps = steps[0].index_select(0, flat).view(*idx.shape, steps.shape[-1])
        else:
            codes = torch.gather(codes, 1, idx.unsqueeze(-1).expand(-1, -1, codes.shape[-1]))
            steps = torch.gather(steps, 1, idx.unsqueeze(-1).expand(-1, -1, steps.shape[-1]))
        return cls(byte_planes(codes, steps, plan), plan)

    def logits(self, q_tail: torch.Tensor) -> torch.Tensor:
        """q_tail [H, M, w] (the query's lower-band coefficients) dotted with each token's decoded lower
        bands: [H, M, k]."""
        a = plane_map(self.plan, str(q_tail.device))
        return _batched(torch.matmul(q_tail, a.T), self.planes)

    def weighted(self, probs: torch.Tensor) -> torch.Tensor:
        """sum_t probs[..., t] * (decoded lower bands of token t): [H, M, w] from probs [H, M, k]."""
        a = plane_map(self.plan, str(probs.device))
        return torch.matmul(_batched(probs, self.planes.transpose(1, 2)), a)
