"""`jit.fast_exp`, the exponential every fused softmax takes: exp within 5e-6 (relative) where it counts, and
exactly 0 for the weights of masked or negligible tokens, whose products would otherwise be slow denormals."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from s4r.kernels.jit import fast_exp, kernel  # noqa: E402


@kernel
def _exps(x, out):
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])


def test_fast_exp_is_exp_above_minus_80_and_zero_below():
    tail = [-80.0, -80.5, -87.0, -500.0, -np.inf]
    x = np.concatenate([np.linspace(-79.9, 0.0, 20001), tail]).astype(np.float32)
    out = np.empty_like(x)
    _exps(x, out)
    kept = x > -80.0
    exact = np.exp(x[kept].astype(np.float64))
    assert (np.abs(out[kept] - exact) <= 5e-6 * exact).all()
    assert (out[~kept] == 0.0).all()
    assert (out[kept] >= np.finfo(np.float32).tiny).all()  # never a denormal
