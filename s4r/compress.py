"""Prefill-side S4R: turn one layer's full keys/values into sinks, bases and coefficients."""

from __future__ import annotations

import torch

from .config import S4RConfig
from .layers import LowRankLayer, head_blocks, to_groups
from .rope import RopeFn, undo_rope
from .subspace import fit_basis, hybrid_sample_indices, normalize_rows, project, quantize_int8


def compress_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, cfg: S4RConfig,
                   rank_k: int, rank_v: int, rope: RopeFn | None,
                   bases: tuple[torch.Tensor, torch.Tensor] | None = None,
                   reconstruct_all: bool = False) -> LowRankLayer:
    """S4R compression of one layer.

    keys/values: [H, T, d] post-RoPE (as the model produced them); queries: [Hq, W, d] post-RoPE, the
    last W queries of the prompt. Keeps the first `cfg.sinks` tokens as they are, fits rank_k/rank_v
    bases by SVD (fp32) on a normalized hybrid sample of the rest (unless `bases` are given, as the
    offline baseline does), and stores the coefficients of every non-sink token.
    """
    heads, total, _ = keys.shape
    dtype = keys.dtype
    s = min(cfg.sinks, total)
    groups = heads if cfg.granularity == "head" else 1
    k_rest, v_rest = keys[:, s:], values[:, s:]
    if cfg.key_space == "pre_rope":
        if rope is None:
            raise ValueError("pre-RoPE keys need the model's rotary embedding")
        k_rest = undo_rope(k_rest.float(), *(t.float() for t in rope(torch.arange(s, total))))
    k_groups = to_groups(k_rest, groups).float()
    v_groups = to_groups(v_rest, groups).float()

    if bases is None:
        idx = hybrid_sample_indices(total - s, cfg.sample_tokens, cfg.recent_share).to(keys.device)
        sample_k, sample_v = k_groups[:, idx], v_groups[:, idx]
        if cfg.normalize:
            sample_k, sample_v = normalize_rows(sample_k), normalize_rows(sample_v)
        basis_k, basis_v = fit_basis(sample_k, rank_k), fit_basis(sample_v, rank_v)
    else:
        basis_k, basis_v = (b.float() for b in bases)

    coef_k, coef_v = project(k_groups, basis_k), project(v_groups, basis_v)
    scale_k = scale_v = None
    if cfg.coef_dtype == "int8":
        coef_k, scale_k = quantize_int8(coef_k, dtype)
        coef_v, scale_v = quantize_int8(coef_v, dtype)
    else:
        coef_k, coef_v = coef_k.to(dtype), coef_v.to(dtype)

    query_coef = None
    if queries is not None and queries.shape[1]:
        q = queries.float()
        w = q.shape[1]
        if cfg.key_space == "pre_rope":
            q = undo_rope(q, *(t.float() for t in rope(torch.arange(total - w, total))))
        q = q[:, -cfg.query_window :]
        n_rep = q.shape[0] // heads
        kb = head_blocks(basis_k, heads)
        query_coef = torch.matmul(q.reshape(heads, n_rep * q.shape[1], -1), kb)
        query_coef = query_coef.view(q.shape[0], q.shape[1], -1).to(dtype)
    return LowRankLayer(cfg=cfg, sink_k=keys[:, :s].clone(), sink_v=values[:, :s].clone(),
                        basis_k=basis_k.to(dtype), basis_v=basis_v.to(dtype), coef_k=coef_k, coef_v=coef_v,
                        scale_k=scale_k, scale_v=scale_v, query_coef=query_coef, rope=rope,
                        reconstruct_all=reconstruct_all)
