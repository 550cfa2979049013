"""Prefill-side S4R: turn one layer's full keys/values into sinks, bases and coefficients."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from s4r.config import S4RConfig
from s4r.core.band_plan import plan_bands
from s4r.core.coef_bands import Encoded, encode_coefficients
from s4r.core.rope import RopeFn, rope_rows, undo_rope
from s4r.core.subspace import (
    coefficients,
    column_rms,
    fit_basis,
    hybrid_sample_indices,
    normalize_rows,
    project_queries,
    relative_residual,
    scale_columns,
    unit_columns,
)
from s4r.layers.full import to_groups
from s4r.layers.lowrank import LowRankLayer

# tokens whose fp32 keys/values and coefficients one compression step holds at once (~3 MiB of fp32
# keys and values with SmolLM2's 192-wide layer basis). No block is shorter (the remainder joins the
# last one): a product of a few rows can round differently from the whole layer's, blocks this long
# stored the same values as the whole layer in every case checked (tests/test_layerwise_compress_blocks.py)
COMPRESS_BLOCK = 2048

Parts = tuple[torch.Tensor, torch.Tensor]  # a layer's non-sink keys and values as fp32 basis groups


@dataclass
class LayerBases:
    """Bases of one layer (columns ordered by singular value) and the sample's energy per column."""

    k: torch.Tensor  # [G, width, r_k] fp32
    v: torch.Tensor  # [G, width, r_v] fp32
    energy_k: torch.Tensor | None = None  # [r_k]: share of the normalized sample's energy, summed over groups
    energy_v: torch.Tensor | None = None
    # [G, r]: RMS of the (raw) sample's coefficients per column, for `tail_norm`
    rms_k: torch.Tensor | None = None
    rms_v: torch.Tensor | None = None

    def truncated(self, rank_k: int, rank_v: int) -> LayerBases:
        """The leading `rank_k` / `rank_v` columns."""
        return LayerBases(self.k[..., :rank_k], self.v[..., :rank_v],
                          rms_k=None if self.rms_k is None else self.rms_k[:, :rank_k],
                          rms_v=None if self.rms_v is None else self.rms_v[:, :rank_v])


