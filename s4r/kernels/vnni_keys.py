"""The selected pre-RoPE keys rebuilt by int8 dot-product instructions (AVX512-VNNI) and dotted with the
query rows a tile of tokens at a time (numba, CPU).

Reference: one `torch._int_mm` of the decoded int8 rows with the basis codes, then `rotated_key_logits`
(the step's path where this one does not apply). The integer sums are the same (exact both ways) and so are
the rotation and the dots; a tile's sums stay in L1 where the product writes a [k, W] int32 buffer (1.2 MB
for 1,536 tokens of SmolLM2) that the rotation reads back.

VNNI multiplies unsigned bytes by signed ones: each token's codes are offset by 128 (their top bit
flipped) and each column's sums start from -128 times the column's codes summed, which cancels the
offset exactly. The instruction is emitted through an LLVM intrinsic, so it needs no C compiler either;
`available` keeps it off CPUs without it (LLVM would abort, not raise, compiling it there).
"""

from __future__ import annotations

import numpy as np
import torch

from s4r.kernels import jit
from s4r.kernels.jit import inline, numba, prange, rotated_logits, split_kernel

TILE = 16  # tokens whose sums stay in L1 between the product and the rotation
TOKENS = 4  # tokens an instruction run takes at once: each basis load serves four
COLUMNS = 64  # sum columns per instruction run: four 16-lane accumulators for each of its tokens


def available() -> bool:
    """Whether the fused kernels run here and the CPU numba compiles for has AVX512-VNNI."""
    return jit.compiles_for(*jit.VNNI) and jit.available()


def serves(width: int) -> bool:
    """Whether `vnni_key_logits` runs here for a basis of `width` key columns (whole runs of 16)."""
    return width % 16 == 0 and available()


