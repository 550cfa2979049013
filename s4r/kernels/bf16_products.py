"""Matrix products of bf16 pairs by the AVX512-BF16 dot-product instruction (`vdpbf16ps`, numba, CPU): a
question's prompt multiplies its probabilities by the selected value rows and its query rows by the rebuilt
keys at twice the fp32 rate, in a model whose compute dtype is bf16 (the full cache's exact products are
bf16 there too).

Reference: the same product in fp32 of the operands rounded to bf16 (`torch.matmul`); the instruction sums
each pair's two products in fp32, so the two differ only by the order of fp32 additions. Operands are
packed as 32-bit words of two bf16 values along the summed axis: the left one's rows (`pair_rows`), the
right one's columns (`pair_columns`; `rotate_key_pairs` writes the rotated keys so). The instruction
is emitted through an LLVM intrinsic (numba has no bf16 type; the IR names LLVM's), so it needs no C
compiler; `available` keeps it off CPUs without it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from s4r.kernels import jit
from s4r.kernels.jit import compose_angles, fine_shift, inline, kernel, numba, pair, rotated_row

ROWS = 4  # left rows an instruction run takes at once: each right-operand load serves four
COLUMNS = 64  # output columns per run: four 16-lane accumulators for each of its rows


def available() -> bool:
    """Whether the fused kernels run here and the CPU numba compiles for has AVX512-BF16;
    `S4R_BF16_PRODUCTS=0` keeps the fp32 products."""
    return jit.bf16_instructions()


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from s4r.kernels.intrinsics import BFloat, ir_at, ir_loop, ir_splat

    def _run_codegen(rows: int, lanes: int):
        """LLVM IR of `_run` over `rows` left rows and 16 * lanes columns."""

        def codegen(context, builder, signature, args):
            left, left_row, right, right_row, pairs, out, out_row, scale = args
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            vf, vi, vb = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(BFloat(), 32)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vb, vb]),
                                                 "llvm.x86.avx512bf16.dpbf16ps.512")

            def step(p, acc):
                words = []  # each left row's pair p, in every lane
                for r in range(rows):
                    offset = builder.add(builder.mul(ir.Constant(i64, r), left_row),
                                         builder.mul(p, ir.Constant(i64, 4)))
                    word = builder.load(ir_at(builder, left, offset, i32))
                    words.append(builder.bitcast(ir_splat(builder, word, vi), vb))
                base = builder.add(right, builder.mul(p, right_row))
                new = [None] * (rows * lanes)
                for c in range(lanes):  # each right load serves every row
                    column = builder.load(ir_at(builder, base, ir.Constant(i64, 64 * c), vi), align=4)
                    for r in range(rows):
                        new[r * lanes + c] = builder.call(dot, [acc[r * lanes + c], words[r],
                                                                builder.bitcast(column, vb)])
                return new

            new = ir_loop(builder, pairs, [ir.Constant(vf, [0.0] * 16)] * (rows * lanes), step)
            factor = ir_splat(builder, scale, vf)
            for r in range(rows):
                dst = builder.add(out, builder.mul(ir.Constant(i64, r), out_row))
                for c in range(lanes):
                    builder.store(builder.fmul(new[r * lanes + c], factor),
                                  ir_at(builder, dst, ir.Constant(i64, 64 * c), vf), align=4)
            return context.get_dummy_value()

        return codegen

    def _run_signature():
        return types.void(*([types.intp] * 7), types.float32)

    def _run_intrinsic(rows: int, lanes: int):
        """An intrinsic: out + r * out_row [16 * lanes] fp32 = scale * the `rows` left rows' words at
        left + r * left_row (`pairs` words of two bf16) dotted with the right operand's 16 * lanes
        columns (pair p's words at right + p * right_row), the accumulators in registers through the loop
        over pairs (pairs >= 1)."""

        def run(typingctx, left, left_row, right, right_row, pairs, out, out_row, scale):
            return _run_signature(), _run_codegen(rows, lanes)

        run.__name__ = f"_run_{rows}x{16 * lanes}"
        return intrinsic(run)

    # a product's runs: ROWS rows (or its last rows one at a time) over COLUMNS columns, its last 16, 32 or
    # 48 columns in one narrower run (`_run_lanes`)
    _run, _run_row = _run_intrinsic(ROWS, COLUMNS // 16), _run_intrinsic(1, COLUMNS // 16)
    _run_16, _run_row_16 = _run_intrinsic(ROWS, 1), _run_intrinsic(1, 1)
    _run_32, _run_row_32 = _run_intrinsic(ROWS, 2), _run_intrinsic(1, 2)
    _run_48, _run_row_48 = _run_intrinsic(ROWS, 3), _run_intrinsic(1, 3)
else:  # pragma: no cover
    def _run(*args):
        raise RuntimeError("numba is not available")

    _run_row = _run_16 = _run_row_16 = _run_32 = _run_row_32 = _run_48 = _run_row_48 = _run


@kernel
def pair_rows(x, k, out):
    """out [M, >=ceil(k / 2)] uint32 = the rows of x [M, >=k] (fp32) as bf16 pairs along the row: word p of
    row m holds x[m, 2p] and x[m, 2p + 1] (0 past k), rounded to nearest even."""
    for m in range(x.shape[0]):
        src, dst = x[m], out[m]
        for p in range(k // 2):
            dst[p] = pair(src[2 * p], src[2 * p + 1])
        if k % 2:
            dst[k // 2] = pair(src[k - 1], 0.0)


@kernel
def pair_columns(x, k, out):
    """out [ceil(k / 2), N] uint32 = the columns of x [>=k, R] (fp32, R <= N) as bf16 pairs down the column:
    word (p, c) holds x[2p, c] and x[2p + 1, c] (0 past k and past R)."""
    width = x.shape[1]
    for p in range((k + 1) // 2):
        dst = out[p]
        a = x[2 * p]
        if 2 * p + 1 < k:
            b = x[2 * p + 1]
            for c in range(width):
                dst[c] = pair(a[c], b[c])
        else:
            for c in range(width):
                dst[c] = pair(a[c], 0.0)
        for c in range(width, out.shape[1]):
            dst[c] = 0


@inline
def _run_lanes(lanes, rows, a, a_row, b, b_row, pairs, to, to_row, s):
    """A run of 16 * lanes columns (lanes 1-4: a product's last run may be narrower) for `rows` left rows
    (ROWS or 1)."""
    if rows == ROWS:
        if lanes == 1:
            _run_16(a, a_row, b, b_row, pairs, to, to_row, s)
        elif lanes == 2:
            _run_32(a, a_row, b, b_row, pairs, to, to_row, s)
        elif lanes == 3:
            _run_48(a, a_row, b, b_row, pairs, to, to_row, s)
        else:
            _run(a, a_row, b, b_row, pairs, to, to_row, s)
    elif lanes == 1:
        _run_row_16(a, a_row, b, b_row, pairs, to, to_row, s)
    elif lanes == 2:
        _run_row_32(a, a_row, b, b_row, pairs, to, to_row, s)
    elif lanes == 3:
        _run_row_48(a, a_row, b, b_row, pairs, to, to_row, s)
    else:
        _run_row(a, a_row, b, b_row, pairs, to, to_row, s)


@kernel
def product(left, right, pairs, scale, out, n):
    """out[m, :n] = scale * sum over p < pairs of left [M, >=pairs] (bf16 pairs) dotted with right
    [>=pairs, >=n rounded up to 16] (bf16 pairs) at word p, products summed in fp32 (out [M, >=n] fp32,
    rows of unit stride; nothing past column n written)."""
    rows = left.shape[0]
    if pairs < 1:  # the instruction runs take at least one pair
        out[:, :n] = 0.0
        return
    a, b, dst, s = left.ctypes.data, right.ctypes.data, out.ctypes.data, np.float32(scale)
    a_row, b_row, out_row = left.strides[0], right.strides[0], out.strides[0]
    tail = np.empty((ROWS, COLUMNS), np.float32)  # a last run's columns where n is not whole runs of 16
    for c0 in range(0, n, COLUMNS):  # a run of columns' right operand serves every row before the next
        cols = min(COLUMNS, n - c0)
        lanes, part = -(-cols // 16), cols % 16 != 0
        for m in range(0, rows, ROWS):
            count = min(ROWS, rows - m)
            to, to_row = (tail.ctypes.data, 4 * COLUMNS) if part else (dst + m * out_row + 4 * c0, out_row)
            if count == ROWS:
                _run_lanes(lanes, ROWS, a + m * a_row, a_row, b + 4 * c0, b_row, pairs, to, to_row, s)
            else:  # the last rows one at a time
                for r in range(count):
                    _run_lanes(lanes, 1, a + (m + r) * a_row, a_row, b + 4 * c0, b_row, pairs,
                               to + r * to_row, to_row, s)
            if part:
                for r in range(count):
                    for c in range(cols):
                        out[m + r, c0 + c] = tail[r, c]


@inline
def _rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, half, width):
    shift = fine_shift(fine)
    scaled = col_scale.shape[1] > 0
    groups, words = out.shape[0], width // 2
    ang = np.empty(2 * half, np.float32)
    row = np.empty(width, np.float32)
    rot = np.empty(width, np.float32)
    ones = np.ones(width, np.float32)
    tile = np.empty((groups, 16, words), np.uint32)  # 16 tokens' pairs, token by token, then transposed out
    for j0 in range(0, k, 16):
        count = min(16, k - j0)
        for t in range(count):
            compose_angles(idx[j0 + t] + pos0, coarse, fine, shift, half, ang)
            for b in range(groups):
                factor = row_scale[b, j0 + t] if scaled else np.float32(1.0)
                rotated_row(keys[b, j0 + t], factor, col_scale[b] if scaled else ones, ang, half, width, row,
                            rot)
                dst = tile[b, t]
                for p in range(words):
                    dst[p] = pair(rot[2 * p], rot[2 * p + 1])
        for t in range(count, 16):
            tile[:, t] = 0
        for b in range(groups):
            if j0 + 16 <= out.shape[2]:  # a whole block: loops of a known trip count vectorize
                for p in range(words):
                    dst = out[b, p]
                    for t in range(16):
                        dst[j0 + t] = tile[b, t, p]
            else:
                for p in range(words):
                    for j in range(j0, out.shape[2]):
                        out[b, p, j] = tile[b, j - j0, p]


@kernel
def rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out):
    """`rotate_keys` into bf16 pairs for `key_pair_logits`: out [B, W / 2, >=k rounded up to 16] uint32,
    word (b, p, j) the rotated key j's columns 2p and 2p + 1 rounded to bf16 (0 past k, up to a multiple
    of 16)."""
    half, width = coarse.shape[1] // 2, keys.shape[2]
    if half == 32 and width == 192:
        _rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, 32, 192)
    elif half == 32:
        _rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, 32, width)
    elif half == 64:
        _rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, 64, width)
    else:
        _rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, out, half, width)


Buffers = Callable[[str, tuple[int, ...], torch.dtype], np.ndarray]  # the step's scratch (`Scratch.np`)


def _words(buffers: Buffers, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The buffer `name` of `shape` as uint32 words."""
    return buffers(name, shape, torch.int32).view(np.uint32)


def key_pair_logits(q: np.ndarray, keys: np.ndarray, idx: np.ndarray, pos0: int, coarse: np.ndarray,
                    fine: np.ndarray, scaling: float, col_scale: np.ndarray, row_scale: np.ndarray,
                    out: np.ndarray, buffers: Buffers, multiply: Callable = product) -> None:
    """`query_blocks.rotate_keys` then `query_blocks.key_logits_product` in bf16: the keys rotated into
    bf16 pairs (`rotate_key_pairs`), the query rows rounded to bf16 too, one `multiply` (`product` or
    `amx_products.product`, which takes head dimensions of whole tiles) a head."""
    heads, rows, d = q.shape
    k = idx.shape[0]
    pairs = _words(buffers, "key_pairs", (keys.shape[0], keys.shape[2] // 2, -(-k // 16) * 16))
    rotate_key_pairs(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, pairs)
    left = _words(buffers, "query_pairs", (heads * rows, d // 2))
    pair_rows(q.reshape(heads * rows, d), d, left)  # every head's rows at once
    multiply = multiply if d % 32 == 0 else product
    for h in range(heads):
        right = pairs[0, h * d // 2 : (h + 1) * d // 2] if pairs.shape[0] == 1 else pairs[h]
        multiply(left[h * rows : (h + 1) * rows], right, d // 2, scaling, out[h * rows : (h + 1) * rows], k)


def value_pair_rows(probs: np.ndarray, k: int, decoded: np.ndarray, rows: int,
                    buffers: Buffers, multiply: Callable = product) -> np.ndarray:
    """`query_blocks.value_rows_product` in bf16: z [G, M, r_v] (a view of `buffers`), z[b, m] =
    probs[b * M + m, :k] @ decoded[b, :k], both operands rounded to bf16, one `multiply` a group."""
    groups, _, rank = decoded.shape
    width = -(-rank // 16) * 16  # whole runs of 16 columns; the padding's columns are zero
    pairs = (k + 1) // 2
    depth = -(-pairs // 16) * 16  # room for whole tiles of pairs (`amx_products.product` zeroes it)
    z = buffers("z_padded", (groups, rows, width), torch.float32)
    left = _words(buffers, "prob_pairs", (rows, depth))
    right = _words(buffers, "value_pairs", (depth, width))
    for g in range(groups):
        pair_rows(probs[g * rows : (g + 1) * rows], k, left)
        pair_columns(decoded[g], k, right)
        multiply(left, right, pairs, 1.0, z[g], width)
    return z[..., :rank]
