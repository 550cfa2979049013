"""Attention over an S4R layer's exact tokens and its selected stored tokens, fused (numba, CPU).

Reference: `LatentSelection.selected_logits` (pre-RoPE keys: `_model_dtype_key_logits` /
`_rebuilt_key_logits`; post-RoPE keys: latent logits plus `PlanarTail.logits`) and
`LowRankLayer.attend_chosen` with `s4r.core.latent.merged_attention`. Keys are rebuilt only for the
selected tokens (their coefficients decoded here, the basis product left to one BLAS/oneDNN call or to
`vnni_keys`) and rotated to their positions; values are combined in the latent space
(probability-weighted coefficient rows; the softmax and the value basis: `s4r.kernels.step_output`). A
block of queries that attends every stored token rebuilds them all with `decode_rows` and `rotate_rows`
(`s4r.layers.lowrank_dense`).
"""

from __future__ import annotations

import numpy as np

from s4r.kernels.intrinsics import CHAINS, ROW_LANES
from s4r.kernels.jit import (
    as_f32,
    inline,
    kernel,
    numba,
    prange,
    split_kernel,
)

if numba is not None:
    from numba import types
    from numba.extending import overload

    from s4r.kernels.intrinsics import (
        lane_dots,
        prefetch,
        row_sums_1,
        row_sums_2,
        row_sums_4,
        row_sums_6,
        unpack2,
        unpack4,
    )
    from s4r.kernels.jit import round_bf16

    def stored(x, arr):  # pragma: no cover - replaced by its overload inside kernels
        """float32 `x` as an element of `arr` (bf16 bits for a uint16 array)."""
        raise NotImplementedError

    @overload(stored, inline="always")
    def _stored(x, arr):
        if arr.dtype == types.uint16:
            return lambda x, arr: round_bf16(x)
        return lambda x, arr: np.float32(x)
else:  # pragma: no cover
    def stored(x, arr):
        return x


AHEAD = 16  # `_fetch_ahead`: how many selected tokens ahead their rows are fetched


@inline
def _fetch_ahead(idx, j, last, codes, g):
    """Prefetch the stored row codes[g, idx[j + AHEAD]] while token idx[j] is decoded (unless j + AHEAD is
    past `last`): the selected tokens' rows lie apart in memory and out of cache after the weights the step
    streamed in between; fetched ahead, less of the kernel waits on memory (BENCHMARKS.md, decode speed)."""
    if j + AHEAD < last:
        prefetch(np.intp(codes.ctypes.data) + g * codes.strides[0] + idx[j + AHEAD] * codes.strides[1])


@inline
def _unpack_rest(src, at, first, nbytes, b, step, out, col):
    """`_unpack` of the bytes first <= i < nbytes one by one."""
    if b == 4:
        for i in range(first, nbytes):
            v = np.int32(src[at + i])
            out[col + 2 * i] = (np.float32(v & 15) - np.float32(7.5)) * step
            out[col + 2 * i + 1] = (np.float32(v >> 4) - np.float32(7.5)) * step
    elif b == 2:
        for i in range(first, nbytes):
            v = np.int32(src[at + i])
            for s in range(4):
                out[col + 4 * i + s] = (np.float32((v >> (2 * s)) & 3) - np.float32(1.5)) * step
    else:
        per = 8 // b
        mask = (1 << b) - 1
        offset = np.float32((1 << b) / 2 - 0.5)
        for i in range(first, nbytes):
            v = np.int32(src[at + i])
            for s in range(per):
                out[col + i * per + s] = (np.float32((v >> (s * b)) & mask) - offset) * step


