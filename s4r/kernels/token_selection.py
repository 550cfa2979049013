"""Which stored tokens a decode step rebuilds, fused (numba, CPU): a partial top-k by selection (no full
sort; over many candidates the cut is first bracketed through a sample of the scores), the adaptive count
of `recon_drop`, and the forced local window.

Reference: `LatentSelection.choose_tokens` with `s4r.core.selection.select_tokens`, `ranked_candidates`
and `mass_budget`. Scores here are log relevance (`latent_scoring.pooled_relevance`), which rank the
tokens as the reference's probabilities do; among equal scores (max pooling makes runs of them) the
lower index wins, where the reference's order is unspecified.
"""

from __future__ import annotations

import math

import numpy as np

from s4r.kernels.jit import f32_as_u32, fast_exp, inline, kernel


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


@inline
def _rank_best_first(scores, picked, count, work):
    """picked[:count] reordered by descending score, ties by ascending index, as one sort of 64-bit keys
    (the score's bits made to order as unsigned integers, inverted, above the index). work: >= 2 * count
    float32 scratch, reused as the keys' storage."""
    keys = work[: 2 * count].view(np.uint64)
    sign = np.uint32(0x80000000)
    for j in range(count):
        bits = f32_as_u32(scores[picked[j]])
        ordered = ~bits if bits & sign else bits | sign  # ascending with the float
        keys[j] = (np.uint64(~ordered) << np.uint64(32)) | np.uint64(picked[j])
    keys.sort()
    for j in range(count):
        picked[j] = np.int64(keys[j] & np.uint64(0xFFFFFFFF))


@inline
def _budget_count(logits, lse, candmass, picked, front, count, drop, kept_all):
    """The shortest prefix of picked[:count] that leaves no query row more than `drop` of its candidate
    mass candmass[r] outside, plus one, at least `front`: picked[:front] are the best `front` in any order,
    the rest ranked best first; kept_all[r]: row r's mass on all of picked[:count]. A row's mass on the
    longest prefix so far is kept_all less the tokens after it; a row that needs more scans on from there
    to the first prefix that holds enough."""
    need = front
    for r in range(logits.shape[0]):
        if need > count:
            break
        row, top, mass = logits[r], lse[r], np.float64(candmass[r])
        # float64: the count agrees with an exact sum where float32 sums in another order did not
        kept = kept_all[r]
        for j in range(need, count):
            kept -= fast_exp(row[picked[j]] - top)
        if not mass - kept > drop:
            continue
        left = count
        for j in range(need, count):
            kept += fast_exp(row[picked[j]] - top)
            if not mass - kept > drop:
                left = j
                break
        need = max(need, left + 1)
    return need


@inline
def _cut(vals, count, want):
    """(threshold, ties) of the best `want` of vals[:count] (reordered): the want-th largest value, and how
    many values equal to it are among the best (those met first, the lower indices, as `_among_best` takes
    them)."""
    threshold = _kth_largest(vals, count, want - 1)
    ties = want
    for j in range(count):
        if vals[j] > threshold:
            ties -= 1
    return threshold, ties


SAMPLED = 4096  # candidates from which the cut is bracketed through a sample first (`_sampled_cut`)
SAMPLE = 1024  # scores in that sample


