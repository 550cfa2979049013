"""The selected pre-RoPE keys of an S4R layer rebuilt, rotated and dotted with the query in one Triton kernel
(a GPU's decode step; checked on a CPU by Triton's interpreter, `TRITON_INTERPRET=1`).

Reference: `KeyRebuild._rebuilt_key_logits` (`s4r.layers.lowrank_rebuild`), which runs a dozen tensor
operations for it. A program takes one KV head and `BLOCK` selected tokens: their int8 lead codes times
their scale and their lower bands decoded (code c of a b-bit band sits at bit (c * b) % 8 of byte c * b // 8,
`coef_bands`' packing) form the coefficient tile; the head's block of the key basis times it gives each half
of the keys' dimensions; the tokens' angles (from the rotary frequencies) turn them; the head's query rows
dot them. The keys never reach memory. In a bf16 or fp16 model the coefficients, the basis and the keys
are rounded to its dtype, as the reference's product in the model's dtype rounds them.
"""

from __future__ import annotations

import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the eager rebuild serves
    triton = None

BLOCK = 32  # selected tokens a program rebuilds
log = logging.getLogger("s4r.kernels")
_state: dict[str, object] = {"failed": None}


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU (`TRITON_INTERPRET=1`: tests check the kernel so)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(layer, idx: torch.Tensor) -> bool:
    """Whether the kernel rebuilds `layer`'s selected keys `idx` [B, k] (one token set for every head, or
    one a head): Triton present (and not failed here), a CUDA device (or the interpreter), int8-coded
    coefficients, a rotary embedding with static frequencies, a head size of 32 or more, a power of two."""
    if triton is None or _state["failed"] is not None or layer._sk is None:
        return False
    if idx.shape[0] not in (1, layer.heads):
        return False
    if layer.basis_k.device.type != "cuda" and not interpreting():
        return False
    if interpreting() and layer.dtype == torch.float16:  # the interpreter emulates bf16 roundings only
        return False
    half = layer.head_dim // 2  # a power of two: the kernel's ranges are
    if half < 16 or half & (half - 1) or layer._ck.stride(2) != 1 or layer._sk.stride(1) != 1:
        return False
    return hasattr(layer.rope, "rotary")


