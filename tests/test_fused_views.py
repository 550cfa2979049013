"""What the fused decode step keeps on a layer between steps (`s4r.kernels.s4r_step._Views`): rebuilt when
the layer's storage changes, never carried into a copy of the layer."""

from __future__ import annotations

import copy

import pytest
import torch

from s4r.core.compress import compress_layer
from tests.test_fused_kernels import CONFIGS, D, kv_data, rope_for, step_both

pytest.importorskip("numba")


def _step(layer, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = torch.randn(1, 2, 1, D, generator=g)
    query = torch.randn(1, 4, 1, D, generator=g)
    layer.update(new, new)
    return layer.attend(query, None, None, D ** -0.5)


@pytest.mark.parametrize("name", ["pre-rope-int8-rebuild", "post-rope"])
def test_a_copy_of_a_stepped_layer_steps_as_the_layer(name):
    """A deep copy's storage tensors are new objects: the views the original kept (numpy views of its
    tensors, which a copy would turn into frozen arrays) must not serve the copy."""
    keys, values, queries = kv_data(2, 4, 300, torch.float32)
    layer = compress_layer(keys, values, queries, CONFIGS[name], 24, 24, rope_for(4, 2))
    step_both(layer, 4, 2, torch.float32)  # the fused path has run: the layer keeps its views
    twin = copy.deepcopy(layer)
    for seed in (5, 6, 7):
        torch.testing.assert_close(_step(twin, seed), _step(layer, seed), rtol=0, atol=0)


def test_the_kept_angle_tables_grow_with_the_positions():
    """The angle tables a layer's views keep cover every position asked, regrown past their end."""
    from s4r.core.rope import ANGLE_STEP
    from s4r.kernels.s4r_step import _views

    keys, values, queries = kv_data(2, 4, 300, torch.float32)
    layer = compress_layer(keys, values, queries, CONFIGS["pre-rope-int8-rebuild"], 24, 24, rope_for(4, 2))
    views = _views(layer)
    coarse, fine = views.angle_parts(300)
    assert coarse.shape[0] * ANGLE_STEP > 300 and fine.shape[0] == ANGLE_STEP
    far = 50 * coarse.shape[0] * ANGLE_STEP
    coarse, _ = views.angle_parts(far)
    assert coarse.shape[0] * ANGLE_STEP > far
