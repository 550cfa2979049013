"""The selected stored tokens' value coefficients weighted by their attention probabilities in one Triton
kernel (a GPU's decode step; checked on a CPU by Triton's interpreter, `s4r.kernels.triton_support`).

Reference: `s4r.core.latent.weighted_value_rows` (the value rows gathered, their lower bands as planes,
then products). A program takes one KV head and `COLUMNS` coefficient columns and runs over the selected
tokens `BLOCK` at a time: each token's columns decoded from the int8 lead band (times its scale) or a lower
band (`tail_values`), then one product with the probabilities accumulated in fp32. The rows never reach
memory; the product with the value basis stays the caller's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from s4r.kernels.triton_support import columns, launch, next_power, serves, tails, triton

if triton is not None:
    import triton.language as tl

    from s4r.kernels.triton_support import tail_values

BLOCK = 32  # selected tokens a step of a program's loop decodes
COLUMNS = 64  # value coefficient columns a program sums


def usable(layer, idx: torch.Tensor) -> bool:
    """Whether the kernel weighs `layer`'s selected value rows `idx` [B, k] (one token set for every head,
    or one a head; the Triton kernels serve the layer, `serves`)."""
    return serves(layer) and idx.shape[0] in (1, layer.heads) and layer._cv.stride(2) == 1


if triton is not None:

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
    where the kernel does not serve (`usable`). A kernel that fails to compile here turns the Triton kernels
    off and the rows are gathered instead (`fallback`)."""
    if not usable(layer, idx):
        return None
    from s4r.core.latent import gather_value_rows, weighted_value_rows

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
        if not k:
            return z.zero_()
        value_rows, value_scale = gather_value_rows(layer.coef_v, sv[:, : layer._n], idx)
        tail_rows = layer.planar_tail(idx, keys=False) if layer._tv is not None else None
        return weighted_value_rows(p_sel, value_rows, value_scale, tail_rows)

    return weigh
