"""Coefficient bands: the leading coefficients in int8, the next ones in 4 and 2 bits (pure tensor functions).

An SVD basis orders its columns by energy, so the coefficients of a token shrink along the rank: giving
every column the same 8 bits (or cutting the rank where the bytes run out) spends bits where they buy
little. Transform coding spends them by variance instead: the first columns in int8 (they also score
tokens in latent space), the next ones in 4 bits, the tail in 2 bits. At the same bytes this keeps about
twice the rank of int8 coefficients (measured effect: docs/design.md, "Coefficient bands").

The int8 band is stored as plain int8 coefficients are (symmetric, per-token absmax scale, token axis
where the latent logits want it). Each lower band is a uniform mid-rise quantizer per token with a step
proportional to the band's RMS (Max's optimal uniform step for a Gaussian source), codes packed in
uint8; its rows are only ever rebuilt for the tokens a decode step selects.
"""

from __future__ import annotations

from typing import Protocol

import torch

from s4r.core.band_plan import GAUSSIAN_STEP, LOW_BITS, BandPlan, parse_band_spec, plan_bands
from s4r.core.quantize import pack_bits
from s4r.core.subspace import quantize_int8

__all__ = ["GAUSSIAN_STEP", "LOW_BITS", "BandPlan", "BandSettings", "Encoded", "decode_tails",
           "encode_coefficients", "encode_tails", "parse_band_spec", "plan_bands"]


class BandSettings(Protocol):
    """What encoding reads of the settings (`s4r.config.S4RConfig` has both); the config itself imports
    this module to check its band specs, so the dependency stays one-way."""

    coef_dtype: str

    def band_spec(self, values: bool = False) -> str | None: ...

def encode_tails(coef: torch.Tensor, plan: BandPlan,
                 step_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower bands of coefficients `coef` [G, N, rank] (fp32): packed codes uint8 [G, N, tail_bytes] and
    steps [G, N, tail_count] in `step_dtype`."""
    g, n, _ = coef.shape
    codes, steps = [], []
    at = plan.lead
    for bits, width in plan.tails:
        band = coef[..., at : at + width].float()
        at += width
        half = (1 << bits) / 2  # mid-rise levels at (c - half + 0.5) * step, c in [0, 2^bits)
        step = band.pow(2).mean(dim=-1, keepdim=True).sqrt().mul_(GAUSSIAN_STEP[bits]).clamp_min_(1e-12)
        step = step.to(step_dtype).float().clamp_min_(1e-12)  # quantize against the step that is stored
        c = torch.floor(band / step + half).clamp_(0, 2 * half - 1)
        codes.append(pack_bits(c, bits))
        steps.append(step)
    if not codes:
        return coef.new_empty(g, n, 0, dtype=torch.uint8), coef.new_empty(g, n, 0, dtype=step_dtype)
    return torch.cat(codes, dim=-1), torch.cat(steps, dim=-1).to(step_dtype)


def decode_tails(codes: torch.Tensor, steps: torch.Tensor, plan: BandPlan) -> torch.Tensor:
    """Inverse of `encode_tails` up to the rounding: fp32 coefficients [..., rank - lead].

    Codes are unpacked with scalar shifts on the uint8 bytes (a table lookup through int64 indices is
    twice as slow: this runs on every selected token of every layer at each decode step)."""
    out, at = [], 0
    for j, (bits, width) in enumerate(plan.tails):
        nbytes, per = width * bits // 8, 8 // bits
        packed = codes[..., at : at + nbytes]
        at += nbytes
        mask = (1 << bits) - 1
        parts = [(packed >> shift) & mask if shift else packed & mask for shift in range(0, 8, bits)]
        c = torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], nbytes * per)
        half = (1 << bits) / 2
        out.append(c.float().sub_(half - 0.5).mul_(steps[..., j : j + 1].float()))
    if not out:
        return codes.new_empty(*codes.shape[:-1], 0, dtype=torch.float32)
    return torch.cat(out, dim=-1)


Encoded = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]


def encode_coefficients(coef: torch.Tensor, cfg: BandSettings, dtype: torch.dtype,
                        values: bool = False) -> Encoded:
    """fp32 key (or value) coefficients [G, N, r] as stored: (lead codes, int8 scales or None, lower-band
    codes or None, their steps or None). Without bands the lead is every column (int8 or the model
    dtype)."""
    if cfg.coef_dtype != "int8":
        return coef.to(dtype), None, None, None
    plan = plan_bands(coef.shape[-1], cfg.band_spec(values))
    lead, scale = quantize_int8(coef[..., : plan.lead], dtype)
    if not plan.tails:
        return lead, scale, None, None
    codes, steps = encode_tails(coef, plan, dtype)
    return lead, scale, codes, steps
