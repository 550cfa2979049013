"""The fused scoring's softmax normaliser (`s4r.kernels.latent_scoring.normaliser`) against its definition:
its row maximum is taken over blocks of running maxima, so the largest logit is put on every position
that the blocks and their remainder split differently."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_normaliser_is_the_row_max_and_sums(n, parts):
    """Row maximum exact, row and candidate sums within fp32 rounding, the peak at every position; the
    rows in one run or split into runs (one empty at 3)."""
    from s4r.kernels.latent_scoring import normaliser

    rng = np.random.default_rng(n)
    nrows, off, sinks, buffered = 2, 3, 2, 3
    out_idx = np.array([n // 2], np.int32)
    e = sinks + len(out_idx) + buffered
    cand = max(n - 1, 0)
    for peak in range(n):
        logits = rng.standard_normal((nrows, off + n)).astype(np.float32)
        logits[:, off + peak] = 9.0
        el = rng.standard_normal((nrows, e)).astype(np.float32)
        rowmax, rowsum, candsum = (np.zeros(nrows, np.float32) for _ in range(3))
        stored = logits[:, off:].copy()
        normaliser(logits, off, n, el, sinks, len(out_idx), e, out_idx, cand, rowmax, rowsum, candsum,
                   np.zeros(n, np.float32), parts)
        stored[:, out_idx] = el[:, sinks : sinks + len(out_idx)]
        exact = np.concatenate([el[:, :sinks], el[:, sinks + len(out_idx) :]], axis=1)
        every = np.concatenate([stored, exact], axis=1).astype(np.float64)
        want_max = every.max(axis=1)
        np.testing.assert_array_equal(rowmax, want_max.astype(np.float32))
        np.testing.assert_allclose(rowsum, np.exp(every - want_max[:, None]).sum(axis=1), rtol=1e-5)
        keep = np.ones(n, bool)
        keep[out_idx] = False
        keep[cand:] = False
        want_cand = np.exp(stored[:, keep].astype(np.float64) - want_max[:, None]).sum(axis=1)
        np.testing.assert_allclose(candsum, want_cand, rtol=1e-5)
