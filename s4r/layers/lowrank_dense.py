"""A block of queries attending every stored token of a `LowRankLayer` (or of every segment of a layer).

A step of many queries (a question's prompt, a block of an appended document) rebuilds the stored keys
and values once for all its rows, so the rebuild's cost is shared, while a selection would serve every
row with the tokens its last `prompt_window` queries chose. Here the layer's tokens are laid out as the
exact cache holds them (sinks, rebuilt tokens with the outliers' exact rows in place, buffer) and the
block runs the exact cache's attention over them (`causal_attention`). `S4RConfig.dense_queries` says
from how many queries a step does this; every block of a document being read does.

On a CPU with the fused kernels the rebuild is `rebuild_fused` (the decode step's `decode_rows` given
every token, one basis product per head written into the key and value buffers, pre-RoPE keys rotated
in place by `rotate_rows`); elsewhere, and as its reference, `layer_tokens_reference` (torch operations).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from s4r.core.coef_bands import decode_tails
from s4r.core.rope import angle_rows, rotate_half
from s4r.hf.attention import causal_attention
from s4r.kernels.jit import as_numpy
from s4r.kernels.layer_arrays import band_arrays, rebuild_work_dtype, storage_fusable, tail_arrays
from s4r.kernels.sparse_attention import decode_rows, rotate_rows


def attends_every_token(layer, q_len: int) -> bool:
    """Whether a step of `q_len` queries attends every stored token of `layer`: one of at least
    `dense_queries` queries, and every block of a document being read (`collecting`), its last, shorter one
    too, which reuses the tokens the earlier blocks rebuilt. Only per-query scoring keeps no state that the
    skipped scoring would have updated; `dense_queries=0` always selects."""
    cfg = layer.cfg
    if cfg.scoring != "query" or cfg.dense_queries == 0:
        return False
    return cfg.dense_queries <= q_len or layer.collecting


def decoded_rows(lead: torch.Tensor, scale: torch.Tensor | None, codes: torch.Tensor | None,
                 steps: torch.Tensor | None, plan, dtype: torch.dtype) -> torch.Tensor:
    """Every stored token's coefficients [G, N, r] in `dtype`, columns in the basis's order: the lead band
    `lead` [G, N, lead] (int8 codes times `scale` [G, N], or model-dtype coefficients when `scale` is
    None), then the lower bands' packed `codes` [G, N, bytes] with their `steps` [G, N, bands]."""
    groups, n, width = lead.shape
    out = torch.empty(groups, n, plan.rank, dtype=dtype, device=lead.device)
    if scale is None:
        out[..., :width] = lead
    else:
        torch.mul(lead, scale.unsqueeze(-1), out=out[..., :width])
    if codes is not None:
        out[..., width:] = decode_tails(codes, steps, plan)
    return out


