"""What the GPU's Triton kernels of an S4R step share: where they serve, the lower bands' column tables and
their decoding, and one launch that turns them off after a failure (the eager path serves then).

Triton compiles the kernels on a GPU; its interpreter (`TRITON_INTERPRET=1`, set before the kernels are
defined) runs them on a CPU, which is how the tests check them against the eager path.
"""

from __future__ import annotations

import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the eager path serves
    triton = None

log = logging.getLogger("s4r.kernels")
_state: dict[str, BaseException | None] = {"failed": None}


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def serves(layer) -> bool:
    """Whether the Triton kernels may run `layer`'s step: Triton present and none failed here, the layer
    on a CUDA device (or the interpreter running), its kernels not set to "eager", int8-coded
    coefficients (the interpreter emulates bf16 roundings, not fp16's)."""
    if triton is None or _state["failed"] is not None or layer._sk is None or layer.cfg.kernels == "eager":
        return False
    if interpreting():
        return layer.dtype != torch.float16
    return layer.basis_k.device.type == "cuda"


def next_power(n: int) -> int:
    """The smallest power of two at least n and 16 (the least size of a Triton product's operand)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def columns(layer, plan) -> torch.Tensor:
    """int32 [5, T] for the T lower-band columns of `plan` (kept on the layer while the plan is the same):
    each one's byte in a token's packed codes, bit shift, code mask, band, and the code's offset (2^b / 2 -
    0.5, as fp32 bits). Code c of a b-bit band sits at bit (c * b) % 8 of byte c * b // 8 (`coef_bands`)."""
    memo = getattr(layer, "_triton_columns", {})
    if plan not in memo:
        rows: list[list[int]] = [[], [], [], [], []]
        byte = 0
        for band, (bits, width) in enumerate(plan.tails):
            offset = torch.tensor((1 << bits) / 2 - 0.5, dtype=torch.float32).view(torch.int32).item()
            for c in range(width):
                entry = (byte + c * bits // 8, c * bits % 8, (1 << bits) - 1, band, offset)
                for row, value in zip(rows, entry, strict=True):
                    row.append(value)
            byte += width * bits // 8
        memo[plan] = torch.tensor(rows, dtype=torch.int32, device=layer.basis_k.device).view(5, -1)
        layer._triton_columns = memo
    return memo[plan]


def tails(layer, keys: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The layer's lower-band codes [G, N, bytes] and steps [G, N, bands] of its keys (or values), and the
    bands' width; one-element stand-ins where it stores no lower bands."""
    codes, steps = (layer._tk, layer._tsk) if keys else (layer._tv, layer._tsv)
    plan = layer.plan_k if keys else layer.plan_v
    if codes is None:
        device = layer.basis_k.device
        return torch.zeros(1, 1, 1, dtype=torch.uint8, device=device), torch.zeros(1, 1, 1, device=device), 0
    return codes, steps, sum(w for _, w in plan.tails)


def launch(what: str, kernel, grid: tuple[int, ...], *args, **meta) -> bool:
    """Run `kernel` over `grid`; where it fails (a GPU or Triton it cannot compile for), the Triton kernels
    stay off for the process after one line naming the error, and False says the eager path serves."""
    try:
        kernel[grid](*args, **meta)
    except Exception as exc:  # noqa: BLE001 - any compiler or launch error: the eager path serves
        _state["failed"] = exc
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("s4r: Triton %s off (%s: %s); using the eager path", what, type(exc).__name__, first)
        return False
    return True


if triton is not None:

    @triton.jit
    def tail_values(codes_ptr, codes_t, steps_ptr, steps_t, cols_ptr, cols_r, col, tok, valid):
        """The decoded lower-band coefficients (fp32; 0 where not `valid`) of tail column `col` of stored
        token `tok` (`col`, `tok` and `valid` broadcast together): codes_ptr and steps_ptr at a basis
        group's packed codes [N, bytes] and steps [N, bands], `codes_t` and `steps_t` apart a token;
        cols_ptr at `columns`' table, `cols_r` apart a row."""
        byte = tl.load(cols_ptr + col, mask=valid, other=0)
        shift = tl.load(cols_ptr + cols_r + col, mask=valid, other=0)
        mask = tl.load(cols_ptr + 2 * cols_r + col, mask=valid, other=0)
        band = tl.load(cols_ptr + 3 * cols_r + col, mask=valid, other=0)
        offset = tl.load(cols_ptr + 4 * cols_r + col, mask=valid, other=0).to(tl.float32, bitcast=True)
        raw = tl.load(codes_ptr + tok * codes_t + byte, mask=valid, other=0).to(tl.int32)
        step = tl.load(steps_ptr + tok * steps_t + band, mask=valid, other=0).to(tl.float32)
        return tl.where(valid, (((raw >> shift) & mask).to(tl.float32) - offset) * step, 0.0)
