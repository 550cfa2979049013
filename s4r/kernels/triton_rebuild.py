"""The selected pre-RoPE keys of an S4R layer rebuilt, rotated and dotted with the query in one Triton kernel
(a GPU's decode step; checked on a CPU by Triton's interpreter, `s4r.kernels.triton_support`).

Reference: `KeyRebuild._rebuilt_key_logits` (`s4r.layers.lowrank_rebuild`), which runs a dozen tensor
operations for it. A program takes one KV head and `BLOCK` selected tokens: their int8 lead codes times
their scale and their lower bands decoded (`tail_values`) form the coefficient tile; the head's block of the
key basis times it gives each half of the keys' dimensions; the tokens' angles (from the rotary
frequencies) turn them; the head's query rows dot them. The keys never reach memory. In a bf16 or fp16
model the coefficients, the basis and the keys are rounded to its dtype, as the reference's product in the
model's dtype rounds them.
"""

from __future__ import annotations

import torch

from s4r.kernels.triton_support import columns, interpreting, launch, next_power, serves, tails, triton

if triton is not None:
    import triton.language as tl

    from s4r.kernels.triton_support import tail_values

BLOCK = 32  # selected tokens a program rebuilds


def usable(layer, idx: torch.Tensor) -> bool:
    """Whether the kernel rebuilds `layer`'s selected keys `idx` [B, k] (one token set for every head, or
    one a head): the Triton kernels serve the layer (`serves`), its rotary embedding has static
    frequencies and its head size is 32 or more, a power of two."""
    if not serves(layer) or idx.shape[0] not in (1, layer.heads) or not hasattr(layer.rope, "rotary"):
        return False
    half = layer.head_dim // 2  # a power of two: the kernel's ranges are
    return half >= 16 and not half & (half - 1) and layer._ck.stride(2) == 1 and layer._sk.stride(1) == 1


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
        tail_coef = tail_values(tk_ptr + g * tk_g, tk_t, tsk_ptr + g * tsk_g, tsk_t, cols_ptr, cols_r,
                                tc[:, None], tok[None, :], tcm[:, None] & jm[None, :])
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
    cols = columns(layer, plan)
    from s4r.core.subspace import head_blocks

    dtype = layer.dtype if layer.dtype in (torch.bfloat16, torch.float16) else torch.float32
    blocks = head_blocks(layer.basis_k, heads).to(dtype)  # [H, d, r]
    tk, tsk, tail = tails(layer, keys=True)
    q = qf.float().contiguous()
    idx_flat = idx.contiguous()
    idx_h = idx_flat.stride(0) if idx.shape[0] > 1 else 0  # one token set a head, or one for all
    pos0 = layer.sinks + getattr(layer.rope, "offset", 0)
    ck, sk, inv = layer._ck, layer._sk, rotary.inv_freq.float().contiguous()
    ran = launch("key rebuild", _key_logits_kernel, (heads, triton.cdiv(k, BLOCK)),
                 q, idx_flat, k, pos0, ck, sk, tk, tsk, cols, blocks, inv, float(rotary.attention_scaling),
                 float(scaling), out, int(ck.shape[0] > 1), rows, plan.lead, tail, idx_h, ck.stride(0),
                 ck.stride(1), sk.stride(0), tk.stride(0), tk.stride(1), tsk.stride(0), tsk.stride(1),
                 cols.stride(0), blocks.stride(0), blocks.stride(1), q.stride(0), q.stride(1), out.stride(1),
                 RP=next_power(rows), LP=next_power(plan.lead), TP=next_power(tail), HALF=d // 2,
                 BLOCK_K=BLOCK, ROUND=dtype != torch.float32, EMULATE=interpreting())
    return out if ran else None