def compressible_parts(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rope: RopeFn | None,
                       rows: slice | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-sink keys/values as fp32 basis groups [G, N, width]; keys un-rotated for pre-RoPE spaces.

    `rows` (a slice or indices into the non-sink tokens) converts only those tokens: the same values
    as the matching rows of the whole, without an fp32 copy of the whole layer.
    """
    heads, total, _ = keys.shape
    s = min(cfg.sinks, total)
    groups = heads if cfg.granularity == "head" else 1
    pick = slice(None) if rows is None else rows
    k_rest, v_rest = keys[:, s:][:, pick], values[:, s:][:, pick]
    if cfg.key_space == "pre_rope":
        if rope is None:
            raise ValueError("pre-RoPE keys need the model's rotary embedding")
        # the tables of every position, then the rows: exactly the values the whole layer would use
        cos, sin = (t[pick].float() for t in rope_rows(rope, s, total))
        k_rest = undo_rope(k_rest.float(), cos, sin)
    # group first, then widen to fp32: a long layer never holds two fp32 copies of its keys or values
    return to_groups(k_rest, groups).float(), to_groups(v_rest, groups).float()


def layer_parts(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rope: RopeFn | None,
                block_tokens: int | None = None) -> Parts | None:
    """The whole layer's `compressible_parts` where its non-sink tokens make one compression block
    (`token_blocks`): the sample, the coefficients and the outliers then take their rows from one
    conversion (the same values as converting those rows alone). None for a longer layer."""
    stored = keys.shape[1] - min(cfg.sinks, keys.shape[1])
    if len(token_blocks(stored, block_tokens or COMPRESS_BLOCK)) > 1:
        return None
    return compressible_parts(keys, values, cfg, rope)


def token_blocks(n: int, block: int) -> list[slice]:
    """Row ranges covering `n` tokens: `block` rows each, the remainder joined to the last one, so no
    range is shorter than `block` (or `n`). One range [0, 0) when there is nothing."""
    starts = list(range(0, max(n - block, 0) + 1, block)) if n > block else [0]
    ends = starts[1:] + [n]
    return [slice(b, e) for b, e in zip(starts, ends, strict=True)]


def _fit(sample: torch.Tensor, cfg: S4RConfig, rank: int,
         energy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if cfg.normalize:
        sample = normalize_rows(sample)
    basis = fit_basis(sample, rank)
    if not energy:
        return basis, None
    # energy captured per basis column, as a share of the sample's total (comparable across layers)
    captured = torch.matmul(sample, basis).pow(2).sum(dim=(0, 1))
    return basis, captured / sample.pow(2).sum().clamp_min(1e-12)


def _hybrid_sample(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rope: RopeFn | None,
                   parts: Parts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hybrid sample of one layer's non-sink keys and values, fp32 grouped rows (not normalized);
    taken from `parts` (`layer_parts`) where given."""
    stored = keys.shape[1] - min(cfg.sinks, keys.shape[1])
    idx = hybrid_sample_indices(stored, cfg.sample_tokens, cfg.recent_share).to(keys.device)
    if parts is not None:
        return parts[0][:, idx], parts[1][:, idx]
    # only the sampled tokens in fp32 (all of them when the sample covers the layer)
    return compressible_parts(keys, values, cfg, rope, idx)


def fit_layer_bases(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rope: RopeFn | None,
                    rank_k: int, rank_v: int, parts: Parts | None = None,
                    energy: bool = True) -> LayerBases:
    """SVD (fp32) bases on a normalized hybrid sample of the non-sink tokens of one layer (`parts`: the
    layer's `layer_parts`, where the caller has them); with `energy`, each column's share of the sample's
    energy too (what allocating ranks by energy reads)."""
    k_sample, v_sample = _hybrid_sample(keys, values, cfg, rope, parts)
    basis_k, energy_k = _fit(k_sample, cfg, rank_k, energy)
    basis_v, energy_v = _fit(v_sample, cfg, rank_v, energy)
    if not cfg.tails_normed:
        return LayerBases(basis_k, basis_v, energy_k, energy_v)
    return LayerBases(basis_k, basis_v, energy_k, energy_v, column_rms(k_sample, basis_k),
                      column_rms(v_sample, basis_v))


def _extended(sample: torch.Tensor, prefix: torch.Tensor, rank: int) -> torch.Tensor:
    """`prefix` [G, width, p] (orthonormal) followed by the `rank - p` directions that best span what it
    leaves of `sample` [G, n, width]: the top singular vectors of the sample's residual, orthogonalized
    against the prefix once more for rounding."""
    extra = rank - prefix.shape[-1]
    if extra <= 0:
        return prefix[..., :rank]
    unit = unit_columns(prefix)  # the prefix may carry its columns' scales (`scale_columns`)
    residual = sample - torch.matmul(torch.matmul(sample, unit), unit.transpose(1, 2))
    new = fit_basis(residual, extra)
    new = new - torch.matmul(unit, torch.matmul(unit.transpose(1, 2), new))
    return torch.cat([prefix, torch.linalg.qr(new).Q], dim=-1)


def extend_layer_bases(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rope: RopeFn | None,
                       prefix_k: torch.Tensor, prefix_v: torch.Tensor, rank_k: int, rank_v: int,
                       parts: Parts | None = None) -> LayerBases:
    """Bases of rank `rank_k` / `rank_v` that begin with the given ones (another segment's, [G, width, p],
    stored there) and add the directions the normalized hybrid sample of these tokens needs most: an
    appended document's keys and values share most of their subspace with the first's (the model's), so
    the new columns go to what is its own. `parts`: as `fit_layer_bases` takes them."""
    raw_k, raw_v = _hybrid_sample(keys, values, cfg, rope, parts)
    k_sample, v_sample = (normalize_rows(raw_k), normalize_rows(raw_v)) if cfg.normalize else (raw_k, raw_v)
    basis_k = _extended(k_sample, prefix_k.float(), rank_k)
    basis_v = _extended(v_sample, prefix_v.float(), rank_v)
    if not cfg.tails_normed:
        return LayerBases(basis_k, basis_v)
    return LayerBases(basis_k, basis_v, rms_k=column_rms(raw_k, unit_columns(basis_k)),
                      rms_v=column_rms(raw_v, unit_columns(basis_v)))


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[G, N, width] basis-group vectors -> [H, N, d] per-head vectors (inverse of `to_groups`)."""
    if x.shape[0] == heads:
        return x
    return x[0].view(x.shape[1], heads, -1).transpose(0, 1)


def _residual(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return x - torch.matmul(torch.matmul(x, basis), basis.transpose(1, 2))


def attention_effect(k_groups: torch.Tensor, v_groups: torch.Tensor, basis_k: torch.Tensor,
                     basis_v: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor,
                     post_rope: bool = True) -> torch.Tensor:
    """Per token [N]: how much its reconstruction error moves the attention output of the prompt's last
    queries, to first order: attention weight x (value error + value norm x logit error), the largest
    over the queries, summed over heads.

    keys [H, T, d] and queries [Hq, W, d] post-RoPE (the whole prompt, sinks first); the groups are the
    non-sink tokens in the basis space. In a pre-RoPE key space the logit error is bounded by norms.
    """
    heads, total, dim = keys.shape
    n = k_groups.shape[1]
    s = total - n
    scale = dim**-0.5
    q = queries.float().reshape(heads, -1, dim)  # [H, n_rep * W, d]
    probs = torch.softmax(torch.matmul(q, keys.float().transpose(1, 2)) * scale, dim=-1)[:, :, s:]
    err_k = _per_head(_residual(k_groups, basis_k), heads)
    err_v = _per_head(_residual(v_groups, basis_v), heads)
    v_norm = _per_head(v_groups, heads).norm(dim=-1).unsqueeze(1)  # [H, 1, N]
    if post_rope:
        logit_err = torch.matmul(q, err_k.transpose(1, 2)).abs() * scale  # post-RoPE: exact first order
    else:
        logit_err = q.norm(dim=-1, keepdim=True) * err_k.norm(dim=-1).unsqueeze(1) * scale
    effect = probs * (err_v.norm(dim=-1).unsqueeze(1) + v_norm * logit_err)
    return effect.amax(dim=1).sum(dim=0)


def outlier_tokens(k_groups: torch.Tensor, v_groups: torch.Tensor, basis_k: torch.Tensor,
                   basis_v: torch.Tensor, count: int, exclude_tail: int = 0,
                   effect: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (sorted) of the `count` tokens the key and value bases represent worst: by relative
    residual, or by `effect` [N] when given (see `attention_effect`).

    The last `exclude_tail` tokens are never picked: decoding reconstructs them as its local window.
    """
    if effect is None:
        effect = relative_residual(k_groups, basis_k) + relative_residual(v_groups, basis_v)
    return worst_tokens(effect, count, exclude_tail)


def worst_tokens(scores: torch.Tensor, count: int, exclude_tail: int = 0) -> torch.Tensor:
    """Indices (sorted) of the `count` highest `scores` [N], never among the last `exclude_tail`."""
    worst = scores.clone()
    if exclude_tail:
        worst[-exclude_tail:] = float("-inf")
    count = min(count, max(0, worst.shape[0] - exclude_tail))
    return torch.topk(worst, count).indices.sort().values


def _unexplained_share(x: torch.Tensor, coef: torch.Tensor,
                       basis: torch.Tensor | None = None) -> torch.Tensor:
    """`relative_residual(x, basis)` from the coefficients `coef` = x @ basis already computed: the same
    arithmetic without a second projection. With `basis` (scaled columns, `scale_columns`), each
    coefficient's energy is weighted by its column's squared length."""
    total = torch.linalg.vector_norm(x, dim=-1).pow(2).sum(dim=0)
    if basis is not None:
        coef = coef * basis.float().pow(2).sum(dim=-2, keepdim=True).sqrt()
    captured = coef.pow(2).sum(dim=(0, 2))
    return (total - captured).clamp_min(0) / total.clamp_min(1e-12)


def _store_rows(dest: list[torch.Tensor | None], parts: Encoded, rows: slice, n: int) -> None:
    """Write one block's encoded tensors [G, b, ...] into the layer's [G, n, ...] ones (made at the first
    block; a block of every row is kept as it is)."""
    for j, part in enumerate(parts):
        if part is None:
            continue
        if part.shape[1] == n:
            dest[j] = part
            continue
        if dest[j] is None:
            dest[j] = part.new_empty((part.shape[0], n, *part.shape[2:]))
        dest[j][:, rows] = part


def encode_layer(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, rope: RopeFn | None,
                 basis_k: torch.Tensor, basis_v: torch.Tensor, block_tokens: int | None = None,
                 score_residuals: bool = False, parts: Parts | None = None
                 ) -> tuple[Encoded, Encoded, torch.Tensor | None]:
    """Stored coefficients of the non-sink tokens of one layer (see `encode_coefficients`) for keys and
    values, and with `score_residuals` each token's relative residual summed over K and V [N].

    Works through `block_tokens` (default `COMPRESS_BLOCK`) tokens at a time, so the fp32 copies of the
    keys/values and of their coefficients exist for one block only; every step is per token, so the
    result is that of the whole layer at once. `parts`: the layer's `layer_parts` (one block), where
    the caller has them.
    """
    n = keys.shape[1] - min(cfg.sinks, keys.shape[1])
    dtype = keys.dtype
    enc_k: list[torch.Tensor | None] = [None] * 4
    enc_v: list[torch.Tensor | None] = [None] * 4
    worst = torch.empty(n, device=keys.device) if score_residuals else None
    blocks = token_blocks(n, block_tokens or COMPRESS_BLOCK)
    whole = parts is not None and len(blocks) == 1  # `parts` covers one block only
    for rows in blocks:
        k_groups, v_groups = parts if whole else compressible_parts(keys, values, cfg, rope, rows)
        scaled = cfg.tails_normed
        proj_k, proj_v = coefficients(k_groups, basis_k, scaled), coefficients(v_groups, basis_v, scaled)
        _store_rows(enc_k, encode_coefficients(proj_k, cfg, dtype), rows, n)
        _store_rows(enc_v, encode_coefficients(proj_v, cfg, dtype, values=True), rows, n)
        if worst is not None:
            worst[rows] = (_unexplained_share(k_groups, proj_k, basis_k if scaled else None)
                           + _unexplained_share(v_groups, proj_v, basis_v if scaled else None))
    return tuple(enc_k), tuple(enc_v), worst


def compress_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, cfg: S4RConfig,
                   rank_k: int, rank_v: int, rope: RopeFn | None,
                   bases: LayerBases | None = None, block_tokens: int | None = None,
                   shared: tuple[int, int] = (0, 0),
                   parts: Parts | None = None) -> LowRankLayer:
    """S4R compression of one layer.

    keys/values: [H, T, d] post-RoPE (as the model produced them); queries: [Hq, W, d] post-RoPE, the
    last W queries of the prompt. Keeps the first `cfg.sinks` tokens as they are, fits rank_k/rank_v
    bases (unless `bases` are given: precomputed or offline ones, truncated to the ranks) and stores
    the coefficients of every non-sink token, `block_tokens` tokens at a time (see `encode_layer`).
    `shared` (key, value): leading basis columns another segment stores, kept as they are. `parts`: the
    layer's `layer_parts`, where the caller has them (computed here otherwise).
    """
    heads, total, _ = keys.shape
    dtype = keys.dtype
    s = min(cfg.sinks, total)
    if parts is None:
        parts = layer_parts(keys, values, cfg, rope, block_tokens)
    if bases is None:
        bases = fit_layer_bases(keys, values, cfg, rope, rank_k, rank_v, parts, energy=False)
    basis_k, basis_v = (b.float() for b in (bases.k[..., :rank_k], bases.v[..., :rank_v]))
    if cfg.tails_normed:
        if bases.rms_k is None or bases.rms_v is None:  # bases fitted elsewhere (offline, calibrated)
            k_sample, v_sample = _hybrid_sample(keys, values, cfg, rope, parts)
            bases = replace(bases, rms_k=column_rms(k_sample, basis_k), rms_v=column_rms(v_sample, basis_v))
            del k_sample, v_sample
        lead_k = max(plan_bands(rank_k, cfg.band_spec()).lead, shared[0])
        lead_v = max(plan_bands(rank_v, cfg.band_spec(values=True)).lead, shared[1])
        basis_k = scale_columns(basis_k, bases.rms_k[:, :rank_k], lead_k)
        basis_v = scale_columns(basis_v, bases.rms_v[:, :rank_v], lead_v)
    n_out = cfg.outlier_count(total - s)
    has_queries = queries is not None and queries.shape[1] > 0
    by_attention = n_out > 0 and cfg.outlier_score == "attention" and has_queries
    score_residuals = n_out > 0 and not by_attention
    (coef_k, scale_k, tail_k, tail_step_k), (coef_v, scale_v, tail_v, tail_step_v), worst = encode_layer(
        keys, values, cfg, rope, basis_k, basis_v, block_tokens, score_residuals, parts)

    out_idx = out_k = out_v = None
    if n_out:
        if by_attention:
            # post-RoPE keys for the logits whatever the basis space; the error itself is measured there
            k_groups, v_groups = parts or compressible_parts(keys, values, cfg, rope)
            worst = attention_effect(k_groups, v_groups, unit_columns(basis_k), unit_columns(basis_v), keys,
                                     queries[:, -cfg.query_window :], cfg.key_space == "post_rope")
            del k_groups, v_groups
        out_idx = worst_tokens(worst, n_out, cfg.local_window)
        out_k, out_v = keys[:, s + out_idx].clone(), values[:, s + out_idx].clone()
        out_idx = out_idx.to(torch.int32)

    query_coef = None
    if queries is not None and queries.shape[1]:
        q = queries.float()
        w = q.shape[1]
        if cfg.key_space == "pre_rope":
            q = undo_rope(q, *(t.float() for t in rope_rows(rope, total - w, total)))
        q = q[:, -cfg.query_window :]
        n_rep = q.shape[0] // heads
        query_coef = project_queries(q.reshape(heads, n_rep * q.shape[1], -1), basis_k)
        query_coef = query_coef.view(q.shape[0], q.shape[1], -1).to(dtype)
    return LowRankLayer(cfg=cfg, sink_k=keys[:, :s].clone(), sink_v=values[:, :s].clone(),
                        basis_k=basis_k.to(dtype), basis_v=basis_v.to(dtype), coef_k=coef_k, coef_v=coef_v,
                        scale_k=scale_k, scale_v=scale_v, query_coef=query_coef, rope=rope,
                        out_idx=out_idx, out_k=out_k, out_v=out_v, tail_k=tail_k, tail_v=tail_v,
                        tail_step_k=tail_step_k, tail_step_v=tail_step_v)
