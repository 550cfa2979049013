"""One token's decode step of a post-RoPE S4R layer (`s4r-fast`) on one thread, in three compiled calls.

`s4r_step.attend` runs the same kernels in the same order for any block and any number of segments, with
Python between each pair of them; for a one-token step of one layer with no rotations to apply that Python
was the largest part of the step (BENCHMARKS.md, "Where a layer's step goes"). Here the kernels before the
scoring run as one call, the scoring as one, and everything after it (normaliser, pooling, selection, key
logits, softmax, value rows) as one, on buffers taken from the shared scratch once a step: the same tokens
and `attend`'s outputs within fp32 rounding (the compiler orders a few sums differently inside the larger
calls; tests compare them). `s4r_step.attend_layer` sends a step here where it applies.
"""

from __future__ import annotations

import numpy as np
import torch

from s4r.kernels.jit import as_numpy, kernel, numba
from s4r.kernels.latent_scoring import (
    combine_normalisers,
    exact_logits,
    latent_logits,
    normaliser,
    pooled_relevance,
    project_queries,
    query_rows,
)
from s4r.kernels.scratch import thread_scratch
from s4r.kernels.sparse_attention import latent_key_logits, weighted_value_rows
from s4r.kernels.step_output import add_value_basis, softmax_exact_values
from s4r.kernels.token_selection import choose_tokens
from s4r.kernels.vnni_scoring import vnni_latent_logits

BUCKET = 128  # the selected logits' buffer width rounded up to this: a few shapes serve every step
# the one-part builds of the split kernels, which a compiled caller can call
_normaliser = getattr(normaliser, "serial", normaliser)
_weighted_value_rows = getattr(weighted_value_rows, "serial", weighted_value_rows)


@kernel
def _before_scoring(query, q, ones, zeros, blocks_k, lead, scaling, q8, qscale, qfull, ek, e, el):
    """The query's rows, their projection on the key basis (int8 lead codes and the full coefficients) and
    their logits on the exact tokens."""
    query_rows(query, q)
    project_queries(q, ones, zeros, False, ones, zeros, blocks_k, lead, scaling, q8, qscale, qfull)
    exact_logits(q, ek, e, scaling, el)


@kernel
def _after_scoring(logits, n, el, e, sinks, n_out, out_idx, cand, sums, keep, pool, pooled, scores, k, k_max,
                   forced, drop, budget, work, picked, qfull, lead, scaling, tk, tsk, bits_k, widths_k, sel,
                   ev, out, lse, cv, sv, tv, tsv, bits_v, widths_v, z, blocks_v):
    """`s4r_step.attend`'s kernels after the scoring, for one segment: the number of tokens chosen (their
    indices picked[:count])."""
    rowmax, rowsum, candsum, norm_lse, candmass = sums[0:1], sums[1:2], sums[2:3], sums[3], sums[4]
    _normaliser(logits, 0, n, el, sinks, n_out, e, out_idx, cand, rowmax[0], rowsum[0], candsum[0], keep, 1)
    combine_normalisers(rowmax, rowsum, candsum, norm_lse, candmass)
    pooled_relevance(logits, 0, n, norm_lse, pool, out_idx, n_out, pooled, scores)
    count = choose_tokens(scores, n, k, k_max, forced, drop, budget, logits, norm_lse, candmass, work, picked)
    idx = picked[:count]
    latent_key_logits(logits, 0, idx, count, qfull, lead, scaling, tk, tsk, bits_k, widths_k, sel)
    softmax_exact_values(el, e, sel, count, ev, out, lse, True)
    if count:
        _weighted_value_rows(sel, idx, count, cv, sv, tv, tsv, bits_v, widths_v, z, 1)
        add_value_basis(z.reshape(out.shape[0] * out.shape[1], z.shape[2]), blocks_v, out)
    return count


def _identity(v, n: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ones [1, d], zeros [1, d], bounds [0, n]): no rotation, one chunk of the n stored tokens."""
    kept = getattr(v, "one_token_identity", None)
    if kept is None or kept[0] != (n, d):
        kept = v.one_token_identity = ((n, d), np.ones((1, d), np.float32), np.zeros((1, d), np.float32),
                                       np.array([0, n], np.int64))
    return kept[1], kept[2], kept[3]


def applies(views, query: torch.Tensor) -> bool:
    """Whether this step computes a layer's attention of `query` (its `s4r_step` views already usable):
    one token, post-RoPE keys, numba present."""
    return numba is not None and query.shape[2] == 1 and not views.pre_rope


def attend_one(layer, v, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 output [H, M, d], logsumexp [H, M]) of the one-token `query` [1, Hq, 1, d] over `layer` (its
    `s4r_step` views `v`), as `s4r_step.attend([layer], query, scaling)` gives them."""
    heads, d, n, e = layer.heads, layer.head_dim, layer._n, layer.exact_length
    rows = query.shape[1] // heads
    nrows = heads * rows
    fewest, most, forced = layer.selection_bounds(local=True)
    if (room := layer._token_room(forced)) is not None:
        fewest, most = min(fewest, room), min(most, room)
    s = thread_scratch(0)
    q, el, logits = s.np("query", (heads, rows, d)), s.np("el", (nrows, e)), s.np("logits", (nrows, n))
    q8, qscale = s.np("q8", (1, nrows, v.lead), torch.int8), s.np("qscale", (1, nrows))
    qfull = s.np("qfull", (nrows, v.rk))
    ones, zeros, bounds = _identity(v, n, d)
    _before_scoring(as_numpy(query), q, ones, zeros, v.blocks_k, v.lead, scaling, q8, qscale, qfull, v.ek, e,
                    el)
    score = vnni_latent_logits if v.vnni_scoring else latent_logits
    score(q8, qscale, bounds, v.ck, v.sk, n, rows, logits, 0, 1)
    picked = s.np("picked", (n,), torch.int64)
    chosen = max(fewest, most) + min(forced, n)  # the most `choose_tokens` picks: top ones, forced tail
    sel = s.np("sel", (nrows, max(BUCKET, -(-chosen // BUCKET) * BUCKET)))
    out, lse = np.empty((heads, rows, d), np.float32), np.empty((heads, rows), np.float32)
    drop = v.drop
    count = _after_scoring(
        logits, n, el, e, layer.sinks, layer._n_out, v.out_idx, n - min(forced, n), s.np("sums", (5, nrows)),
        s.np("keep", (n,)), v.pool, s.np("pool", (n + v.pool,)), s.np("scores", (n,)), fewest, most, forced,
        0.0 if drop is None else drop, drop is not None, s.np("work", (2 * n,)), picked, qfull, v.lead,
        np.float32(scaling), v.tk, v.tsk, v.bits_k, v.widths_k, sel, v.ev, out, lse.reshape(-1), v.cv, v.sv,
        v.tv, v.tsv, v.bits_v, v.widths_v, s.np("z", (v.groups_v, nrows // v.groups_v, v.rv)), v.blocks_v)
    layer.selected = picked[:count].copy()  # the scratch serves the next layer
    layer.rebuilt_tokens += count
    layer.scored_tokens += n
    layer.fold_buffer()
    return torch.from_numpy(out), torch.from_numpy(lse)
