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

from s4r.core.band_plan import BandPlan


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


@functools.lru_cache(maxsize=32)
def plane_order(plan: BandPlan) -> tuple[int, ...]:
    """The lower-band code (0 .. w-1, w = rank - lead) that each row of `decode_planar` holds: band by
    band, shift by shift, byte by byte (byte j of a b-bit band holds its codes j * 8/b + shift)."""
    order: list[int] = []
    col = 0
    for bits, width in plan.tails:
        nbytes, per = width * bits // 8, 8 // bits
        order += [col + j * per + shift for shift in range(per) for j in range(nbytes)]
        col += width
    return tuple(order)


def decode_planar(codes: torch.Tensor, steps: torch.Tensor, plan: BandPlan,
                  out: torch.Tensor) -> torch.Tensor:
    """The lower bands of packed codes [B, k, bytes] (steps [B, k, bands]) decoded token axis last into
    `out` [B, w, k] (any float dtype), rows in `plane_order`: one mask or shift per plane and one fused
    (code - offset) * step per band, all along contiguous rows, each value rounded once to `out`'s dtype
    (what `decode_tails` gives, rows reordered)."""
    batch, k, _ = codes.shape
    planes = codes.transpose(1, 2).contiguous()  # [B, bytes, k]: every op below reads contiguous rows
    unpacked = codes.new_empty(batch, plan.rank - plan.lead, k)
    # [B, bands, k] fp32: a strided operand halves the speed of the products
    step_rows = steps.transpose(1, 2).float().contiguous()
    col = at = 0
    for band, (bits, width) in enumerate(plan.tails):
        nbytes, per, mask = width * bits // 8, 8 // bits, (1 << bits) - 1
        src = planes[:, at : at + nbytes]
        for shift in range(per):
            dst = unpacked[:, col + shift * nbytes : col + (shift + 1) * nbytes]
            if shift == 0:
                torch.bitwise_and(src, mask, out=dst)
            else:
                torch.bitwise_right_shift(src, shift * bits, out=dst)
                if shift + 1 < per:  # the top code needs no mask
                    dst.bitwise_and_(mask)
        step = step_rows[:, band : band + 1]
        offset = (1 << bits) / 2 - 0.5  # mid-rise levels (code - offset) * step
        torch.addcmul(step * -offset, unpacked[:, col : col + width], step, out=out[:, col : col + width])
        at += nbytes
        col += width
    return out


def planar_basis(blocks: torch.Tensor, plan: BandPlan) -> torch.Tensor:
    """blocks [H, d, rank] with the lower bands' columns in `plane_order`: what multiplies [lead rows;
    `decode_planar`'s rows] into the decoded keys."""
    lead = plan.lead
    order = torch.arange(plan.rank, device=blocks.device)
    order[lead:] = torch.tensor(plane_order(plan), device=blocks.device) + lead
    return blocks.index_select(-1, order)


def gather_token_rows(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The rows `idx` [B, k] of a per-token store [G, N, x] (G = 1: one layer basis, shared by the B
    token sets): [B, k, x]."""
    if rows.shape[0] == 1:
        # explicit widths: idx may be empty
        return rows[0].index_select(0, idx.reshape(-1)).view(*idx.shape, rows.shape[-1])
    return torch.gather(rows, 1, idx.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))


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
        return cls(byte_planes(gather_token_rows(codes, idx), gather_token_rows(steps, idx), plan), plan)

    def logits(self, q_tail: torch.Tensor) -> torch.Tensor:
        """q_tail [H, M, w] (the query's lower-band coefficients) dotted with each token's decoded lower
        bands: [H, M, k]."""
        a = plane_map(self.plan, str(q_tail.device))
        return _batched(torch.matmul(q_tail, a.T), self.planes)

    def weighted(self, probs: torch.Tensor) -> torch.Tensor:
        """sum_t probs[..., t] * (decoded lower bands of token t): [H, M, w] from probs [H, M, k]."""
        a = plane_map(self.plan, str(probs.device))
        return torch.matmul(_batched(probs, self.planes.transpose(1, 2)), a)
