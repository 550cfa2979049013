"""Scoring every stored token by int8 dot-product instructions (AVX512-VNNI): `latent_logits` where the
CPU has them (numba, CPU).

Reference: `latent_scoring.latent_logits`, which takes the same integer dot products in fp32 (exact there,
the sums stay under 2^24): the logits are equal bit for bit. Sixteen tokens a run: four rows of the
int8 lead band [lead, n] (16 tokens each) are interleaved into one vector whose 32-bit lane t holds token
t's four codes, and each query row's four codes of those rows, broadcast, are dotted with it by
`vpdpbusd`, up to 16 query rows' sums held in registers through the loop over the band's rows. The
instruction multiplies unsigned bytes by signed ones: the band's codes are offset by 128 (their top bit
flipped) and each row's sums start from -128 times its query codes summed, which cancels the offset.
"""

from __future__ import annotations

import numpy as np

from s4r.kernels import jit
from s4r.kernels.jit import as_f32, inline, numba, prange, split_kernel

TOKENS = 16  # tokens a run scores: one 16-lane vector of sums a query row
ROWS = 16  # query rows a run holds in registers (their sums, one vector each)


def available() -> bool:
    """Whether the fused kernels run here and the CPU numba compiles for has AVX512-VNNI."""
    return jit.compiles_for(*jit.VNNI) and jit.available()


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from s4r.kernels.intrinsics import ir_at, ir_loop, ir_splat

    def _run_codegen(rows: int):
        """LLVM IR of `_run` for `rows` query rows."""

        def codegen(context, builder, signature, args):
            fields = [builder.extract_value(args[0], i) for i in range(12)]
            words, word_row, band, band_row, quads, last, start, row_scale, tokens, dst, dst_row = fields[:11]
            stored = fields[11]
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vec, vf, bytes16 = ir.VectorType(i32, 16), ir.VectorType(f32, 16), ir.VectorType(i8, 16)
            dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            flip = ir.Constant(ir.VectorType(i8, 64), [-128] * 64)
            # byte 4t + i of the interleaved vector: band row i's token t (rows i < 2 from the first pair)
            pairs = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
            order = [16 * i + t for t in range(16) for i in range(4)]
            interleave = ir.Constant(ir.VectorType(i32, 64), order)

            def band_rows(q):  # the quad's four band rows (the last row where the band runs out)
                loaded = []
                for i in range(4):
                    j = builder.add(builder.mul(q, ir.Constant(i64, 4)), ir.Constant(i64, i))
                    j = builder.select(builder.icmp_signed(">", j, last), last, j)
                    at = ir_at(builder, band, builder.mul(j, band_row), bytes16)
                    loaded.append(builder.load(at, align=1))
                low = builder.shuffle_vector(loaded[0], loaded[1], pairs)
                high = builder.shuffle_vector(loaded[2], loaded[3], pairs)
                mixed = builder.xor(builder.shuffle_vector(low, high, interleave), flip)
                return builder.bitcast(mixed, vec)

            def step(q, acc):
                codes = band_rows(q)
                new = []
                for r in range(rows):
                    offset = builder.add(builder.mul(ir.Constant(i64, r), word_row),
                                         builder.mul(q, ir.Constant(i64, 4)))
                    word = builder.load(ir_at(builder, words, offset, i32), align=1)
                    new.append(builder.call(dpbusd, [acc[r], codes, ir_splat(builder, word, vec)]))
                return new

            first = [ir_splat(builder, builder.load(ir_at(builder, start, ir.Constant(i64, 4 * r), i32)), vec)
                     for r in range(rows)]
            sums = ir_loop(builder, quads, first, step)
            tokens = builder.load(ir_at(builder, tokens, ir.Constant(i64, 0), vf), align=4)
            # the instruction's own product: the compiler keeps (sum * the row's scale) * the token's scale
            # in this order, as `latent_logits` rounds them
            mul = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, i32]),
                                                 "llvm.x86.avx512.mul.ps.512")
            current = ir.Constant(i32, 4)  # the current rounding mode
            for r in range(rows):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, r), stored)):
                    scale = builder.load(ir_at(builder, row_scale, ir.Constant(i64, 4 * r), f32))
                    scale = ir_splat(builder, scale, vf)
                    logits = builder.call(mul, [builder.sitofp(sums[r], vf), scale, current])
                    logits = builder.call(mul, [logits, tokens, current])
                    at = builder.add(dst, builder.mul(ir.Constant(i64, r), dst_row))
                    builder.store(logits, ir_at(builder, at, ir.Constant(i64, 0), vf), align=4)
            return context.get_dummy_value()

        return codegen

    def _run_intrinsic(rows: int):
        """An intrinsic of one tuple (words, word_row, band, band_row, quads, last, start, row_scale,
        token_scale, dst, dst_row, stored): for the first `stored` of `rows` query rows, dst + r * dst_row
        [16] fp32 = (start[r] + query row r's codes (words + r * word_row, 4 * quads bytes) dotted with
        the band's 16 tokens at `band` (row j at band + j * band_row, rows past `last` read as row `last`))
        times row_scale[r], times token_scale [16] (quads >= 1; addresses and sizes as 64-bit integers)."""

        def run(typingctx, args):
            return types.void(args), _run_codegen(rows)

        run.__name__ = f"_run_{rows}"
        return intrinsic(run)

    _run_4, _run_8, _run_12, _run_16 = (_run_intrinsic(r) for r in (4, 8, 12, 16))
