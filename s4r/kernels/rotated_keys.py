"""The rebuilt pre-RoPE keys' logits (numba, CPU): each selected key turned to its position by angles composed
from `rope.angle_parts`' two small tables and dotted with the query rows while in cache.

Reference: `LatentSelection._rebuilt_key_logits`; `s4r.kernels.vnni_keys` does the same from the int8
product's sums on AVX512-VNNI.
"""

from __future__ import annotations

from s4r.kernels.jit import kernel, rotated_logits


@kernel
def rotated_key_logits(q, keys, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out):
    """Logits out[r, j] of the query rows q [H, M, d] on the rebuilt pre-RoPE keys keys [B, >=k, W] of
    the tokens idx[:k] (B = 1: one layer basis, head h's key at columns h*d..; B = H: per head), each
    rotated to its position p = idx[j] + pos0 by angles composed from `rope.angle_parts`' rows coarse
    [p >> s] and fine [p & (2^s - 1)] (cos of the d/2 pairs, then sin; 2^s fine rows).
    Keys of an int8 product come as int32 sums: column c of basis group b is scaled by col_scale[b, c]
    and token j's logits by row_scale[b, j]; other keys pass empty scales."""
    half = q.shape[2] // 2
    # the common head sizes get loops of a known trip count, which LLVM vectorizes whole (the same loops
    # with the count known only at run time ran slower)
    if half == 32:
        rotated_logits(q, keys, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out, 32)
    elif half == 64:
        rotated_logits(q, keys, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out, 64)
    else:
        rotated_logits(q, keys, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out, half)
