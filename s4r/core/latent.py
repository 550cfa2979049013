"""Attention in the latent space of a low-rank cache: pure tensor functions, no model, no cache.

With post-RoPE keys stored as coefficients `c` on a basis `B` (`k = B c`), a query's logit is
`q . k = (B^T q) . c`: project the query once (`q_lat = B^T q`) and every stored token's logit is a dot
product of rank r instead of head_dim, with no key rebuilt. Values likewise: `sum_t p_t v_t =
B_v (sum_t p_t c_v,t)`, so the output is `(p . C_v[selected]) . B_v^T`. The tokens kept exactly (sinks,
outliers, the buffer of new tokens) join the same softmax, so the result equals attention over the
reconstructed tokens (bit for bit at full rank, up to float rounding).

Shapes: H KV heads, M query rows per KV head (the group's query heads folded with the query positions,
row j*q + i = head j, position i), N stored tokens, G basis groups (H per-head bases, or 1 layer basis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class WeightedTail(Protocol):
    """The selected tokens' lower coefficient bands (`s4r.core.tail_planes.PlanarTail`), as the value
    side uses them: their columns weighted by attention probabilities."""

    def weighted(self, probs: torch.Tensor) -> torch.Tensor: ...


def int8_matmul_available(device: torch.device) -> bool:
    """Whether int8 x int8 -> int32 matmul is used on `device` (CPU; elsewhere coefficients are cast,
    which GPUs do at memory speed, and `_int_mm`'s CUDA shape rules would need padding)."""
    return device.type == "cpu" and hasattr(torch, "_int_mm")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D float tensor: (int8 [m, r], fp32 scale [m, 1])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30).div_(127.0)
    return x.div(scale).round_().to(torch.int8), scale  # |x / scale| <= 127 by construction