else:  # pragma: no cover
    def _run_4(*args):
        raise RuntimeError("numba is not available")

    _run_8 = _run_12 = _run_16 = _run_4


@inline
def _run(rows, args):
    """A run of `rows` (4, 8, 12 or 16) query rows (`_run_intrinsic`'s arguments)."""
    if rows == 16:
        _run_16(args)
    elif rows == 12:
        _run_12(args)
    elif rows == 8:
        _run_8(args)
    else:
        _run_4(args)


@inline
def _at(arr):
    """The address of arr's first element as a signed integer (numba types a pointer as unsigned, and its
    sum with a signed offset as a float)."""
    return np.intp(arr.ctypes.data)


@inline
def _score_range(q8, qscale, bounds, ck, sk, first_t, last_t, rows, logits, off):
    """`vnni_latent_logits` of the tokens first_t <= t < last_t."""
    chunks, nrows, lead = q8.shape[0], q8.shape[1], q8.shape[2]
    groups, capacity = ck.shape[0], ck.shape[2]
    quads = -(-lead // 4)
    per = nrows if groups == 1 else rows
    padded = -(-per // 4) * 4
    words = np.zeros((padded, 4 * quads), np.int8)  # a group's query codes, zero past lead and past per
    start = np.zeros(padded, np.int32)
    row_scale = np.zeros(padded, np.float32)
    token_scale = np.zeros(TOKENS, np.float32)
    spare = np.zeros((lead, TOKENS), np.int8)  # a run past the band's capacity, copied, zero padded
    part = np.empty((padded, TOKENS), np.float32)  # a run of fewer than 16 tokens' logits
    band_row, word_row, logit_row = ck.strides[1], words.strides[0], logits.strides[0]
    at_words, at_start, at_rows = _at(words), _at(start), _at(row_scale)
    at_tokens, at_spare, at_part = _at(token_scale), _at(spare), _at(part)
    for c in range(chunks):
        lo, hi = max(bounds[c], first_t), min(bounds[c + 1], last_t)
        if lo >= hi:
            continue
        for g in range(groups):
            first = 0 if groups == 1 else g * rows
            for r in range(per):
                total = 0
                for j in range(lead):
                    words[r, j] = q8[c, first + r, j]
                    total += np.int32(q8[c, first + r, j])
                start[r] = -128 * total
                row_scale[r] = qscale[c, first + r]
            base = _at(ck) + g * ck.strides[0]
            out = _at(logits) + first * logit_row + 4 * off
            for t0 in range(lo, hi, TOKENS):
                w = min(TOKENS, hi - t0)
                band, stride = base + t0, band_row
                if t0 + TOKENS > capacity:
                    for j in range(lead):
                        for t in range(TOKENS):
                            spare[j, t] = ck[g, j, t0 + t] if t < w else 0
                    band, stride = at_spare, spare.strides[0]
                for t in range(TOKENS):
                    token_scale[t] = as_f32(sk[g, t0 + t]) if t < w else np.float32(0.0)
                dst, dst_row = out + 4 * t0, logit_row
                if w < TOKENS:
                    dst, dst_row = at_part, part.strides[0]
                for r0 in range(0, padded, ROWS):
                    _run(min(ROWS, padded - r0), (at_words + r0 * word_row, word_row, band, stride, quads,
                                                  np.intp(lead - 1), at_start + 4 * r0, at_rows + 4 * r0,
                                                  at_tokens, dst + r0 * dst_row, dst_row, np.intp(per - r0)))
                if w < TOKENS:
                    for r in range(per):
                        for t in range(w):
                            logits[first + r, off + t0 + t] = part[r, t]


@split_kernel
def vnni_latent_logits(q8, qscale, bounds, ck, sk, n, rows, logits, off, parts):
    """`latent_scoring.latent_logits` (the same arguments and logits) by `vpdpbusd`: the int8 lead band ck
    [G, lead, >=n] (tokens of unit stride) scored 16 tokens a run. The tokens split into `parts` runs of
    whole runs of 16, one a thread."""
    span = -(-n // (parts * TOKENS)) * TOKENS
    for p in prange(parts):
        _score_range(q8, qscale, bounds, ck, sk, p * span, min(n, (p + 1) * span), rows, logits, off)