def pack_basis(codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The int8 basis codes [G, r, W] (`int8_basis`, transposed) as the kernel reads them: packed [G,
    ceil(r / 4), W, 4] (four consecutive ranks of a column side by side; ranks past r zero) and the sums'
    starting values [G, W] (int32, -128 times each column's codes summed)."""
    groups, rank, width = codes.shape
    quads = -(-rank // 4)
    padded = torch.zeros(groups, 4 * quads, width, dtype=torch.int8)
    padded[:, :rank] = codes
    packed = padded.view(groups, quads, 4, width).transpose(2, 3).contiguous().numpy()
    start = (codes.sum(1, dtype=torch.int32) * -128).contiguous().numpy()
    return packed, start


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from s4r.kernels.intrinsics import ir_at, ir_loop, ir_splat

    def _sums_codegen(lanes: int):
        """LLVM IR of `_sums_four_tokens` over 16 * lanes columns."""

        def codegen(context, builder, signature, args):
            src, row, basis, stride, quads, dst, dst_row, start = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            vec = ir.VectorType(i32, 16)
            dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")

            def codes(t, q):  # token t's four codes of quad q, top bits flipped, in every lane
                offset = builder.add(builder.mul(ir.Constant(i64, t), row),
                                     builder.mul(q, ir.Constant(i64, 4)))
                word = builder.load(ir_at(builder, src, offset, i32), align=1)
                return ir_splat(builder, builder.xor(word, ir.Constant(i32, -0x7F7F7F80)), vec)

            def step(q, acc):
                words = [codes(t, q) for t in range(TOKENS)]
                base = builder.add(basis, builder.mul(q, stride))
                new = [None] * (TOKENS * lanes)
                for i in range(lanes):  # each basis load serves the four tokens
                    column = builder.load(ir_at(builder, base, ir.Constant(i64, 64 * i), vec), align=1)
                    for t in range(TOKENS):
                        new[t * lanes + i] = builder.call(dpbusd, [acc[t * lanes + i], words[t], column])
                return new

            first = [builder.load(ir_at(builder, start, ir.Constant(i64, 64 * i), vec), align=4)
                     for i in range(lanes)]
            new = ir_loop(builder, quads, [first[i % lanes] for i in range(TOKENS * lanes)], step)
            for t in range(TOKENS):
                out = builder.add(dst, builder.mul(ir.Constant(i64, t), dst_row))
                for i in range(lanes):
                    at = ir_at(builder, out, ir.Constant(i64, 64 * i), vec)
                    builder.store(new[t * lanes + i], at, align=4)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def _sums_four_tokens(typingctx, src, row, basis, stride, quads, dst, dst_row, start):
        """dst + t * dst_row [COLUMNS] int32 = start + the int8 codes at src + t * row (4 * quads bytes) of
        the four tokens t dotted with the packed basis columns at `basis` (quad q at basis + q * stride) by
        `vpdpbusd`, the sixteen accumulators in registers through the loop over quads (quads >= 1)."""
        return types.void(*([types.intp] * 8)), _sums_codegen(COLUMNS // 16)

    @intrinsic
    def _sums_four_tokens_16(typingctx, src, row, basis, stride, quads, dst, dst_row, start):
        """`_sums_four_tokens` over 16 columns (a width's last ones)."""
        return types.void(*([types.intp] * 8)), _sums_codegen(1)
else:  # pragma: no cover
    def _sums_four_tokens(*args):
        raise RuntimeError("numba is not available")

    _sums_four_tokens_16 = _sums_four_tokens


@inline
def _key_logits(q, codes, packed, start, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out,
                tile, half):
    groups, quads, width = packed.shape[0], packed.shape[1], packed.shape[2]
    stride, row = 4 * width, codes.shape[2]
    wide = width - width % COLUMNS  # columns in whole runs of COLUMNS; the rest 16 at a time
    for j0 in range(0, k, TILE):
        j1 = min(j0 + TILE, k)
        for g in range(groups):
            src, basis = codes[g].ctypes.data, packed[g].ctypes.data
            first, dst = start[g].ctypes.data, tile[g].ctypes.data
            # a run of columns' basis (quads x 256 bytes) serves the tile's tokens before the next run
            for c0 in range(0, wide, COLUMNS):
                for j in range(j0, j1, TOKENS):
                    _sums_four_tokens(src + j * row, row, basis + 4 * c0, stride, quads,
                                      dst + 4 * ((j - j0) * width + c0), 4 * width, first + 4 * c0)
            for c0 in range(wide, width, 16):
                for j in range(j0, j1, TOKENS):
                    _sums_four_tokens_16(src + j * row, row, basis + 4 * c0, stride, quads,
                                         dst + 4 * ((j - j0) * width + c0), 4 * width, first + 4 * c0)
        rotated_logits(q, tile, idx[j0:j1], j1 - j0, pos0, coarse, fine, scaling, col_scale,
                       row_scale[:, j0:j1], out[:, j0:j1], half)


@inline
def _key_logits_run(q, codes, packed, start, idx, lo, hi, pos0, coarse, fine, scaling, col_scale, row_scale,
                    out, tile):
    """`_key_logits` of the selected tokens lo <= j < hi, the head size's half a constant where it is a
    common one: loops of a known trip count vectorize whole (as `rotated_key_logits`)."""
    half = q.shape[2] // 2
    src, mine, dst, scale = codes[:, lo:], idx[lo:hi], out[:, lo:hi], row_scale[:, lo:hi]
    if half == 32:
        _key_logits(q, src, packed, start, mine, hi - lo, pos0, coarse, fine, scaling, col_scale, scale, dst,
                    tile, 32)
    elif half == 64:
        _key_logits(q, src, packed, start, mine, hi - lo, pos0, coarse, fine, scaling, col_scale, scale, dst,
                    tile, 64)
    else:
        _key_logits(q, src, packed, start, mine, hi - lo, pos0, coarse, fine, scaling, col_scale, scale, dst,
                    tile, half)


@split_kernel
def vnni_key_logits(q, codes, packed, start, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out,
                    tiles, parts):
    """Logits out[r, j] of the query rows q [H, M, d] on the keys of the tokens idx[:k] rebuilt from their
    int8 rows codes [B, >=k rounded up to TOKENS, 4 * quads] (`decode_rows_int8`; the bytes past the rank
    are read and cancel against the packed basis' zeros, the rows past k are read and their sums unused)
    and the packed basis (`pack_basis`: packed [B, quads, W, 4], start [B, W]; W a multiple of 16), scaled
    by col_scale [B, W] and row_scale [B, >=k] and rotated to their positions idx[j] + pos0 as
    `rotated_key_logits` does. The tokens split into `parts` runs of whole tiles, one a thread, each with
    its int32 scratch tiles[p] [B, TILE, W]."""
    span = -(-k // (parts * TILE)) * TILE
    for p in prange(parts):
        _key_logits_run(q, codes, packed, start, idx, min(k, p * span), min(k, (p + 1) * span), pos0, coarse,
                        fine, scaling, col_scale, row_scale, out, tiles[p])
