"""The GPU's Triton kernels of an S4R decode step, each beside the eager code it replaces: the selected
pre-RoPE keys rebuilt, rotated and dotted with the query (`key_logits`; reference
`KeyRebuild._rebuilt_key_logits`), and the selected tokens' value rows weighted by their probabilities
(`weighted_rows`; reference `s4r.core.latent.weighted_value_rows`). Neither writes the keys or rows to memory.

Key rebuild: a program takes one KV head and `BLOCK` selected tokens: their int8 lead codes times their scale
and their lower bands decoded (`tail_values`) form the coefficient tile; the head's block of the key basis
times it gives each half of the keys' dimensions; the tokens' angles (from the rotary frequencies) turn
them; the head's query rows dot them. In a bf16 or fp16 rebuild the coefficients, the basis and the keys are
rounded to that dtype, as the reference's product in it rounds them. Value rows: a program takes one KV head
and `COLUMNS` coefficient columns and runs over the selected tokens `BLOCK` at a time, each token's columns
decoded from the lead band or a lower band, then one product with the probabilities, summed in fp32.

Triton compiles the kernels on a GPU; its interpreter (`TRITON_INTERPRET=1`, set before this module is
imported) runs them on a CPU, which is how the tests check them. The eager step imports this module only
where a kernel may run (`s4r.layers.lowrank_rebuild.gpu_kernels`); a kernel that fails to compile turns
them off for the process with one line, and the eager path serves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

BLOCK = 32  # selected tokens a program (key rebuild) or a step of its loop (value rows) decodes
COLUMNS = 64  # value coefficient columns a program sums
RANK_BLOCK = 64  # key coefficient columns a step of the key rebuild's loop multiplies: bounds its tiles

log = logging.getLogger("s4r.kernels")
_state: dict[str, BaseException | None] = {"failed": None}


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def serves(layer) -> bool:
    """Whether the Triton kernels may run `layer`'s step: Triton present and none failed here, the layer
    on a CUDA device (or the interpreter running), its kernels not set to "eager", int8-coded
    coefficients (the interpreter emulates bf16 roundings, not fp16's)."""
    if _state["failed"] is not None or layer._sk is None or layer.cfg.kernels == "eager":
        return False
    return layer.dtype != torch.float16 if interpreting() else layer.basis_k.device.type == "cuda"


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
    bands' width; where it stores no lower bands, the int8 band and its scales stand in (a width of 0: the
    kernels read none of them), so a step allocates nothing for them."""
    codes, steps = (layer._tk, layer._tsk) if keys else (layer._tv, layer._tsv)
    plan = layer.plan_k if keys else layer.plan_v
    if codes is None:
        return layer._ck, layer._sk, 0
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


@triton.jit
def tail_values(codes_ptr, codes_t, steps_ptr, steps_t, cols_ptr, cols_r, col, tok, valid):
    """The decoded lower-band coefficients (fp32; 0 where not `valid`) of tail column `col` of stored token
    `tok` (`col`, `tok` and `valid` broadcast together): codes_ptr and steps_ptr at a basis group's packed
    codes [N, bytes] and steps [N, bands], `codes_t` and `steps_t` apart a token; cols_ptr at `columns`'
    table, `cols_r` apart a row. Code c of a b-bit band is (c - (2^b / 2 - 0.5)) times the band's step."""
    byte = tl.load(cols_ptr + col, mask=valid, other=0)
    shift = tl.load(cols_ptr + cols_r + col, mask=valid, other=0)
    mask = tl.load(cols_ptr + 2 * cols_r + col, mask=valid, other=0)
    band = tl.load(cols_ptr + 3 * cols_r + col, mask=valid, other=0)
    offset = tl.load(cols_ptr + 4 * cols_r + col, mask=valid, other=0).to(tl.float32, bitcast=True)
    raw = tl.load(codes_ptr + tok * codes_t + byte, mask=valid, other=0).to(tl.int32)
    step = tl.load(steps_ptr + tok * steps_t + band, mask=valid, other=0).to(tl.float32)
    return tl.where(valid, (((raw >> shift) & mask).to(tl.float32) - offset) * step, 0.0)


def keys_usable(layer, idx: torch.Tensor) -> bool:
    """Whether the kernel rebuilds `layer`'s selected keys `idx` [B, k] (one token set for every head, or
    one a head): the Triton kernels serve the layer (`serves`), its rotary embedding has static
    frequencies and its head size is 32 or more, a power of two."""
    if not serves(layer) or idx.shape[0] not in (1, layer.heads) or not hasattr(layer.rope, "rotary"):
        return False
    half = layer.head_dim // 2  # a power of two: the kernel's ranges are
    return half >= 16 and not half & (half - 1) and layer._ck.stride(2) == 1 and layer._sk.stride(1) == 1


