"""A transform code that runs, at the bits S4R spends: how much of the gap to the Gaussian bound it buys.

`research.coding_floor` puts S4R's stored tokens beside the rate-distortion bound; the bound's test
channel is no code. This module codes the same tokens with quantizers one could store: the eigenbasis of
the tokens' covariance (every token fitted, its columns paid as S4R pays for its bases), each component
given one quantizer of a menu by Lagrangian allocation over the components' variances (the discrete form
of reverse water-filling), columns in units of their own RMS. The menus: `scalar`, the int8, 4-bit and
2-bit bands S4R stores (one bf16 scale per token and band); `vector`, int8 and 4 bits, then vector
quantizers (one byte per block of 4, 8 or 16 coefficients: 2, 1 and 1/2 bit per component, k-means
codebooks of a unit Gaussian, no scale per token) that spend the fractions of a bit a scalar code cannot.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from s4r.core.band_plan import GAUSSIAN_STEP
from s4r.core.subspace import dequantize_int8, quantize_int8

__all__ = ["MENUS", "Quantizer", "allocate", "gaussian_codebook", "menu_quantizers", "practical_code",
           "quantize_band"]

SCALE_BITS = 16  # one bf16 scale (or absmax) per token and band


@dataclass(frozen=True)
class Quantizer:
    """One coefficient quantizer: `bits` per component; `dim` > 1 is a vector quantizer of 2^(bits * dim)
    codewords over blocks of `dim` components, `dim` == 1 a scalar one (8 bits: int8 absmax, else
    Max's uniform step for a unit Gaussian). `distortion`: its mean squared error on a unit Gaussian."""

    bits: float
    dim: int
    distortion: float


def _max_distortion(bits: int) -> float:
    """Mean squared error of the mid-rise uniform quantizer with Max's step on a unit Gaussian."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=gen, dtype=torch.float64)
    return float((x - _scalar(x, bits)).pow(2).mean())


def _scalar(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unit-RMS coefficients through the mid-rise uniform quantizer with Max's Gaussian step (what
    `s4r.core.coef_bands.encode_tails` stores, without its packing into whole bytes, which needs band
    widths the allocation does not give)."""
    half, step = (1 << bits) / 2, GAUSSIAN_STEP[bits]
    return (torch.floor(u / step + half).clamp(0, 2 * half - 1) - (half - 0.5)) * step


@functools.lru_cache(maxsize=8)
def gaussian_codebook(dim: int, size: int = 256, seed: int = 0) -> tuple[torch.Tensor, float]:
    """k-means codebook [size, dim] of a unit Gaussian in `dim` dimensions (fixed by `seed`, so a cache
    would store no codebook), and its mean squared error per component on fresh draws."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(200 * size, 50_000), dim, generator=gen)
    book = x[torch.randperm(x.shape[0], generator=gen)[:size]].clone()
    for _ in range(30):
        nearest = torch.cdist(x, book).argmin(1)
        sums = torch.zeros_like(book).index_add_(0, nearest, x)
        counts = torch.bincount(nearest, minlength=size).unsqueeze(1)
        book = torch.where(counts > 0, sums / counts.clamp_min(1), book)
    test = torch.randn(50_000, dim, generator=gen)
    err = float((test - book[torch.cdist(test, book).argmin(1)]).pow(2).mean())
    return book, err


def _vector(dim: int) -> Quantizer:
    return Quantizer(8.0 / dim, dim, gaussian_codebook(dim)[1])


@functools.lru_cache(maxsize=2)
def menu_quantizers(name: str) -> tuple[Quantizer, ...]:
    """The quantizers of menu `name` (one of `MENUS`), most bits first."""
    int8 = Quantizer(8.0, 1, 1e-5)  # per-token absmax int8 on a band of unit-RMS columns: negligible error
    scalar = tuple(Quantizer(float(b), 1, _max_distortion(b)) for b in (4, 2))
    if name == "scalar":
        return (int8, *scalar)
    return (int8, scalar[0], _vector(4), _vector(8), _vector(16))


MENUS = ("scalar", "vector")


def allocate(variances: torch.Tensor, bits: float, column_bits: float,
             menu: tuple[Quantizer, ...]) -> list[int]:
    """Per component (variances in descending order): the index into `menu` of its quantizer, or -1 for
    none. Minimizes sum(variance * distortion) over choices whose bits, a basis column's `column_bits`
    for each component coded and `SCALE_BITS` for each scalar band used, stay within `bits`; vector
    bands come in whole blocks (the last partial block drops to the next cheaper quantizer)."""
    lam = variances.double().unsqueeze(1)
    rate = torch.tensor([q.bits + column_bits for q in menu], dtype=torch.float64)
    distortion = torch.tensor([q.distortion for q in menu], dtype=torch.float64)

    def pick(mu: float) -> list[int]:
        costs = lam * distortion + mu * rate  # [components, menu]
        best, index = costs.min(dim=1)
        choice = torch.where(best < lam[:, 0], index, -1)
        return _whole_blocks(choice.tolist(), menu)

    def spent(choice: list[int]) -> float:
        used = {c for c in choice if c >= 0 and menu[c].dim == 1}
        return sum(menu[c].bits + column_bits for c in choice if c >= 0) + SCALE_BITS * len(used)

    lo, hi = 1e-12, 1e12
    best = [-1] * variances.numel()
    for _ in range(80):  # bisection on the multiplier, in log space
        mu = math.sqrt(lo * hi)
        choice = pick(mu)
        if spent(choice) > bits:
            lo = mu
        else:
            hi, best = mu, choice
    return best


def _whole_blocks(choice: list[int], menu: tuple[Quantizer, ...]) -> list[int]:
    """Drop the components of a vector band past its last whole block to the next cheaper quantizer."""
    out = list(choice)
    for q_index, q in enumerate(menu):
        members = [i for i, c in enumerate(out) if c == q_index]
        extra = len(members) % q.dim
        if extra:
            cheaper = q_index + 1 if q_index + 1 < len(menu) else -1
            for i in members[len(members) - extra:]:
                out[i] = cheaper
            if cheaper >= 0:
                return _whole_blocks(out, menu)
    return out


def quantize_band(u: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """Coefficients `u` [n, w] (columns of unit RMS) coded by `q`, a scalar band with one scale per token or
    a vector code of whole blocks: dequantized [n, w]."""
    if q.dim > 1:
        # no scale per token: the codebook is a unit Gaussian's, and a block scaled to unit RMS is not one
        book = gaussian_codebook(q.dim)[0].to(u.dtype)
        blocks = u.reshape(u.shape[0] * (u.shape[1] // q.dim), q.dim)
        return book[torch.cdist(blocks, book).argmin(1)].reshape(u.shape)
    if q.bits == 8.0:
        codes, scale = quantize_int8(u, torch.bfloat16)
        return dequantize_int8(codes, scale, torch.float32)
    scale = u.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-12).bfloat16().float()
    return _scalar(u / scale, int(q.bits)) * scale


def practical_code(x: torch.Tensor, bits: float, column_bits: float, menu: str = "vector") -> torch.Tensor:
    """Vectors `x` [n, D] coded in the eigenbasis of their covariance within `bits` per vector (coefficients,
    scales, and `column_bits` for each basis column coded), as `allocate` spends them: rebuilt [n, D]."""
    quantizers = menu_quantizers(menu)
    xd = x.double()
    lam, vec = torch.linalg.eigh(xd.T @ xd / x.shape[0])
    lam, vec = lam.flip(0).clamp_min(0), vec.flip(1)
    choice = allocate(lam, bits, column_bits, quantizers)
    y = (xd @ vec).float()
    y_hat = torch.zeros_like(y)
    for q_index, q in enumerate(quantizers):
        cols = torch.tensor([i for i, c in enumerate(choice) if c == q_index], dtype=torch.long)
        if cols.numel():
            rms = lam[cols].sqrt().float().clamp_min(1e-12)
            y_hat[:, cols] = quantize_band(y[:, cols] / rms, q) * rms
    return (y_hat.double() @ vec.T).to(x.dtype)
