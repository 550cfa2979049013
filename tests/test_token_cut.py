"""`choose_tokens` over many candidates, where the cut is bracketed through a sample of the scores first
(`s4r.kernels.token_selection._sampled_cut`): the same tokens as the ranked selection, ties by index, also
where the sample misleads the bracket and every score is cut."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_fused_kernels import reference_choice

pytest.importorskip("numba")


def _choose(scores, k, k_max, forced, drop, budget, logits, lse, candmass):
    from s4r.kernels.token_selection import choose_tokens

    n = scores.shape[0]
    picked = np.full(n, -1, np.int64)
    work = np.zeros(2 * n, np.float32)
    count = choose_tokens(scores, n, k, k_max, forced, np.float32(drop), budget, logits, lse, candmass, work,
                          picked)
    return picked[:count].tolist()


def _inputs(rng, n, rows=3):
    logits = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(1)).astype(np.float32)
    return logits, lse


@pytest.mark.parametrize("seed", range(4))
def test_a_sampled_cut_is_the_ranked_selection(seed):
    """Pooled-looking scores (runs of equal values, some -inf) over 4k-40k candidates, cuts from a handful
    of tokens to nearly all of them, with and without the adaptive budget."""
    from s4r.kernels.token_selection import SAMPLED

    rng = np.random.default_rng(seed)
    n = int(rng.integers(SAMPLED, 40_000))
    logits, lse = _inputs(rng, n)
    raw = logits.max(0) - lse.max()
    scores = np.maximum(raw, np.roll(raw, 1)).astype(np.float32)  # max pooling: runs of equal scores
    if seed % 2:
        scores = np.round(scores * 2) / 2  # many ties
    scores[rng.choice(n, 40, replace=False)] = -np.inf
    forced = int(rng.integers(0, 64))
    candmass = np.exp(logits[:, : n - forced] - lse[:, None]).sum(1).astype(np.float32)
    for k in (1, 37, n // 20, n // 2, n - forced - 1):
        k_max = min(n, k + n // 50)
        for budget in (False, True):
            want = reference_choice(scores, k, k_max, forced, 0.05, budget, logits, lse, candmass)
            assert _choose(scores, k, k_max, forced, 0.05, budget, logits, lse, candmass) == want


def test_a_sample_that_misses_the_cut_falls_back_to_cutting_every_score():
    """The sample reads every 8th score; those are all low while the rest are high, so the bracket the
    sample gives holds none of the cut and every score is cut instead: still the ranked selection."""
    rng = np.random.default_rng(5)
    n = 8192
    logits, lse = _inputs(rng, n)
    scores = (rng.standard_normal(n) + 10).astype(np.float32)
    scores[::8] = rng.standard_normal(n // 8).astype(np.float32) - 10
    candmass = np.exp(logits - lse[:, None]).sum(1).astype(np.float32)
    for k in (100, 3000, 7000):
        want = reference_choice(scores, k, k, 0, 0.05, False, logits, lse, candmass)
        assert _choose(scores, k, k, 0, 0.05, False, logits, lse, candmass) == want
