"""The fused step's largest kernels split over threads (`s4r.kernels.jit.split_kernel`, `parts`): the same
step as the eager one, and one part (one torch thread) never starting numba's threads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")

from s4r.core.compress import compress_layer  # noqa: E402
from s4r.kernels import jit  # noqa: E402
from tests.test_fused_kernels import CONFIGS, kv_data, rope_for, selected_sets, step_both  # noqa: E402


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_step_split_over_threads_is_the_eager_step(name, monkeypatch):
    """The largest kernels' work split into three runs, as over three threads (every size split here)."""
    from s4r.kernels import s4r_step

    monkeypatch.setattr(s4r_step, "SPLIT_SCORED", 1)
    monkeypatch.setattr(s4r_step, "SPLIT_SELECTED", 1)
    monkeypatch.setattr(jit, "parts", lambda: 3)
    cfg = CONFIGS[name]
    keys, values, queries = kv_data(3, 9, 700, torch.float32)
    layer = compress_layer(keys, values, queries, cfg, cfg.rank_k, cfg.rank_v, rope_for(9, 3))
    fused, eager, twin = step_both(layer, 9, 3, torch.float32)
    assert selected_sets(layer) == selected_sets(twin)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)


def test_one_torch_thread_is_one_part_and_loads_no_threading_layer(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(jit, "_state", {"warned": False, "failed": False})
    assert jit.parts() == 1
    assert "layer" not in jit._state  # numba's threads were never asked for


def test_parts_follow_torch_threads_where_numba_runs_openmp(monkeypatch):
    import numba

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    parts = jit.parts()
    openmp = jit._state["layer"] == "omp" and numba.config.NUMBA_NUM_THREADS >= 2
    assert parts == (2 if openmp else 1)
    if openmp:
        assert numba.get_num_threads() == 2
        numba.set_num_threads(1)  # the rest of the run on one thread, as OMP_NUM_THREADS asks
