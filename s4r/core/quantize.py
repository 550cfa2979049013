"""Pure tensor functions of integer KV quantization (KIVI-style): asymmetric group quantization and
bit packing, so a quantized cache stores and counts exactly `bits` bits per element."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# widths that pack into whole bytes without straddling (what llama.cpp / KIVI ship: 8, 4, 2 bits)
PACKABLE_BITS: tuple[int, ...] = (8, 4, 2)
# scales and zero points are fp16 whatever the model's dtype, as in KIVI and llama.cpp's q4_0/q8_0
PARAM_DTYPE = torch.float16
PARAM_BYTES = 2


@dataclass
class Quantized:
    """Codes packed along the last dim, with per-group scale and zero point (model dtype)."""

    packed: torch.Tensor  # uint8 [..., n * bits / 8]
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2**bits) along the last dim into uint8; the last dim must divide evenly."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; use one of {PACKABLE_BITS}")
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
    return (c << shifts).sum(dim=-1, dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def _unpack_table(bits: int, device: str) -> torch.Tensor:
    """[256, 8 / bits] float codes of every byte value: unpacking becomes one table lookup."""
    per = 8 // bits
    byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return ((byte >> shifts) & ((1 << bits) - 1)).float().to(device)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: float32 codes [..., n]."""
    table = _unpack_table(bits, str(packed.device))
    return table[packed.long()].reshape(*packed.shape[:-1], -1)


def quantize_groups(x: torch.Tensor, bits: int, group: int, dim: int) -> Quantized:
    """Asymmetric min/max quantization of `x` in groups of `group` consecutive elements along `dim`.

    KIVI quantizes keys per channel (groups run along tokens, `dim=-2`) because a few key channels
    carry outliers, and values per token (groups along channels, `dim=-1`). The codes are packed along
    the last dim; scale and zero point are kept per group in fp16 (PARAM_DTYPE).
    """
    d = dim % x.ndim
    if x.shape[d] % group:
        raise ValueError(f"size {x.shape[d]} along dim {dim} is not a multiple of the group {group}")
    xf = x.float()
    grouped = xf.unflatten(d, (x.shape[d] // group, group))  # group members at dim d + 1
    lo = grouped.amin(dim=d + 1, keepdim=True)
    hi = grouped.amax(dim=d + 1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(1e-8)
    # the zero point is rounded to fp16 first so that codes are computed against what is stored
    lo = lo.to(PARAM_DTYPE).float()
    scale = scale.to(PARAM_DTYPE).float().clamp_min(2**-24)
    codes = torch.round((grouped - lo) / scale).clamp_(0, levels).flatten(d, d + 1)
    return Quantized(pack_bits(codes, bits), scale.squeeze(d + 1).to(PARAM_DTYPE),
                     lo.squeeze(d + 1).to(PARAM_DTYPE), bits)


def dequantize_groups(q: Quantized, group: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_groups` (up to the rounding), in `dtype`."""
    codes = unpack_bits(q.packed, q.bits).float()
    d = dim % codes.ndim
    grouped = codes.unflatten(d, (codes.shape[d] // group, group))
    out = grouped * q.scale.float().unsqueeze(d + 1) + q.zero.float().unsqueeze(d + 1)
    return out.flatten(d, d + 1).to(dtype)


def quant_bytes_per_token(heads: int, head_dim: int, bits: int, key_group: int, value_group: int) -> float:
    """Bytes one quantized token takes in one layer, K and V, scales and zero points included.

    Keys: `bits` per element plus a scale and zero per channel every `key_group` tokens; values: `bits`
    per element plus a scale and zero per `value_group` channels of every token.
    """
    codes = 2 * heads * head_dim * bits / 8
    key_params = 2 * heads * head_dim * PARAM_BYTES / key_group
    value_params = 2 * heads * (head_dim // value_group) * PARAM_BYTES
    return codes + key_params + value_params