def _next_power(n: int) -> int:
    """The smallest power of two at least n and 16 (the least size of a Triton product's operand)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def column_tables(plan, device: torch.device) -> torch.Tensor:
    """int32 [5, T] for the T lower-band columns of `plan`: each one's byte in a token's packed codes, bit
    shift, code mask, band, and the code's offset (2^b / 2 - 0.5, as fp32 bits)."""
    rows: list[list[int]] = [[], [], [], [], []]
    byte = 0
    for band, (bits, width) in enumerate(plan.tails):
        for c in range(width):
            offset = torch.tensor((1 << bits) / 2 - 0.5, dtype=torch.float32).view(torch.int32).item()
            for row, value in zip(rows, (byte + c * bits // 8, c * bits % 8, (1 << bits) - 1, band, offset),
                                  strict=True):
                row.append(value)
        byte += width * bits // 8
    return torch.tensor(rows, dtype=torch.int32, device=device).view(5, -1)


if triton is not None:

    @triton.jit
    def _bf16(x):
        """fp32 x rounded to bf16 (to nearest even), kept in fp32, by its bits (the interpreter's casts to
        bf16 are wrong)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _keys(lead_basis, tail_basis, lead_coef, tail_coef, ROUND: tl.constexpr, EMULATE: tl.constexpr):
        """Half of the keys' dimensions [HALF, BLOCK_K] fp32: the basis rows (in the model's dtype) times the
        coefficient tiles. `ROUND` (the model's dtype is bf16 or fp16): products of the coefficients rounded
        to it, the keys rounded to it; `EMULATE` (the interpreter runs the kernel: its bf16 products and
        casts are wrong): fp32 products of the same bf16 roundings."""
        if ROUND and EMULATE:
            lc, tc = _bf16(lead_coef), _bf16(tail_coef)
            keys = tl.dot(lead_basis.to(tl.float32), lc, input_precision="ieee")
            keys += tl.dot(tail_basis.to(tl.float32), tc, input_precision="ieee")
            return _bf16(keys)
        if ROUND:
            lc, tc = lead_coef.to(lead_basis.dtype), tail_coef.to(lead_basis.dtype)
            keys = tl.dot(lead_basis, lc) + tl.dot(tail_basis, tc)
            return keys.to(lead_basis.dtype).to(tl.float32)
        keys = tl.dot(lead_basis, lead_coef, input_precision="ieee")
        return keys + tl.dot(tail_basis, tail_coef, input_precision="ieee")

    @triton.jit
    def _key_logits_kernel(q_ptr, idx_ptr, k, pos0, ck_ptr, sk_ptr, tk_ptr, tsk_ptr, cols_ptr, basis_ptr,
                           inv_ptr, angle_scale, scaling, out_ptr, grouped, rows, lead, tail, idx_h,
                           ck_g, ck_r, sk_g, tk_g, tk_t, tsk_g, tsk_t, cols_r, b_h, b_d, q_h, q_r, out_r,
                           RP: tl.constexpr, LP: tl.constexpr, TP: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_K: tl.constexpr, ROUND: tl.constexpr, EMULATE: tl.constexpr):
        h = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        jm = j < k
        tok = tl.load(idx_ptr + h * idx_h + j, mask=jm, other=0)
        g = h * grouped
        # the coefficient tile: lead codes times their scale [LP, BLOCK_K], lower bands decoded [TP, BLOCK_K]
        lr = tl.arange(0, LP)
        lm = (lr < lead)[:, None] & jm[None, :]
        codes = tl.load(ck_ptr + g * ck_g + lr[:, None] * ck_r + tok[None, :], mask=lm, other=0)
        scale = tl.load(sk_ptr + g * sk_g + tok, mask=jm, other=0).to(tl.float32)
        lead_coef = codes.to(tl.float32) * scale[None, :]
        tc = tl.arange(0, TP)
        tcm = tc < tail
        byte = tl.load(cols_ptr + tc, mask=tcm, other=0)
        shift = tl.load(cols_ptr + cols_r + tc, mask=tcm, other=0)
        mask = tl.load(cols_ptr + 2 * cols_r + tc, mask=tcm, other=0)
        band = tl.load(cols_ptr + 3 * cols_r + tc, mask=tcm, other=0)
        offset = tl.load(cols_ptr + 4 * cols_r + tc, mask=tcm, other=0).to(tl.float32, bitcast=True)
        tm = tcm[:, None] & jm[None, :]
        raw = tl.load(tk_ptr + g * tk_g + tok[None, :] * tk_t + byte[:, None], mask=tm, other=0).to(tl.int32)
        step = tl.load(tsk_ptr + g * tsk_g + tok[None, :] * tsk_t + band[:, None], mask=tm, other=0)
        tail_coef = tl.where(tm, (((raw >> shift[:, None]) & mask[:, None]).to(tl.float32) - offset[:, None])
                             * step.to(tl.float32), 0.0)
        # each half of the head's key dimensions: its rows of the basis block times the tile
        di = tl.arange(0, HALF)
        base = basis_ptr + h * b_h
        lb = (lr < lead)[None, :]
        tb = tcm[None, :]
        b1l = tl.load(base + di[:, None] * b_d + lr[None, :], mask=lb, other=0)
        b2l = tl.load(base + (di[:, None] + HALF) * b_d + lr[None, :], mask=lb, other=0)
        b1t = tl.load(base + di[:, None] * b_d + lead + tc[None, :], mask=tb, other=0)
        b2t = tl.load(base + (di[:, None] + HALF) * b_d + lead + tc[None, :], mask=tb, other=0)
        k1 = _keys(b1l, b1t, lead_coef, tail_coef, ROUND, EMULATE)
        k2 = _keys(b2l, b2t, lead_coef, tail_coef, ROUND, EMULATE)
        # the tokens' rotation, then the query rows' dots with both halves
        angle = tl.load(inv_ptr + di)[:, None] * (tok + pos0).to(tl.float32)[None, :]
        cos = tl.cos(angle) * angle_scale
        sin = tl.sin(angle) * angle_scale
        r1 = k1 * cos - k2 * sin
        r2 = k2 * cos + k1 * sin
        rr = tl.arange(0, RP)
        rm = rr < rows
        q1 = tl.load(q_ptr + h * q_h + rr[:, None] * q_r + di[None, :], mask=rm[:, None], other=0)
        q2 = tl.load(q_ptr + h * q_h + rr[:, None] * q_r + HALF + di[None, :], mask=rm[:, None], other=0)
        logits = (tl.dot(q1, r1, input_precision="ieee") + tl.dot(q2, r2, input_precision="ieee")) * scaling
        at = out_ptr + (h * rows + rr[:, None]) * out_r + j[None, :]
        tl.store(at, logits, mask=rm[:, None] & jm[None, :])


def key_logits(layer, qf: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """The query rows qf [H, R, d]' logits [H, R, k] on `layer`'s selected keys idx [1 or H, k], rebuilt,
    rotated and dotted in the kernel; None where it does not serve (`usable`) or failed to compile here
    (the eager rebuild serves from then on; one line says why)."""
    if not usable(layer, idx):
        return None
    heads, rows, d = qf.shape
    k = idx.shape[1]
    out = torch.empty(heads, rows, k, dtype=torch.float32, device=qf.device)
    if k == 0:
        return out
    plan, rotary = layer.plan_k, layer.rope.rotary
    memo = getattr(layer, "_triton_columns", None)
    if memo is None or memo[0] is not plan:
        memo = layer._triton_columns = (plan, column_tables(plan, qf.device))
    cols = memo[1]
    from s4r.core.subspace import head_blocks

    blocks = head_blocks(layer.basis_k, heads)  # [H, d, r]
    dtype = layer.dtype if layer.dtype in (torch.bfloat16, torch.float16) else torch.float32
    blocks = blocks.to(dtype)
    tk = layer._tk if layer._tk is not None else layer._ck.new_zeros(1, 1, 1).to(torch.uint8)
    tsk = layer._tsk if layer._tsk is not None else blocks.new_zeros(1, 1, 1)
    tail = sum(w for _, w in plan.tails)
    q = qf.float().contiguous()
    idx_flat = idx.contiguous()
    idx_h = idx_flat.stride(0) if idx.shape[0] > 1 else 0  # one token set a head, or one for all
    pos0 = layer.sinks + getattr(layer.rope, "offset", 0)
    ck, sk, inv = layer._ck, layer._sk, rotary.inv_freq.float().contiguous()
    grid = (heads, triton.cdiv(k, BLOCK))
    try:
        _key_logits_kernel[grid](
            q, idx_flat, k, pos0, ck, sk, tk, tsk, cols, blocks, inv, float(rotary.attention_scaling),
            float(scaling), out, int(ck.shape[0] > 1), rows, plan.lead, tail, idx_h, ck.stride(0),
            ck.stride(1), sk.stride(0), tk.stride(0), tk.stride(1), tsk.stride(0), tsk.stride(1),
            cols.stride(0), blocks.stride(0), blocks.stride(1), q.stride(0), q.stride(1), out.stride(1),
            RP=_next_power(rows),
            LP=_next_power(plan.lead), TP=_next_power(tail), HALF=d // 2, BLOCK_K=BLOCK,
            ROUND=dtype != torch.float32, EMULATE=interpreting())
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here: the eager rebuild serves
        _state["failed"] = exc
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("s4r: Triton key rebuild off (%s: %s); using the eager path", type(exc).__name__, first)
        return None
    return out
