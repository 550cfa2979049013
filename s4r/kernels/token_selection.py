"""Which stored tokens a decode step rebuilds, fused (numba, CPU): a partial top-k by selection (no full
sort), the adaptive count of `recon_drop`, and the forced local window.

Reference: `LatentSelection.choose_tokens` with `s4r.core.selection.select_tokens`, `ranked_candidates`
and `mass_budget`. Scores here are log relevance (`latent_scoring.pooled_relevance`), which rank the
tokens as the reference's probabilities do; among equal scores (max pooling makes runs of them) the
lower index wins, where the reference's order is unspecified.
"""

from __future__ import annotations

import numpy as np

from s4r.kernels.jit import fast_exp, kernel


@kernel
def _kth_largest(vals, count, kth):
    """The kth largest (0-based) of vals[:count], reordering vals in place (quickselect)."""
    lo, hi = 0, count - 1
    while lo < hi:
        mid = (lo + hi) // 2
        a, b, c = vals[lo], vals[mid], vals[hi]
        pivot = max(min(a, b), min(max(a, b), c))  # median of three
        i, j = lo, hi
        while i <= j:
            while vals[i] > pivot:
                i += 1
            while vals[j] < pivot:
                j -= 1
            if i <= j:
                vals[i], vals[j] = vals[j], vals[i]
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            return vals[kth]
    return vals[kth]


@kernel
def choose_tokens(scores, total_n, k, k_max, forced, drop, budget, logits, lse, candmass, work, picked):
    """The stored tokens (indices into `scores` [total_n]) a step rebuilds, written to picked; returns
    their count. Without `budget` (or k_max <= k): the top k of the candidates (all but the last
    `forced`), then the forced tail. With it: the top k_max ranked best first, of which the smallest
    prefix, clamped to [k, k_max], that leaves no query row more than `drop` of its attention outside
    (row r's probabilities exp(logits[r, t] - lse[r]); candmass[r]: its mass on every candidate that is
    not an outlier); then the forced tail. work: >= total_n float32 scratch."""
    forced = min(forced, total_n)
    cand = total_n - forced
    use_budget = budget and k_max > k
    want = min(k_max if use_budget else k, cand)
    count = 0
    if want > 0:
        for t in range(cand):
            work[t] = scores[t]
        threshold = _kth_largest(work, cand, want - 1)
        ties = want
        for t in range(cand):
            if scores[t] > threshold:
                ties -= 1
        for t in range(cand):
            s = scores[t]
            if s > threshold or (s == threshold and ties > 0):
                if s == threshold:
                    ties -= 1
                picked[count] = t
                count += 1
        if use_budget:
            order = np.argsort(-scores[picked[:count]], kind="mergesort")  # best first, ties by index
            ranked = picked[:count][order]
            picked[:count] = ranked
            need = 0
            for r in range(logits.shape[0]):
                kept = np.float32(0.0)
                left = 0
                for j in range(count):
                    kept += fast_exp(logits[r, picked[j]] - lse[r])
                    if candmass[r] - kept > drop:
                        left += 1
                need = max(need, left + 1)
            count = min(max(need, min(k, count)), count)
    for t in range(cand, total_n):
        picked[count] = t
        count += 1
    return count