@triton.jit
def _bf16(x):
    """fp32 x rounded to bf16 (to nearest even), kept in fp32, by its bits (the interpreter's casts to
    bf16 are wrong)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)

@triton.jit
def _key_part(basis, coef, ROUND: tl.constexpr, EMULATE: tl.constexpr):
    """basis rows [HALF, RK] (the model's dtype) times a coefficient tile [RK, BLOCK_K], in fp32. `ROUND`
    (a bf16 or fp16 rebuild): the coefficients rounded to that dtype first; `EMULATE` (the interpreter
    runs the kernel: its bf16 products and casts are wrong): fp32 products of the same bf16 roundings."""
    if ROUND and EMULATE:
        return tl.dot(basis.to(tl.float32), _bf16(coef), input_precision="ieee")
    if ROUND:
        return tl.dot(basis, coef.to(basis.dtype)).to(tl.float32)
    return tl.dot(basis, coef, input_precision="ieee")


@triton.jit
def _key_logits_kernel(q_ptr, idx_ptr, k, pos0, ck_ptr, sk_ptr, tk_ptr, tsk_ptr, cols_ptr, basis_ptr,
                       inv_ptr, angle_scale, scaling, out_ptr, grouped, rows, lead, tail, idx_h,
                       ck_g, ck_r, sk_g, tk_g, tk_t, tsk_g, tsk_t, cols_r, b_h, b_d, q_h, q_r, out_r,
                       RP: tl.constexpr, RK: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROUND: tl.constexpr, EMULATE: tl.constexpr):
    h = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    jm = j < k
    tok = tl.load(idx_ptr + h * idx_h + j, mask=jm, other=0)
    g = h * grouped
    scale = tl.load(sk_ptr + g * sk_g + tok, mask=jm, other=0).to(tl.float32)
    di = tl.arange(0, HALF)
    first = basis_ptr + h * b_h + di[:, None] * b_d  # the head's basis rows of each half of its dimensions
    second = first + HALF * b_d
    k1 = tl.full((HALF, BLOCK_K), 0.0, tl.float32)
    k2 = tl.full((HALF, BLOCK_K), 0.0, tl.float32)
    # RK coefficient columns at a time: the lead codes times their scale, then the lower bands decoded
    for c0 in range(0, lead, RK):
        c = c0 + tl.arange(0, RK)
        cm = c < lead
        codes = tl.load(ck_ptr + g * ck_g + c[:, None] * ck_r + tok[None, :], mask=cm[:, None] & jm[None, :],
                        other=0)
        coef = codes.to(tl.float32) * scale[None, :]
        k1 += _key_part(tl.load(first + c[None, :], mask=cm[None, :], other=0), coef, ROUND, EMULATE)
        k2 += _key_part(tl.load(second + c[None, :], mask=cm[None, :], other=0), coef, ROUND, EMULATE)
    for c0 in range(0, tail, RK):
        c = c0 + tl.arange(0, RK)
        cm = c < tail
        coef = tail_values(tk_ptr + g * tk_g, tk_t, tsk_ptr + g * tsk_g, tsk_t, cols_ptr, cols_r, c[:, None],
                           tok[None, :], cm[:, None] & jm[None, :])
        k1 += _key_part(tl.load(first + lead + c[None, :], mask=cm[None, :], other=0), coef, ROUND, EMULATE)
        k2 += _key_part(tl.load(second + lead + c[None, :], mask=cm[None, :], other=0), coef, ROUND, EMULATE)
    if ROUND and EMULATE:  # the keys rounded to the rebuild's dtype, as the reference's product rounds them
        k1, k2 = _bf16(k1), _bf16(k2)
    elif ROUND:
        k1 = k1.to(basis_ptr.dtype.element_ty).to(tl.float32)
        k2 = k2.to(basis_ptr.dtype.element_ty).to(tl.float32)
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


def key_logits(layer, qf: torch.Tensor, idx: torch.Tensor, scaling: float,
               blocks: torch.Tensor) -> torch.Tensor | None:
    """The query rows qf [H, R, d]' logits [H, R, k] on `layer`'s selected keys idx [1 or H, k], rebuilt
    on `blocks` (each KV head's block of the key basis, [H, d, r]), rotated and dotted in the kernel; None
    where it does not serve (`keys_usable`) or failed to compile here (the eager rebuild serves from then
    on; one line says why)."""
    if not keys_usable(layer, idx):
        return None
    heads, rows, d = qf.shape
    k = idx.shape[1]
    out = torch.empty(heads, rows, k, dtype=torch.float32, device=qf.device)
    if k == 0:
        return out
    plan, rotary = layer.plan_k, layer.rope.rotary
    cols = columns(layer, plan)
    # the keys in the dtype the eager step rebuilds them in (`rebuild_dtype`)
    dtype = layer.rebuild_dtype if layer.rebuild_dtype in (torch.bfloat16, torch.float16) else torch.float32
    memo = getattr(layer, "_triton_blocks", None)  # the basis in that dtype, converted once, not every step
    if memo is None or memo[0] is not layer.basis_k or memo[1].dtype != dtype:
        memo = layer._triton_blocks = (layer.basis_k, blocks.to(dtype).contiguous())
    blocks = memo[1]
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
                 RP=next_power(rows), RK=RANK_BLOCK, HALF=d // 2, BLOCK_K=BLOCK, ROUND=dtype != torch.float32,
                 EMULATE=interpreting())
    return out if ran else None


def values_usable(layer, idx: torch.Tensor) -> bool:
    """Whether the kernel weighs `layer`'s selected value rows `idx` [B, k] (one token set for every head,
    or one a head; the Triton kernels serve the layer, `serves`)."""
    return serves(layer) and idx.shape[0] in (1, layer.heads) and layer._cv.stride(2) == 1


@triton.jit
def _value_rows_kernel(p_ptr, idx_ptr, k, cv_ptr, sv_ptr, tv_ptr, tsv_ptr, cols_ptr, z_ptr, grouped,
                       rows, lead, tail, idx_h, p_h, p_r, cv_g, cv_t, sv_g, tv_g, tv_t, tsv_g, tsv_t,
                       cols_r, z_h, z_r, RP: tl.constexpr, CB: tl.constexpr, BLOCK_K: tl.constexpr):
    h = tl.program_id(0)
    g = h * grouped
    c = tl.program_id(1) * CB + tl.arange(0, CB)
    is_lead = c < lead
    is_tail = (c >= lead) & (c < lead + tail)
    tcol = tl.where(is_tail, c - lead, 0)
    rr = tl.arange(0, RP)
    rm = rr < rows
    acc = tl.full((RP, CB), 0.0, tl.float32)
    for j0 in range(0, k, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        jm = j < k
        tok = tl.load(idx_ptr + h * idx_h + j, mask=jm, other=0)
        pm = rm[:, None] & jm[None, :]
        p = tl.load(p_ptr + h * p_h + rr[:, None] * p_r + j[None, :], mask=pm, other=0)
        lm = jm[:, None] & is_lead[None, :]
        codes = tl.load(cv_ptr + g * cv_g + tok[:, None] * cv_t + c[None, :], mask=lm, other=0)
        scale = tl.load(sv_ptr + g * sv_g + tok, mask=jm, other=0).to(tl.float32)
        lower = tail_values(tv_ptr + g * tv_g, tv_t, tsv_ptr + g * tsv_g, tsv_t, cols_ptr, cols_r,
                            tcol[None, :], tok[:, None], jm[:, None] & is_tail[None, :])
        coef = tl.where(lm, codes.to(tl.float32) * scale[:, None], lower)  # [BLOCK_K, CB]
        acc += tl.dot(p.to(tl.float32), coef, input_precision="ieee")
    at = z_ptr + h * z_h + rr[:, None] * z_r + c[None, :]
    tl.store(at, acc, mask=rm[:, None] & (c < lead + tail)[None, :])


def weighted_rows(layer, idx: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """p_sel [H, M, k] -> z [H, M, r_v] (fp32): the probability-weighted value coefficient rows of
    `layer`'s selected tokens idx [1 or H, k], summed in the kernel (`weighted_value_rows`' values); None
    where the kernel does not serve (`values_usable`). A kernel that fails to compile here turns the Triton
    kernels off, and the layer's eager rows serve (`LowRankLayer.gathered_values`)."""
    if not values_usable(layer, idx):
        return None
    plan = layer.plan_v
    cols = columns(layer, plan)
    tv, tsv, tail = tails(layer, keys=False)
    cv, sv = layer._cv, layer._sv
    idx_flat = idx.contiguous()
    idx_h = idx_flat.stride(0) if idx.shape[0] > 1 else 0

    def weigh(p_sel: torch.Tensor) -> torch.Tensor:
        heads, rows, k = p_sel.shape
        z = torch.empty(heads, rows, plan.lead + tail, dtype=torch.float32, device=p_sel.device)
        grid = (heads, triton.cdiv(plan.lead + tail, COLUMNS))
        if k and launch("value rows", _value_rows_kernel, grid, p_sel, idx_flat, k, cv, sv, tv, tsv, cols, z,
                        int(cv.shape[0] > 1), rows, plan.lead, tail, idx_h, p_sel.stride(0), p_sel.stride(1),
                        cv.stride(0), cv.stride(1), sv.stride(0), tv.stride(0), tv.stride(1), tsv.stride(0),
                        tsv.stride(1), cols.stride(0), z.stride(0), z.stride(1), RP=next_power(rows),
                        CB=COLUMNS, BLOCK_K=BLOCK):
            return z
        return layer.gathered_values(idx)(p_sel) if k else z.zero_()

    return weigh
