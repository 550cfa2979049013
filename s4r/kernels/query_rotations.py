"""The rotations a fused step (`s4r.kernels.s4r_step`) gives its queries where keys are stored before RoPE:
each query's own rotation to undo, and per chunk of stored tokens the rotation scoring takes (as the eager
step's `LowRankLayer._window_logits`), as numpy tables kept once per step on the shared rotary embedding.
"""

from __future__ import annotations

import numpy as np
import torch

from s4r.core.rope import chunk_rotations, last_answer


def query_rotations(layer, v, n: int, d: int, positions: int) -> tuple:
    """(undo, cos_q, sin_q [Q, d], chunk cos [C, d], chunk sin [C, d], bounds [C + 1]) of a fused step's
    `positions` (Q) queries over the layer's n stored tokens (v: the layer's views in `s4r_step`); the
    chunks' rotations are taken from the last query, as the eager step's."""
    if not v.pre_rope:  # no rotation: the same arrays serve every step until the stored count changes
        kept = getattr(v, "identity_rotations", None)
        if kept is None or kept[0] != (n, d):
            ones, zeros = np.ones((1, d), np.float32), np.zeros((1, d), np.float32)
            bounds = np.array([0, n], np.int64)
            kept = v.identity_rotations = ((n, d), (False, ones, zeros, ones, zeros, bounds))
        return kept[1]
    end = layer.logical if layer.query_end is None else layer.query_end
    expected, chunk = v.expected, v.chunk or n

    def compute() -> tuple:
        cos_q, sin_q = layer._query_angles(end, positions, torch.device("cpu"))
        cos_q, sin_q = cos_q.float().contiguous().numpy(), sin_q.float().contiguous().numpy()
        rotations = chunk_rotations(layer.rope, n, chunk, end - 1 - layer.sinks) if expected else None
        if rotations is None:
            return (True, cos_q, sin_q, np.ones((1, d), np.float32), np.zeros((1, d), np.float32),
                    np.array([0, n], dtype=np.int64))
        bounds, cos, sin = rotations
        return True, cos_q, sin_q, cos.numpy(), sin.numpy(), np.asarray(bounds, dtype=np.int64)

    # every layer of a step asks the same: the numpy tables are kept once on the shared rope (the step's
    # views hold pre-RoPE layers with static frequencies only)
    key = (end, n, d, chunk, expected, layer.sinks, v.dtype, positions)
    return last_answer(layer.rope, "fused_rotation_memo", key, compute)