@inline
def _unpack(src, at, nbytes, b, step, out, col):
    """out[col:col + nbytes * 8 // b] = the b-bit codes of the bytes src[at:at + nbytes] (both of unit
    stride), lowest bits first, decoded as (c - (2^b / 2 - 0.5)) * step. The 4- and 2-bit bands run
    UNPACKED values at a time through one vector intrinsic each (a byte loop over a band's 9 or 18 bytes
    stayed scalar), the bytes left one by one; each width's constants are literal and nothing is sliced
    (a division by a run-time width, or a view a band, cost more than the band's decoding)."""
    done = 0
    step = np.float32(step)
    if b == 4:
        at_src, at_out = np.intp(src.ctypes.data) + at, np.intp(out.ctypes.data) + 4 * col
        while done + 16 <= nbytes:
            unpack4(at_src + done, step, at_out + 8 * done)
            done += 16
    elif b == 2:
        at_src, at_out = np.intp(src.ctypes.data) + at, np.intp(out.ctypes.data) + 4 * col
        while done + 8 <= nbytes:
            unpack2(at_src + done, step, at_out + 16 * done)
            done += 8
    _unpack_rest(src, at, done, nbytes, b, step, out, col)


@inline
def decode_tail(codes, steps, bits, widths, dst):
    """A token's lower coefficient bands (packed codes [bytes], steps [bands]) decoded in their natural
    order into dst (both of unit stride): code c of a b-bit band is (c - (2^b / 2 - 0.5)) * step,
    `coef_bands.decode_tails`."""
    byte = 0
    col = 0
    for band in range(bits.shape[0]):
        b = bits[band]
        nbytes = widths[band] * b // 8
        _unpack(codes, byte, nbytes, b, as_f32(steps[band]), dst, col)
        byte += nbytes
        col += widths[band]


@kernel
def decode_rows(idx, k, lead_codes, lead_scale, tail_codes, tail_steps, bits, widths, token_last, out):
    """Coefficient rows out[b, j, :] of the selected tokens idx[:k] for each basis group b (rows past k up
    to out's capacity zeroed): the int8 lead band times its scale, then the lower bands, each value
    rounded once to out's dtype. lead_codes [G, lead, N] when `token_last` (keys) else [G, N, lead]."""
    groups = out.shape[0]
    rank = out.shape[2]
    lead = lead_codes.shape[1] if token_last else lead_codes.shape[2]
    row = np.empty(rank, np.float32)
    for g in range(groups):
        codes_g, scale_g = lead_codes[g], lead_scale[g]
        for j in range(k):
            t = idx[j]
            _fetch_ahead(idx, j, k, tail_codes, g)
            s = as_f32(scale_g[t])
            if token_last:
                for c in range(lead):
                    row[c] = np.float32(codes_g[c, t]) * s
            else:
                src = codes_g[t]
                for c in range(lead):
                    row[c] = np.float32(src[c]) * s
            if bits.shape[0]:
                decode_tail(tail_codes[g, t], tail_steps[g, t], bits, widths, row[lead:])
            dst = out[g, j]
            for c in range(rank):
                dst[c] = stored(row[c], out)
        for j in range(k, out.shape[1]):
            dst = out[g, j]
            for c in range(rank):
                dst[c] = 0


@inline
def _int8_rows(idx, first_j, last_j, lead_codes, lead_scale, tail_codes, tail_steps, bits, widths, out,
               out_scale):
    """`decode_rows_int8` of the selected tokens first_j <= j < last_j."""
    groups = out.shape[0]
    rank = out.shape[2]
    lead = lead_codes.shape[1]
    row = np.empty(rank - lead, np.float32)
    for g in range(groups):
        codes_g, scale_g = lead_codes[g], lead_scale[g]
        for j in range(first_j, last_j):
            t = idx[j]
            _fetch_ahead(idx, j, last_j, tail_codes, g)
            s = as_f32(scale_g[t])
            dst = out[g, j]
            for c in range(lead):
                dst[c] = codes_g[c, t]
            if bits.shape[0]:
                decode_tail(tail_codes[g, t], tail_steps[g, t], bits, widths, row)
                inv = np.float32(1.0) / s
                tail = dst[lead:]
                for c in range(rank - lead):
                    v = min(max(np.rint(row[c] * inv), np.float32(-127.0)), np.float32(127.0))
                    tail[c] = np.int8(np.int32(v))
            out_scale[g, j] = s