@inline
def _sampled_cut(scores, count, want, work):
    """`_cut` of scores[:count] (not reordered) for want < count, Floyd-Rivest style: two values of an even
    sample of SAMPLE scores bracket the want-th largest with a wide margin, one pass counts the scores above
    the bracket and gathers those inside it into work[:count], and the selection runs on those alone.
    (threshold, ties, found); found False where the bracket missed (then the caller cuts every score).
    work: >= count + SAMPLE float32 scratch."""
    sample = work[count : count + SAMPLE]
    for i in range(SAMPLE):
        sample[i] = scores[(i * count) // SAMPLE]
    rank = want * SAMPLE / count  # the cut's expected rank in the sample, from the top
    margin = 3.0 * math.sqrt(rank * (1.0 - want / count)) + 4.0
    hi, lo = int(rank - margin), int(math.ceil(rank + margin))
    upper = _kth_largest(sample, SAMPLE, hi - 1) if hi >= 1 else np.float32(np.inf)
    lower = _kth_largest(sample, SAMPLE, lo - 1) if lo <= SAMPLE else np.float32(-np.inf)
    above = 0
    inside = 0
    for t in range(count):
        v = scores[t]
        if v > upper:
            above += 1
        elif v >= lower:
            work[inside] = v
            inside += 1
    if not above < want <= above + inside:
        return np.float32(0.0), 0, False
    threshold, ties = _cut(work, inside, want - above)  # every score above the bracket is above the cut
    return threshold, ties, True


@inline
def _among_best(s, threshold, ties):
    """(whether a score s met in index order is among the best that `_cut` bounds, the ties left)."""
    if s > threshold:
        return True, ties
    if s == threshold and ties > 0:
        return True, ties - 1
    return False, ties


@inline
def _best_to_front(scores, picked, count, front, work):
    """picked[:count] (ascending) reordered so that its best `front` (by score, ties by lower index) come
    first in ascending order and the rest after them, also ascending. work: >= 2 * count float32 scratch."""
    vals = work[:count]
    for j in range(count):
        vals[j] = scores[picked[j]]
    threshold, ties = _cut(vals, count, front)
    rest = work[: 2 * count].view(np.int64)
    f = 0
    b = 0
    for j in range(count):
        t = picked[j]
        best, ties = _among_best(scores[t], threshold, ties)
        if best:
            picked[f] = t
            f += 1
        else:
            rest[b] = t
            b += 1
    for j in range(b):
        picked[front + j] = rest[j]


@inline
def _outgrows(logits, lse, candmass, picked, count, drop, kept_all):
    """Whether some query row leaves more than `drop` of its candidate mass outside all of picked[:count]:
    then the budget keeps every one of them (the cap binds) and ranking them would change nothing.
    Writes each row's mass on picked[:count] to kept_all (float64)."""
    for r in range(logits.shape[0]):
        row, top = logits[r], lse[r]
        kept = 0.0
        for j in range(count):
            kept += fast_exp(row[picked[j]] - top)
        kept_all[r] = kept
        if np.float64(candmass[r]) - kept > drop:
            return True
    return False


@inline
def _index_order(picked, count, cand, work):
    """picked[:count] (distinct, each < cand) in ascending order, by marking them in work[:cand] and one
    sweep: the rebuild then reads the stored bands front to back."""
    for t in range(cand):
        work[t] = 0.0
    for j in range(count):
        work[picked[j]] = 1.0
    c = 0
    for t in range(cand):
        if work[t] != 0.0:
            picked[c] = t
            c += 1


@kernel
def choose_tokens(scores, total_n, k, k_max, forced, drop, budget, logits, lse, candmass, work, picked):
    """The stored tokens (indices into `scores` [total_n]) a step rebuilds, written to picked in
    ascending order; returns their count. Without `budget` (or k_max <= k): the top k of the candidates
    (all but the last `forced`), then the forced tail. With it: of the top k_max ranked best first, the
    smallest prefix, clamped to [k, k_max], that leaves no query row more than `drop` of its attention
    outside (row r's probabilities exp(logits[r, t] - lse[r]); candmass[r]: its mass on every candidate
    that is not an outlier); then the forced tail. work: >= 2 * total_n float32 scratch."""
    forced = min(forced, total_n)
    cand = total_n - forced
    use_budget = budget and k_max > k
    want = min(k_max if use_budget else k, cand)
    count = 0
    if want > 0:
        found = False
        if cand >= SAMPLED and want < cand:
            threshold, ties, found = _sampled_cut(scores, cand, want, work)
        if not found:
            for t in range(cand):
                work[t] = scores[t]
            threshold, ties = _cut(work, cand, want)
        for t in range(cand):
            best, ties = _among_best(scores[t], threshold, ties)
            if best:
                picked[count] = t
                count += 1
        front = min(k, count)  # the budget keeps at least these: only the rest needs ranking
        if use_budget and front < count:
            kept_all = np.empty(logits.shape[0], np.float64)  # each row's mass on picked[:count]
            if not _outgrows(logits, lse, candmass, picked, count, drop, kept_all):
                if front:
                    _best_to_front(scores, picked, count, front, work)
                _rank_best_first(scores, picked[front:], count - front, work)
                count = min(_budget_count(logits, lse, candmass, picked, front, count, drop, kept_all), count)
                _index_order(picked, count, cand, work)
    for t in range(cand, total_n):
        picked[count] = t
        count += 1
    return count
