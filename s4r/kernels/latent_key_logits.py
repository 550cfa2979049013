"""The selected tokens' logits on post-RoPE keys (`s4r-fast`), fused (numba, CPU): their lead-band logits
from the scoring plus the lower bands' share, the query rows held as the lanes of one vector.

Reference: `LatentSelection.selected_logits` (latent logits plus `PlanarTail.logits`). A token's lower bands
are decoded once and each of their values multiplies every query row of its basis group at once: one
vector multiply-add per value and 16 rows, four sums side by side so no add waits on the one before. Dotting
each row with the token separately ends every dot in a sum across lanes and chains its adds, which ran at
about half this speed.
"""

from __future__ import annotations

import numpy as np

from s4r.kernels.jit import kernel, numba
from s4r.kernels.sparse_attention import decode_tail

LANES = 16  # query rows a vector holds (fp32)
CHAINS = 4  # sums kept side by side: a multiply-add's latency is about four of its issue slots

if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from s4r.kernels.jit import ir_at, ir_loop, ir_splat

    def _lane_dots_codegen(context, builder, signature, args):
        rows, values, steps, out = args
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vf = ir.VectorType(f32, LANES)
        fast = ("fast",)

        def step(i, sums):
            new = []
            for c in range(CHAINS):
                col = builder.add(builder.mul(i, ir.Constant(i64, CHAINS)), ir.Constant(i64, c))
                value = builder.load(ir_at(builder, values, builder.mul(col, ir.Constant(i64, 4)), f32))
                row = builder.load(ir_at(builder, rows, builder.mul(col, ir.Constant(i64, 4 * LANES)), vf),
                                   align=4)
                product = builder.fmul(row, ir_splat(builder, value, vf), flags=fast)
                new.append(builder.fadd(sums[c], product, flags=fast))
            return new

        sums = ir_loop(builder, steps, [ir.Constant(vf, [0.0] * LANES)] * CHAINS, step)
        total = sums[0]
        for c in range(1, CHAINS):
            total = builder.fadd(total, sums[c], flags=fast)
        builder.store(total, ir_at(builder, out, ir.Constant(i64, 0), vf), align=4)
        return context.get_dummy_value()

    @intrinsic
    def _lane_dots(typingctx, rows, values, steps, out):
        """out[l] = sum over c < CHAINS * steps of values[c] * rows[c, l], l < LANES (rows fp32 [., LANES],
        values and out fp32; addresses and the step count as 64-bit integers, steps >= 1)."""
        return types.void(types.intp, types.intp, types.intp, types.intp), _lane_dots_codegen


@kernel
def latent_key_logits(logits, off, idx, k, qfull, lead, scaling, tail_codes, tail_steps, bits, widths, out):
    """Logits out[r, j] of post-RoPE keys on the selected tokens idx[:k]: their lead-band logits from the
    scoring (logits[r, off + idx[j]]) plus the lower bands' share, the query rows' lower-band coefficients
    qfull[r, lead:] times `scaling` dotted with each token's decoded lower bands (tail_codes [G, N, bytes],
    tail_steps [G, N, bands]). The R rows split evenly over the G basis groups, in group order."""
    nrows = qfull.shape[0]
    width = qfull.shape[1] - lead
    groups = tail_codes.shape[0]
    per = nrows // groups
    blocks = -(-per // LANES)
    padded = max(CHAINS, -(-width // CHAINS) * CHAINS)
    # lanes[g, b, c, l]: row g * per + b * LANES + l's c-th lower coefficient (zeros past the rows, the
    # columns): each value's multiply-add reaches a block of rows in one vector
    lanes = np.zeros((groups, blocks, padded, LANES), np.float32)
    for g in range(groups):
        for b in range(blocks):
            for lane in range(min(LANES, per - b * LANES)):
                src = qfull[g * per + b * LANES + lane]
                for c in range(width):
                    lanes[g, b, c, lane] = src[lead + c] * scaling
    dec = np.zeros(padded, np.float32)
    sums = np.empty(LANES, np.float32)
    at_dec, at_sums = np.intp(dec.ctypes.data), np.intp(sums.ctypes.data)
    at_lanes = np.intp(lanes.ctypes.data)
    group_stride, block_stride = np.intp(lanes.strides[0]), np.intp(lanes.strides[1])
    steps = np.intp(padded // CHAINS)
    for j in range(k):
        t = idx[j]
        for g in range(groups):
            if width:
                decode_tail(tail_codes[g, t], tail_steps[g, t], bits, widths, dec)
            for b in range(blocks):
                _lane_dots(at_lanes + g * group_stride + b * block_stride, at_dec, steps, at_sums)
                first = g * per + b * LANES
                for lane in range(min(LANES, per - b * LANES)):
                    out[first + lane, j] = logits[first + lane, off + t] + sums[lane]