def _matmul_rows(q2: torch.Tensor, coef_t: torch.Tensor, scaling: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """scaling * [m, r] x [r, N] -> fp32 [m, N] (into `out` when given); int8 coefficients without a
    float copy of them where possible (the query rounded to int8 per row, an int32 product, one
    rescale pass)."""
    if coef_t.dtype == torch.int8 and int8_matmul_available(coef_t.device):
        q8, q_scale = quantize_rows(q2)
        return torch.mul(torch._int_mm(q8, coef_t), q_scale.mul_(scaling), out=out)
    if coef_t.dtype == torch.int8:
        dtype = q2.dtype if q2.dtype != torch.float32 else torch.bfloat16
        q2, coef_t = q2.to(dtype), coef_t.to(dtype)
    logits = torch.matmul(q2.to(coef_t.dtype), coef_t)
    return logits.float().mul_(scaling) if out is None else out.copy_(logits).mul_(scaling)


def latent_logits(q_lat: torch.Tensor, coef_t: torch.Tensor, scale: torch.Tensor | None,
                  scaling: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention logits [H, M, N] (fp32, times `scaling`) of query rows on every stored token, written
    into `out` (an fp32 [H, M, N] view, e.g. the front of a larger buffer) when given.

    q_lat: [H, M, r] query coefficients (each KV head's rows projected on its basis block);
    coef_t: [G, r, N] key coefficients, token axis last (int8 or float); scale: [G, N] int8 scales or None.
    """
    heads, rows, rank = q_lat.shape
    if out is None:
        out = torch.empty(heads, rows, coef_t.shape[-1], dtype=torch.float32, device=q_lat.device)
    if coef_t.shape[0] == 1:
        # out's head and row axes merge (a contiguous tensor, or the front of a wider buffer's rows)
        _matmul_rows(q_lat.reshape(heads * rows, rank), coef_t[0], scaling, out.view(heads * rows, -1))
    else:
        for h in range(heads):
            _matmul_rows(q_lat[h], coef_t[h], scaling, out[h])
    if scale is not None:
        out.mul_(scale.unsqueeze(1))  # bf16 scales promote into the fp32 logits in place
    return out


def chunked_latent_logits(queries: torch.Tensor, bounds: list[int], coef_t: torch.Tensor,
                          scale: torch.Tensor | None, scaling: float, out: torch.Tensor) -> torch.Tensor:
    """`latent_logits` where each range of stored tokens bounds[c]..bounds[c+1] has its own query rows
    `queries[c]` [H, M, r] (chunked pre-RoPE scoring), written into `out` [H, M, N].

    With int8 coefficients on a CPU the queries are rounded to int8 together and each chunk costs one
    int8 product and one rescale. Elsewhere (a GPU, float coefficients) the equal-sized chunks go through
    one batched product over a strided view of the coefficients, so a step launches a handful of kernels
    whatever the number of chunks, and the last, shorter chunk one more."""
    chunks, heads, rows, rank = queries.shape
    flat = out.view(heads * rows, -1)
    if coef_t.shape[0] != 1:  # per-head bases: a product per head and chunk
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            latent_logits(queries[c], coef_t[..., lo:hi], None, scaling, out=out[..., lo:hi])
    elif coef_t.dtype == torch.int8 and int8_matmul_available(coef_t.device):
        q8, q_scale = quantize_rows(queries.reshape(chunks * heads * rows, rank))
        q8, q_scale = q8.view(chunks, heads * rows, rank), q_scale.mul_(scaling).view(chunks, heads * rows, 1)
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            torch.mul(torch._int_mm(q8[c], coef_t[0, :, lo:hi]), q_scale[c], out=flat[:, lo:hi])
    else:
        dtype = torch.bfloat16 if coef_t.dtype == torch.int8 else coef_t.dtype
        q = queries.reshape(chunks, heads * rows, rank).to(dtype)
        width = bounds[1] - bounds[0]
        whole = (bounds[-1] // width) if len(bounds) > 2 else 0  # chunks of the full width
        if whole:
            span = whole * width
            coef = coef_t[0, :, :span].to(dtype).view(rank, whole, width).transpose(0, 1)  # [C', r, L]
            flat[:, :span].view(heads * rows, whole, width).transpose(0, 1).copy_(torch.bmm(q[:whole], coef))
        for c in range(whole, chunks):
            lo, hi = bounds[c], bounds[c + 1]
            flat[:, lo:hi] = torch.matmul(q[c], coef_t[0, :, lo:hi].to(dtype))
        flat[:, : bounds[-1]].mul_(scaling)
    if scale is not None:
        out[..., : bounds[-1]].mul_(scale.unsqueeze(1))
    return out


def gathered_logits(q_lat: torch.Tensor, coef_t: torch.Tensor, scale: torch.Tensor | None, idx: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """Logits [H, M, k] of query rows on the tokens `idx` [H, k] only (for long query chunks, where the
    logits of every token would cost more than gathering the selected coefficients)."""
    heads, k = idx.shape
    if coef_t.shape[0] == 1:
        cols = coef_t[0].index_select(1, idx.reshape(-1)).view(coef_t.shape[1], heads, k).transpose(0, 1)
        sc = None if scale is None else scale[0].index_select(0, idx.reshape(-1)).view(heads, k)
    else:
        cols = torch.gather(coef_t, 2, idx.unsqueeze(1).expand(heads, coef_t.shape[1], k))
        sc = None if scale is None else torch.gather(scale, 1, idx)
    dtype = q_lat.dtype
    logits = torch.matmul(q_lat, cols.to(dtype)).float()
    if sc is not None:
        logits.mul_(sc.float().unsqueeze(1))
    return logits.mul_(scaling)


def gather_value_rows(coef_v: torch.Tensor, scale_v: torch.Tensor | None,
                      idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Value coefficient rows [H, k, r_v] (still int8 if stored so) and their scales [H, k] of tokens
    `idx` [H, k]; coef_v [G, N, r_v], scale_v [G, N] or None."""
    heads, k = idx.shape
    if coef_v.shape[0] == 1:
        rows = coef_v[0].index_select(0, idx.reshape(-1)).view(heads, k, coef_v.shape[-1])
        sc = None if scale_v is None else scale_v[0].index_select(0, idx.reshape(-1)).view(heads, k)
        return rows, sc
    rows = torch.gather(coef_v, 1, idx.unsqueeze(-1).expand(heads, k, coef_v.shape[-1]))
    return rows, None if scale_v is None else torch.gather(scale_v, 1, idx)


def weighted_value_rows(p_sel: torch.Tensor, value_rows: torch.Tensor, value_scale: torch.Tensor | None,
                        tail: WeightedTail | None = None) -> torch.Tensor:
    """z [H, M, r_v] (fp32): the selected tokens' value coefficients weighted by their probabilities p_sel
    [H, M, k]; their rows `value_rows` [H or 1, k, r_lead] (scales [H or 1, k]; 1: the same tokens for
    every head) and, with `tail`, their lower coefficient bands (the basis columns after r_lead)."""
    weights = p_sel if value_scale is None else p_sel * value_scale.float().unsqueeze(1)
    rows = value_rows.float()
    if rows.shape[0] == 1:  # one token set for every head: a single [H*M, k] x [k, r] product
        heads, m, k = weights.shape
        z = torch.matmul(weights.reshape(heads * m, k), rows[0]).view(heads, m, -1)
    else:
        z = torch.matmul(weights, rows)  # [H, M, r_lead]
    if tail is not None:  # the probabilities themselves: the int8 scales belong to the lead rows
        z = torch.cat([z, tail.weighted(p_sel)], dim=-1)
    return z


def merged_attention(exact_logits: torch.Tensor, exact_v: torch.Tensor, sel_logits: torch.Tensor,
                     weighted: Callable[[torch.Tensor], torch.Tensor] | None, value_blocks: torch.Tensor, *,
                     with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One softmax over exact and latent tokens: (output [H, M, d] in fp32, the logsumexp of the
    logits [H, M] when `with_lse`, else None).

    exact_logits [H, M, e] (masked entries -inf) with exact values [H, e, d]; sel_logits [H, M, k] of
    the selected latent tokens, whose value coefficients `weighted` weighs by their probabilities (p_sel
    [H, M, k] -> z [H, M, r_v]: `weighted_value_rows` of their gathered rows, or a GPU's kernel; None
    where k is 0); value_blocks [H, d, r_v] is each KV head's block of the value basis. The logsumexp
    lets attention over several token sets (segments of a cache with bases of their own) be merged
    exactly (`merge_partial_attention`).
    """
    e = exact_logits.shape[-1]
    logits = torch.cat([exact_logits, sel_logits], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # from the largest probability: p_max = exp(max - lse), and p_max >= 1/n cannot underflow
    lse = logits.amax(dim=-1) - probs.amax(dim=-1).log() if with_lse else None
    p_exact, p_sel = probs[..., :e], probs[..., e:]
    # fp32 throughout: small bf16 matmuls cost more than fp32 ones on CPU, casts included
    out = torch.matmul(p_exact, exact_v.float())
    if sel_logits.shape[-1]:
        out += torch.matmul(weighted(p_sel), value_blocks.float().transpose(1, 2))
    return out, lse


def merge_partial_attention(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Attention over the union of disjoint token sets from each set's own softmax output [H, M, d] and
    logsumexp [H, M]: each output weighted by its set's share of the total softmax mass."""
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)  # [S, H, M, 1]
    return (torch.stack(outs) * weights).sum(dim=0)
