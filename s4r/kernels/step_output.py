"""The end of a fused decode step (numba, CPU): one softmax per query row over its exact and selected
logits with the exact values' share, and the selected tokens' latent value rows through the value basis.

Reference: `LowRankLayer.attend_chosen` with `s4r.core.latent.merged_attention`.
"""

from __future__ import annotations

import math

import numpy as np

from s4r.kernels.jit import LANES, as_f32, fast_exp, inline, kernel, largest


@kernel
def softmax_exact_values(el, e, sel, k, ev, out, lse, values):
    """One softmax per query row over its exact logits el[r, :e] and selected logits sel[r, :k]: the
    selected probabilities replace sel in place, out [H, M, d] gets the exact values' share (values ev
    [H, >=e, d]) and lse[r] the logsumexp. Without `values`, the exact probabilities replace el in place
    instead and out is zeroed (`query_blocks.exact_values_product` adds their share)."""
    heads, rows, d = out.shape
    lanes = np.empty(LANES, np.float32)
    for h in range(heads):
        for m in range(rows):
            r = h * rows + m
            top = largest(sel[r], k, lanes)
            for t in range(e):
                top = max(top, el[r, t])
            total = np.float32(0.0)
            for t in range(e):
                total += fast_exp(el[r, t] - top)
            for j in range(k):
                p = fast_exp(sel[r, j] - top)
                sel[r, j] = p
                total += p
            inv = np.float32(1.0) / total
            for j in range(k):
                sel[r, j] *= inv
            for i in range(d):
                out[h, m, i] = 0.0
            if values:
                for t in range(e):
                    p = fast_exp(el[r, t] - top) * inv
                    for i in range(d):
                        out[h, m, i] += p * as_f32(ev[h, t, i])
            else:
                for t in range(e):
                    el[r, t] = fast_exp(el[r, t] - top) * inv
            lse[r] = top + np.float32(math.log(total))



@inline
def _add_value_basis(z, basis, out, d):
    heads, rows = out.shape[0], out.shape[1]
    for h in range(heads):
        for m in range(rows):
            zr, dst = z[h * rows + m], out[h, m]
            for c in range(basis.shape[1]):
                w, src = zr[c], basis[h, c]
                for i in range(d):
                    dst[i] += w * src[i]


@kernel
def add_value_basis(z, basis, out):
    """out[h, m, :] += z[h * M + m] @ basis[h]: latent value rows z [H * M, r_v] (`weighted_value_rows`'
    sums, rows in head order) through each KV head's block of the value basis, basis [H, r_v, d]."""
    d = out.shape[2]
    if d == 64:  # a known trip count: the head's row is a few whole vectors
        _add_value_basis(z, basis, out, 64)
    elif d == 128:
        _add_value_basis(z, basis, out, 128)
    else:
        _add_value_basis(z, basis, out, d)
