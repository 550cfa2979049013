"""Scoring every stored token of an S4R layer for one decode query, fused (numba, CPU).

Reference: `LatentSelection.latent_step` / `step_scores` (`s4r.layers.lowrank_selection`) with
`s4r.core.latent.latent_logits`, `chunked_latent_logits` and `s4r.core.selection.pool_scores`. The same
arithmetic: the query rows (un-rotated and turned by each chunk's mean rotation for pre-RoPE keys)
projected on the key basis, rounded to int8 per row, dotted as integers with the int8 lead band (token
axis innermost, so the loop vectorizes; the integer sums are taken in fp32, where they are exact),
rescaled by the query's and each token's scale. Relevance is kept in the log domain (max over query
rows of logit - logsumexp, max-pooled), which orders tokens as the reference's probabilities do.
"""

from __future__ import annotations

import math

import numpy as np

from s4r.kernels.jit import LANES, as_f32, fast_exp, inline, kernel, largest, prange, split_kernel

TILE = 512  # tokens per tile: the three rows' accumulators and the band's tile stay in L1


@kernel
def query_rows(query, out):
    """out [H, M, d] = the step's query [1, H * G, Q, d] in fp32 (bf16 bits widened), folded as the eager
    step folds it: row m = j * Q + i is query head j of the KV head's G at position i (M = G * Q)."""
    heads, rows, d = out.shape
    positions = query.shape[2]
    group = rows // positions
    for h in range(heads):
        for m in range(rows):
            src, dst = query[0, h * group + m // positions, m % positions], out[h, m]
            for i in range(d):
                dst[i] = as_f32(src[i])


@inline
def _project_queries(q, cos_q, sin_q, undo, ccos, csin, blocks, lead, scaling, q8, qscale, qfull, d):
    heads, rows = q.shape[0], q.shape[1]
    positions, chunks, full = cos_q.shape[0], ccos.shape[0], qfull.shape[1]
    half = d // 2
    x = np.empty(d, np.float32)
    y = np.empty(d, np.float32)
    coef = np.empty(blocks.shape[1], np.float32)
    for h in range(heads):
        for m in range(rows):
            r, src = h * rows + m, q[h, m]
            if undo:  # (x cos - rotate_half(x) sin) / (cos^2 + sin^2), each half in its own loop
                cq, sq = cos_q[m % positions], sin_q[m % positions]
                for i in range(half):
                    c, s = cq[i], sq[i]
                    x[i] = (src[i] * c + src[half + i] * s) / (c * c + s * s)
                for i in range(half):
                    c, s = cq[half + i], sq[half + i]
                    x[half + i] = (src[half + i] * c - src[i] * s) / (c * c + s * s)
            else:
                for i in range(d):
                    x[i] = src[i]
            for ch in range(chunks):
                cc, cs = ccos[ch], csin[ch]
                for i in range(half):
                    y[i] = x[i] * cc[i] - x[half + i] * cs[i]
                for i in range(half):
                    y[half + i] = x[half + i] * cc[half + i] + x[i] * cs[half + i]
                # the int8 lead columns, and every band only where qfull keeps them: one dot of d a column
                cols = max(lead, full) if ch == chunks - 1 else lead
                for j in range(cols):
                    column = blocks[h, j]
                    acc = np.float32(0.0)
                    for i in range(d):
                        acc += y[i] * column[i]
                    coef[j] = acc
                amax = np.float32(0.0)
                for j in range(lead):
                    amax = max(amax, abs(coef[j]))
                scale = max(amax, np.float32(1e-30)) / np.float32(127.0)
                for j in range(lead):
                    q8[ch, r, j] = np.int8(np.rint(coef[j] / scale))
                qscale[ch, r] = scale * np.float32(scaling)
                if ch == chunks - 1:
                    for j in range(full):
                        qfull[r, j] = coef[j]


@kernel
def project_queries(q, cos_q, sin_q, undo, ccos, csin, blocks, lead, scaling, q8, qscale, qfull):
    """q [H, M, d] fp32 query rows -> per chunk c: int8 lead coefficients q8 [C, R, lead] and their
    scales times `scaling` qscale [C, R]; the last chunk's fp32 coefficients qfull [R, F] (F = rk where
    post-RoPE keys take their lower bands' logits from them, 0 where pre-RoPE keys are rebuilt instead).
    `undo`: un-rotate from the query's own angles first (cos_q, sin_q [Q, d]: row m's position is m % Q, as
    `query_rows` folds Q positions); ccos/csin [C, d]: each chunk's rotation (cos 1, sin 0 for none).
    blocks [H, rk, d]: each KV head's block of the key basis, transposed (a column's d rows contiguous)."""
    d = q.shape[2]
    # the common head sizes get loops of a known trip count, which LLVM vectorizes whole
    if d == 64:
        _project_queries(q, cos_q, sin_q, undo, ccos, csin, blocks, lead, scaling, q8, qscale, qfull, 64)
    elif d == 128:
        _project_queries(q, cos_q, sin_q, undo, ccos, csin, blocks, lead, scaling, q8, qscale, qfull, 128)
    else:
        _project_queries(q, cos_q, sin_q, undo, ccos, csin, blocks, lead, scaling, q8, qscale, qfull, d)


@kernel
def exact_logits(q, ek, e, scaling, out):
    """Logits out[r, t] (r = h * M + m) of the query rows q [H, M, d] on the exact tokens ek [H, >=e, d]."""
    heads, rows, d = q.shape
    for h in range(heads):
        for t in range(e):
            for m in range(rows):
                acc = np.float32(0.0)
                for i in range(d):
                    acc += q[h, m, i] * as_f32(ek[h, t, i])
                out[h * rows + m, t] = acc * np.float32(scaling)


@inline
def _four_columns(qf, r0, r1, r2, j, band, last, w, a0, a1, a2):
    """a0..a2[t] += query rows r0..r2's columns j..j+3 of qf dotted with the band's rows j..j+3 at token t
    (rows past `last` read row `last`, which their zero query columns cancel): each band row is widened
    once for the three rows, and every sum of integer products is exact in fp32 (it stays under 2^24)."""
    b0, b1, b2, b3 = band[j], band[min(j + 1, last)], band[min(j + 2, last)], band[min(j + 3, last)]
    x0, x1, x2, x3 = qf[r0, j], qf[r0, j + 1], qf[r0, j + 2], qf[r0, j + 3]
    y0, y1, y2, y3 = qf[r1, j], qf[r1, j + 1], qf[r1, j + 2], qf[r1, j + 3]
    z0, z1, z2, z3 = qf[r2, j], qf[r2, j + 1], qf[r2, j + 2], qf[r2, j + 3]
    for t in range(w):
        c0, c1 = np.float32(b0[t]), np.float32(b1[t])
        c2, c3 = np.float32(b2[t]), np.float32(b3[t])
        a0[t] += x0 * c0 + x1 * c1 + x2 * c2 + x3 * c3
        a1[t] += y0 * c0 + y1 * c1 + y2 * c2 + y3 * c3
        a2[t] += z0 * c0 + z1 * c1 + z2 * c2 + z3 * c3


@inline
def _latent_range(q8, qscale, bounds, ck, sk, first_t, last_t, rows, logits, off):
    """`latent_logits` of the tokens first_t <= t < last_t."""
    chunks, nrows, lead = q8.shape[0], q8.shape[1], q8.shape[2]
    groups = ck.shape[0]
    padded = -(-lead // 4) * 4
    qf = np.zeros((nrows, padded), np.float32)  # the codes as floats, columns past lead zero
    acc = np.empty((3, TILE), np.float32)
    per = nrows if groups == 1 else rows
    for c in range(chunks):
        lo, hi = max(bounds[c], first_t), min(bounds[c + 1], last_t)
        if lo >= hi:
            continue
        for r in range(nrows):
            for j in range(lead):
                qf[r, j] = np.float32(q8[c, r, j])
        for t0 in range(lo, hi, TILE):
            t1 = min(t0 + TILE, hi)
            w = t1 - t0
            for g in range(groups):
                band = ck[g, :, t0:t1]
                first = 0 if groups == 1 else g * rows
                for rb in range(0, per, 3):
                    r0, r1, r2 = first + rb, first + min(rb + 1, per - 1), first + min(rb + 2, per - 1)
                    a0, a1, a2 = acc[0, :w], acc[1, :w], acc[2, :w]
                    for t in range(w):
                        a0[t] = 0.0
                        a1[t] = 0.0
                        a2[t] = 0.0
                    for j in range(0, padded, 4):
                        _four_columns(qf, r0, r1, r2, j, band, lead - 1, w, a0, a1, a2)
                    for i in range(3):
                        r = (r0, r1, r2)[i]
                        s, a = qscale[c, r], acc[i]
                        dst, scales = logits[r, off + t0 : off + t1], sk[g, t0:t1]
                        for t in range(w):
                            dst[t] = (a[t] * s) * as_f32(scales[t])


@split_kernel
def latent_logits(q8, qscale, bounds, ck, sk, n, rows, logits, off, parts):
    """Logits logits[r, off + t] of every stored token t < n from the int8 lead band ck [G, lead, >=n]
    (scales sk [G, >=n]): integer dot products with chunk c's query codes for bounds[c] <= t < bounds[c+1].
    G = 1 (one layer basis) or one group per KV head (query row r belongs to head r // rows).
    Three query rows at a time over four band rows at a time (a group's last row repeated where its rows
    run out), the token loop innermost: a band row is read once for three query rows. The tokens split
    into `parts` runs of whole tiles, one a thread (`split_kernel`)."""
    span = -(-n // (parts * TILE)) * TILE
    for p in prange(parts):
        _latent_range(q8, qscale, bounds, ck, sk, p * span, min(n, (p + 1) * span), rows, logits, off)


@inline
def _normalise_row(lr, er, n, sinks, n_out, e, out_idx, cand, keep, lanes, rowmax, rowsum, candsum, r):
    """`normaliser` of one query row: its logits lr [n], its exact ones er."""
    for i in range(n_out):
        lr[out_idx[i]] = er[sinks + i]
    m = largest(lr, n, lanes)
    for t in range(sinks):
        m = max(m, er[t])
    for t in range(sinks + n_out, e):
        m = max(m, er[t])
    part = np.float32(0.0)
    total = np.float32(0.0)
    for t in range(cand):
        p = fast_exp(lr[t] - m)
        total += p
        part += p * keep[t]
    for t in range(cand, n):
        total += fast_exp(lr[t] - m)
    for t in range(sinks):
        total += fast_exp(er[t] - m)
    for t in range(sinks + n_out, e):
        total += fast_exp(er[t] - m)
    rowmax[r], rowsum[r], candsum[r] = m, total, part


@split_kernel
def normaliser(logits, off, n, el, sinks, n_out, e, out_idx, cand, rowmax, rowsum, candsum, keep, parts):
    """Per query row: the outliers' latent logits replaced by their exact ones (el[:, sinks + i]), then
    the max and the sum of exp(logit - max) over the stored tokens and the other exact tokens (sinks,
    buffer), and the same sum over the stored candidates t < cand that are not outliers; the rows split
    into `parts` runs, one a thread. keep: >= n float32 scratch (1 for a candidate, 0 for an outlier)."""
    nrows = logits.shape[0]
    for t in range(n):
        keep[t] = 1.0
    for i in range(n_out):
        keep[out_idx[i]] = 0.0
    span = -(-nrows // parts)
    for p in prange(parts):
        lanes = np.empty(LANES, np.float32)
        for r in range(p * span, min(nrows, (p + 1) * span)):
            _normalise_row(logits[r, off : off + n], el[r], n, sinks, n_out, e, out_idx, cand, keep, lanes,
                           rowmax, rowsum, candsum, r)


@kernel
def pooled_relevance(logits, off, n, lse, pool, out_idx, n_out, work, scores):
    """scores[off + t]: the largest over query rows of logit - lse (log relevance), max-pooled over
    `pool` neighbouring tokens (odd), outliers -inf (attended exactly already). work: >= n + pool floats."""
    nrows = logits.shape[0]
    pad = pool // 2
    for t in range(pad):
        work[t] = -np.inf
        work[pad + n + t] = -np.inf
    inner, first = work[pad : pad + n], logits[0, off : off + n]
    for t in range(n):
        inner[t] = first[t] - lse[0]
    for r in range(1, nrows):
        lr, row = lse[r], logits[r, off : off + n]
        for t in range(n):
            inner[t] = max(inner[t], row[t] - lr)
    dst = scores[off : off + n]
    for t in range(n):
        dst[t] = work[t]
    for j in range(1, pool):  # one shifted maximum at a time: the token loop vectorizes
        shifted = work[j : j + n]
        for t in range(n):
            dst[t] = max(dst[t], shifted[t])
    for i in range(n_out):
        scores[off + out_idx[i]] = -np.inf


@kernel
def combine_normalisers(rowmax, rowsum, candsum, lse, candmass):
    """lse[r] from each segment's (max, sum of exp(logit - max)) rows [S, R], and each row's probability
    mass on the candidates of every segment (candsum: their sums of exp(logit - max))."""
    segs, nrows = rowmax.shape
    for r in range(nrows):
        m = np.float32(-np.inf)
        for s in range(segs):
            m = max(m, rowmax[s, r])
        total = np.float32(0.0)
        for s in range(segs):
            total += rowsum[s, r] * fast_exp(rowmax[s, r] - m)
        lse[r] = m + np.float32(math.log(total))
        mass = np.float32(0.0)
        for s in range(segs):
            mass += candsum[s, r] * fast_exp(rowmax[s, r] - lse[r])
        candmass[r] = mass