@split_kernel
def decode_rows_int8(idx, k, lead_codes, lead_scale, tail_codes, tail_steps, bits, widths, out, out_scale,
                     parts):
    """`decode_rows` of keys (lead_codes [G, lead, N]) as int8 rows on the lead band's step, what one int8
    product rebuilds: out[b, j, :] holds token idx[j]'s lead codes as stored, then its lower bands decoded,
    times the step's reciprocal, rounded (clamped to +-127), out_scale[b, j] the step; rows past k up to
    out's capacity zeroed. The tokens split into `parts` runs, one a thread. Reference:
    `s4r.core.int8_rebuild.int8_rows`."""
    span = -(-k // parts)
    for p in prange(parts):
        _int8_rows(idx, min(k, p * span), min(k, (p + 1) * span), lead_codes, lead_scale, tail_codes,
                   tail_steps, bits, widths, out, out_scale)
    for g in range(out.shape[0]):
        for j in range(k, out.shape[1]):
            dst = out[g, j]
            for c in range(out.shape[2]):
                dst[c] = 0
            out_scale[g, j] = 0


TOKENS = 16  # value rows decoded and combined a block at a time: each output row is read once per block


@inline
def _add_weighted_rows(block, weights, size, acc):
    """acc += sum over b < size of weights[b] * block[b] (fp32 rows of whole 16-lane chunks), six chunks
    at a time in registers (`intrinsics.row_sums_*`): a loop over the columns kept each sum in memory."""
    at_block, at_w = np.intp(block.ctypes.data), np.intp(weights.ctypes.data)
    at_acc = np.intp(acc.ctypes.data)
    row_bytes, chunks, c = np.intp(block.strides[0]), acc.shape[0] // 16, 0
    while c < chunks:
        at = np.intp(64 * c)
        if chunks - c >= 6:
            row_sums_6(at_block + at, row_bytes, at_w, np.intp(size), at_acc + at)
            c += 6
        elif chunks - c >= 4:
            row_sums_4(at_block + at, row_bytes, at_w, np.intp(size), at_acc + at)
            c += 4
        elif chunks - c >= 2:
            row_sums_2(at_block + at, row_bytes, at_w, np.intp(size), at_acc + at)
            c += 2
        else:
            row_sums_1(at_block + at, row_bytes, at_w, np.intp(size), at_acc + at)
            c += 1


@inline
def _value_rows(probs, idx, first_j, last_j, lead_codes, lead_scale, tail_codes, tail_steps, bits, widths, z):
    """z[b, m, :] = `weighted_value_rows`' sums over the selected tokens first_j <= j < last_j."""
    groups, rows, rank = z.shape
    lead = lead_codes.shape[2]
    # rows padded to whole 16-lane vectors: no scalar remainder in the product's loop
    padded = -(-rank // 16) * 16
    block = np.zeros((TOKENS, padded), np.float32)
    weights = np.zeros((rows, TOKENS), np.float32)
    acc = np.empty((rows, padded), np.float32)
    for g in range(groups):
        codes_g, scale_g = lead_codes[g], lead_scale[g]
        for m in range(rows):
            for c in range(padded):
                acc[m, c] = 0.0
        for start in range(first_j, last_j, TOKENS):
            size = min(TOKENS, last_j - start)
            for b in range(size):
                t = idx[start + b]
                _fetch_ahead(idx, start + b, last_j, tail_codes, g)
                _fetch_ahead(idx, start + b, last_j, lead_codes, g)
                s = as_f32(scale_g[t])
                src = codes_g[t]
                row = block[b]
                for c in range(lead):
                    row[c] = np.float32(src[c]) * s
                if bits.shape[0]:
                    decode_tail(tail_codes[g, t], tail_steps[g, t], bits, widths, row[lead:])
            for m in range(rows):
                for b in range(TOKENS):
                    weights[m, b] = probs[g * rows + m, start + b] if b < size else np.float32(0.0)
            for m in range(rows):
                _add_weighted_rows(block, weights[m], size, acc[m])
        for m in range(rows):
            for c in range(rank):
                z[g, m, c] = acc[m, c]


@split_kernel
def weighted_value_rows(probs, idx, k, lead_codes, lead_scale, tail_codes, tail_steps, bits, widths, z,
                        parts):
    """z[b, m, :] = the sum over j < k of probs[b * M + m, j] times the decoded value coefficients of token
    idx[j] (lead_codes [G, N, lead] times their scale, then the lower bands), for each basis group b of the
    G and its M = rows / G query rows: `decode_rows` and a product, without the decoded rows in memory.
    The tokens split into `parts` runs, one a thread, whose sums are added."""
    if parts == 1:  # one run sums straight into z
        _value_rows(probs, idx, 0, k, lead_codes, lead_scale, tail_codes, tail_steps, bits, widths, z)
        return
    zparts = np.empty((parts,) + z.shape, np.float32)
    span = -(-k // (parts * TOKENS)) * TOKENS
    for p in prange(parts):
        _value_rows(probs, idx, min(k, p * span), min(k, (p + 1) * span), lead_codes, lead_scale, tail_codes,
                    tail_steps, bits, widths, zparts[p])
    z[...] = zparts[0]
    for p in range(1, parts):
        z += zparts[p]


@kernel
def latent_key_logits(logits, off, idx, k, qfull, lead, scaling, tail_codes, tail_steps, bits, widths, out):
    """Logits out[r, j] of post-RoPE keys on the selected tokens idx[:k]: their lead-band logits from the
    scoring (logits[r, off + idx[j]]) plus the lower bands' share, the query rows' lower-band coefficients
    qfull[r, lead:] times `scaling` dotted with each token's decoded lower bands (tail_codes [G, N, bytes],
    tail_steps [G, N, bands]). The R rows split evenly over the G basis groups, in group order. A token's
    bands are decoded once and each value multiplies every row of its group at once (`intrinsics.lane_dots`:
    the rows as one vector's lanes, four sums side by side); a dot per row ends in a sum across lanes and
    chains its adds, which ran at about two thirds of this speed (`research.profile_kernels`)."""
    nrows = qfull.shape[0]
    width = qfull.shape[1] - lead
    groups = tail_codes.shape[0]
    per = nrows // groups
    blocks = -(-per // ROW_LANES)
    padded = max(CHAINS, -(-width // CHAINS) * CHAINS)
    # lanes[g, b, c, l]: row g * per + b * ROW_LANES + l's c-th lower coefficient (zeros past the rows, the
    # columns): each value's multiply-add reaches a block of rows in one vector
    lanes = np.zeros((groups, blocks, padded, ROW_LANES), np.float32)
    for g in range(groups):
        for b in range(blocks):
            for lane in range(min(ROW_LANES, per - b * ROW_LANES)):
                src = qfull[g * per + b * ROW_LANES + lane]
                for c in range(width):
                    lanes[g, b, c, lane] = src[lead + c] * scaling
    dec = np.zeros(padded, np.float32)
    sums = np.empty(ROW_LANES, np.float32)
    at_dec, at_sums = np.intp(dec.ctypes.data), np.intp(sums.ctypes.data)
    at_lanes = np.intp(lanes.ctypes.data)
    group_stride, block_stride = np.intp(lanes.strides[0]), np.intp(lanes.strides[1])
    steps = np.intp(padded // CHAINS)
    for j in range(k):
        t = idx[j]
        for g in range(groups):
            _fetch_ahead(idx, j, k, tail_codes, g)
            if width:
                decode_tail(tail_codes[g, t], tail_steps[g, t], bits, widths, dec)
            for b in range(blocks):
                lane_dots(at_lanes + g * group_stride + b * block_stride, at_dec, steps, at_sums)
                first = g * per + b * ROW_LANES
                for lane in range(min(ROW_LANES, per - b * ROW_LANES)):
                    out[first + lane, j] = logits[first + lane, off + t] + sums[lane]


@kernel
def rotate_rows(keys, pos0, angles):
    """Rotate the keys [H, n, d] in place, token j to position pos0 + j, with the angle rows [P, d] (cos
    of the d/2 pairs, then sin), in fp32, rounded once."""
    half = keys.shape[2] // 2
    for h in range(keys.shape[0]):
        for j in range(keys.shape[1]):
            ang = angles[pos0 + j]
            row = keys[h, j]
            for i in range(half):
                x1 = as_f32(row[i])
                x2 = as_f32(row[half + i])
                c, s = ang[i], ang[half + i]
                row[i] = stored(x1 * c - x2 * s, keys)
                row[half + i] = stored(x2 * c + x1 * s, keys)