def rebuilt(basis: torch.Tensor, rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[H, N, d]: coefficient rows [G, N, r] times the basis [G, width, r] (G = 1: one layer basis, one
    product that gives every head's columns; G = H: one product per KV head)."""
    basis = basis.to(rows.dtype)
    if basis.shape[0] == 1:
        return torch.matmul(rows[0], basis[0].T).view(rows.shape[1], heads, -1).transpose(0, 1)
    return torch.matmul(rows, basis.transpose(1, 2))


def layer_tokens_reference(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the stored tokens of `layer`, rebuilt from their coefficients, into k, v [H, N, d] (its
    dtype), with torch operations: the reference of `rebuild_fused`. Pre-RoPE keys are rotated to their
    positions as the model rotates its own (its dtype, its tables)."""
    n, s, heads = layer._n, layer.sinks, layer.heads
    work = layer.rebuild_dtype  # a CPU without bf16 products rebuilds in fp32
    rows_k = decoded_rows(layer._ck[..., :n].transpose(1, 2), None if layer._sk is None else layer._sk[:, :n],
                          layer.tail_k, layer.tail_step_k, layer.plan_k, work)
    keys = rebuilt(layer.basis_k, rows_k, heads).to(layer.dtype)
    if layer.cfg.key_space == "pre_rope":
        cos, sin = layer._rope(torch.arange(s, s + n, device=keys.device))  # [N, d], broadcast over heads
        keys = torch.addcmul(keys * cos, rotate_half(keys), sin)
    rows_v = decoded_rows(layer._cv[:, :n], None if layer._sv is None else layer._sv[:, :n],
                          layer.tail_v, layer.tail_step_v, layer.plan_v, work)
    k.copy_(keys)
    v.copy_(rebuilt(layer.basis_v, rows_v, heads))


# --- the fused rebuild (its kernels: `s4r.kernels.sparse_attention`) ---------------------------------
def fused_usable(layer) -> bool:
    """Whether `rebuild_fused` applies to `layer` (else the reference runs)."""
    return storage_fusable(layer)


def _head_blocks(basis: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Each KV head's block of a basis [G, H*d/G, r], transposed for the rebuild: [H, r, d] in `dtype`
    (G = 1: head h's columns of the layer basis; G = H: the head's own basis)."""
    if basis.shape[0] == 1:
        rank = basis.shape[-1]
        return basis[0].T.reshape(rank, heads, -1).transpose(0, 1).to(dtype).contiguous()
    return basis.transpose(1, 2).to(dtype).contiguous()


def _rebuild_bases(layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`_head_blocks` of the key and value bases, kept while the bases are the same tensors."""
    memo = getattr(layer, "_dense_bases", None)
    if memo is None or memo[0] is not layer.basis_k or memo[1] is not layer.basis_v or memo[2].dtype != dtype:
        tk = _head_blocks(layer.basis_k, layer.heads, dtype)
        tv = _head_blocks(layer.basis_v, layer.heads, dtype)
        memo = layer._dense_bases = (layer.basis_k, layer.basis_v, tk, tv)
    return memo[2], memo[3]


def _decoded(layer, keys: bool, dtype: torch.dtype) -> torch.Tensor:
    """Every stored token's coefficients [G, N, r] in `dtype`, basis column order."""
    n = layer._n
    lead, scale, plan = (layer._ck, layer._sk, layer.plan_k) if keys else (layer._cv, layer._sv, layer.plan_v)
    codes_np, steps_np = tail_arrays(layer, keys)
    bits, widths = band_arrays(layer, keys)
    out = torch.empty(lead.shape[0], n, plan.rank, dtype=dtype)
    idx = np.arange(n, dtype=np.int64)
    decode_rows(idx, n, as_numpy(lead), as_numpy(scale), codes_np, steps_np, bits, widths, keys,
                as_numpy(out))
    return out


def _product(coefs: torch.Tensor, blocks: torch.Tensor, dst: torch.Tensor) -> None:
    """dst [H, N, d] = coefficient rows [G, N, r] times each head's block [H, r, d]: one 2-D product per
    head written straight into its rows (a batched bf16 product with `out` takes a path ~10x slower)."""
    for h in range(dst.shape[0]):
        rows = coefs[0] if coefs.shape[0] == 1 else coefs[h]
        if dst.dtype == coefs.dtype and dst[h].is_contiguous():
            torch.matmul(rows, blocks[h], out=dst[h])
        else:
            dst[h].copy_(torch.matmul(rows, blocks[h]))


def rebuild_fused(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write `layer`'s stored tokens, rebuilt, into k, v [H, N, d] (the layer's dtype, each head's rows
    contiguous): keys rotated to their positions where they are stored before RoPE."""
    dtype = rebuild_work_dtype(layer)
    basis_kt, basis_vt = _rebuild_bases(layer, dtype)
    pre_rope = layer.cfg.key_space == "pre_rope"
    # rotated in a contiguous copy: numba's loops over a strided view do not vectorize (10x slower)
    keys = torch.empty_like(k) if pre_rope and not k.is_contiguous() else k
    _product(_decoded(layer, True, dtype), basis_kt, keys)
    if pre_rope:
        offset = getattr(layer.rope, "offset", 0)
        angles = angle_rows(layer.rope.rotary, layer.sinks + layer._n + offset).numpy()
        rotate_rows(as_numpy(keys), layer.sinks + offset, angles)
        if keys is not k:
            k.copy_(keys)
    _product(_decoded(layer, False, dtype), basis_vt, v)


def stored_tokens(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the sinks and the stored tokens of `layer` in position order into k, v [H, sinks + N, d]:
    the stored tokens rebuilt (fused where `fused_usable`), the outliers' exact rows in place."""
    s = layer.sinks
    if fused_usable(layer):
        rebuild_fused(layer, k[:, s:], v[:, s:])
    else:
        layer_tokens_reference(layer, k[:, s:], v[:, s:])
    k[:, :s], v[:, :s] = layer.sink_k, layer.sink_v
    if layer.out_idx is not None and layer.out_idx.numel():
        at = layer.out_idx.long() + s
        k[:, at], v[:, at] = layer.out_k, layer.out_v


def buffered_tokens(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the buffer of `layer` (its exact newest tokens) into k, v [H, buffered, d]."""
    k.copy_(layer.buf_k)
    v.copy_(layer.buf_v)


class _Prefix:
    """The rebuilt tokens of one layer, kept for that layer's next block of queries: an appended document
    goes through a layer block after block, each attending the same stored tokens (the earlier segments
    and the last one's coefficients; only the buffer grows). One layer's at most, in buffers with room
    for the next blocks' tokens after them."""

    def __init__(self, key: tuple, last, k: torch.Tensor, v: torch.Tensor) -> None:
        self.key, self.last, self.k, self.v = key, weakref.ref(last), k, v


_kept: list[_Prefix] = []


def forget_rebuilt() -> None:
    """Drop the kept tokens (a step that is not a block of queries, a truncation)."""
    _kept.clear()


def _buffers(segments: Sequence, total: int, prefix: int,
             device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Key and value buffers [H, >= total, d] for every token of `segments`, and whether their first
    `prefix` rows (every token but the last segment's buffer) are already filled, kept from the layer's
    previous block (copied into larger buffers when the block outgrew them)."""
    first, last = segments[0], segments[-1]
    # what the rows depend on: each segment's stored tokens, bases and outliers (a fold, a compression
    # or a new segment changes one of them; a truncation forgets the kept rows)
    key = tuple((id(seg), seg._n, seg._n_buf if seg is not last else -1, seg._n_out, id(seg.basis_k),
                 id(seg.basis_v)) for seg in segments)
    held = _kept[0] if _kept else None
    same = held is not None and held.key == key and held.last() is last
    if same and held.k.shape[1] >= total:
        return held.k, held.v, True
    cap = total + max(total // 4, 256)  # room for the next blocks' tokens
    k = torch.empty(first.heads, cap, first.head_dim, dtype=first.dtype, device=device)
    v = torch.empty_like(k)
    if same:
        k[:, :prefix], v[:, :prefix] = held.k[:, :prefix], held.v[:, :prefix]
    _kept[:] = [_Prefix(key, last, k, v)]
    return k, v, same


def attend_every_token(segments: Sequence, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention [1, Hq, q, d] of `query` [1, Hq, q, d] over every token of `segments` (one layer's, in
    order; the last holds the queries' own tokens at the end of its buffer), each stored token rebuilt."""
    last = segments[-1]
    sizes = [seg.sinks + seg._n + seg._n_buf for seg in segments]
    total = sum(sizes)
    k, v, filled = _buffers(segments, total, total - last._n_buf, query.device)
    at = 0
    for seg, size in zip(segments, sizes, strict=True):
        stored = seg.sinks + seg._n
        if not filled:
            stored_tokens(seg, k[:, at : at + stored], v[:, at : at + stored])
        if not filled or seg is last:
            buffered_tokens(seg, k[:, at + stored : at + size], v[:, at + stored : at + size])
        at += size
        seg.selected = torch.arange(seg._n, device=k.device).expand(seg.heads, -1)
        seg.rebuilt_tokens += seg._n
        seg.scored_tokens += seg._n
    out = causal_attention(query, k[:, :total].unsqueeze(0), v[:, :total].unsqueeze(0), scaling)
    last.fold_buffer()  # as a selected step folds: the buffer back under its cap
    return out
