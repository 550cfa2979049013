"""`bf16_products.product` on AMX tiles (`tdpbf16ps`, numba, CPU): where the CPU has AMX-BF16, a question's
prompt multiplies its query rows by the rebuilt keys and its probabilities by the selected value rows on
the tile unit: a prompt layer's value rows ~3.5x faster than by `vdpbf16ps` (BENCHMARKS.md, "Chat over two
documents").

Reference: `bf16_products.product`, the same words in and the same fp32 sums out (each pair of products
summed in fp32 by both; the order of the fp32 additions differs). The tile instructions are emitted through
LLVM's AMX intrinsics, so they need no C compiler; Linux hands a process the tile state only when it asks
(`arch_prctl`), which `available` does once.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from s4r.kernels import jit
from s4r.kernels.jit import kernel, numba

TILE = 16  # a tile's rows, and its 64 bytes of words (fp32 sums or bf16 pairs) a row
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # Linux x86-64


@functools.cache
def _tiles_granted() -> bool:
    """Whether this CPU has AMX-BF16, numba compiles for it and Linux granted this process the tile state."""
    if "amx_bf16" not in jit.cpu_flags() or not jit.compiles_for("amx-tile", "amx-bf16"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):  # no libc symbol table here
        return False


def available() -> bool:
    """Whether `product` runs here: the bf16 products do (`jit.bf16_instructions`), the CPU has AMX-BF16
    and the tile state was granted; `S4R_AMX=0` keeps `vdpbf16ps`."""
    return os.environ.get("S4R_AMX") != "0" and jit.bf16_instructions() and _tiles_granted()


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from s4r.kernels.intrinsics import ir_loop

    _I8, _I64, _PTR = ir.IntType(8), ir.IntType(64), ir.IntType(8).as_pointer()

    def _emit(builder, name: str, *args) -> None:
        """A call of the void intrinsic `name`: ints are tile numbers (i8), LLVM values pass as they are."""
        values = [ir.Constant(_I8, a) if isinstance(a, int) else a for a in args]
        kinds = [v.type for v in values]
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), kinds),
                                                    name), values)

    @intrinsic
    def _tile_config(typingctx, addr):
        """Load the tile configuration (64 bytes) at the integer address `addr`."""

        def codegen(context, builder, signature, args):
            _emit(builder, "llvm.x86.ldtilecfg", builder.inttoptr(args[0], _PTR))
            return context.get_dummy_value()

        return types.void(types.intp), codegen

    @intrinsic
    def _tile_release(typingctx):
        """Hand the tile state back (the OS then saves none of it)."""

        def codegen(context, builder, signature, args):
            _emit(builder, "llvm.x86.tilerelease")
            return context.get_dummy_value()

        return types.void(), codegen

    def _block_intrinsic(columns: int):
        """An intrinsic: dst (32 rows x 16 * columns fp32, row stride dst_row bytes) = the 32 left rows at a
        (stride a_row, 16 * blocks words each) times the right operand's 16 * columns columns at b (16 *
        blocks rows of stride b_row): tiles 0-3 sum, 4-5 hold the left rows, 6-7 the right columns."""

        def block(typingctx, a, a_row, b, b_row, blocks, dst, dst_row):
            def codegen(context, builder, signature, args):
                a, a_row, b, b_row, blocks, dst, dst_row = args
                sums = [(r, c) for r in range(2) for c in range(columns)]
                for t, _ in enumerate(sums):
                    _emit(builder, "llvm.x86.tilezero", t)

                def step(k, carried):
                    left = builder.add(a, builder.mul(k, ir.Constant(_I64, 4 * TILE)))
                    right = builder.add(b, builder.mul(builder.mul(k, ir.Constant(_I64, TILE)), b_row))
                    for r in range(2):
                        at = builder.add(left, builder.mul(a_row, ir.Constant(_I64, TILE * r)))
                        _emit(builder, "llvm.x86.tileloadd64", 4 + r, builder.inttoptr(at, _PTR), a_row)
                    for c in range(columns):
                        at = builder.add(right, ir.Constant(_I64, 4 * TILE * c))
                        _emit(builder, "llvm.x86.tileloadd64", 6 + c, builder.inttoptr(at, _PTR), b_row)
                    for t, (r, c) in enumerate(sums):
                        _emit(builder, "llvm.x86.tdpbf16ps", t, 4 + r, 6 + c)
                    return []

                ir_loop(builder, blocks, [], step)
                for t, (r, c) in enumerate(sums):
                    offset = builder.add(builder.mul(dst_row, ir.Constant(_I64, TILE * r)),
                                         ir.Constant(_I64, 4 * TILE * c))
                    at = builder.inttoptr(builder.add(dst, offset), _PTR)
                    _emit(builder, "llvm.x86.tilestored64", t, at, dst_row)
                return context.get_dummy_value()

            return types.void(*([types.intp] * 7)), codegen

        block.__name__ = f"_block_32x{16 * columns}"
        return intrinsic(block)

    _block_32, _block_16 = _block_intrinsic(2), _block_intrinsic(1)
else:  # pragma: no cover
    def _block_32(*args):
        raise RuntimeError("numba is not available")

    _tile_config = _tile_release = _block_16 = _block_32


@kernel
def product(left, right, pairs, scale, out, n):
    """`bf16_products.product` on tiles: out[m, :n] = scale * the rows of left [M, >=ceil16(pairs)] (bf16
    pairs) times right [>=ceil16(pairs), >=ceil16(n)] (bf16 pairs), summed in fp32 (out [M, >=n] fp32;
    nothing past column n written). The words from `pairs` up to a multiple of 16 are zeroed here, in
    both operands: they need room for them."""
    rows = left.shape[0]
    if pairs < 1:
        out[:, :n] = 0.0
        return
    depth = -(-pairs // TILE) * TILE
    if left.shape[1] < depth or right.shape[0] < depth or right.shape[1] < -(-n // TILE) * TILE:
        raise ValueError("amx product: the operands lack room for whole tiles")
    if left.strides[1] != 4 or right.strides[1] != 4 or out.strides[1] != 4:
        raise ValueError("amx product: rows must be of unit stride")
    left[:, pairs:depth] = 0
    right[pairs:depth] = 0
    config = np.zeros(64, np.uint8)  # palette 1, every tile 16 rows of 64 bytes
    config[0] = 1
    for t in range(8):
        config[16 + 2 * t], config[48 + t] = 64, TILE
    # the last rows where fewer than 32 remain, zero past them (none where the rows are whole blocks)
    edge_rows = np.zeros((2 * TILE if rows % (2 * TILE) else 0, depth), np.uint32)
    sums = np.empty((2 * TILE, 2 * TILE), np.float32)  # a block of sums partly past the output
    a_row, b_row, o_row = left.strides[0], right.strides[0], out.strides[0]
    blocks = depth // TILE
    _tile_config(config.ctypes.data)
    for m0 in range(0, rows, 2 * TILE):
        count = min(2 * TILE, rows - m0)
        a, a_stride = left.ctypes.data + m0 * a_row, a_row
        if count < 2 * TILE:
            edge_rows[:count] = left[m0:rows, :depth]
            a, a_stride = edge_rows.ctypes.data, edge_rows.strides[0]
        for n0 in range(0, n, 2 * TILE):
            cols = min(2 * TILE, n - n0)
            b = right.ctypes.data + 4 * n0
            if count == 2 * TILE and cols == 2 * TILE:
                _block_32(a, a_stride, b, b_row, blocks, out.ctypes.data + m0 * o_row + 4 * n0, o_row)
                continue
            if cols > TILE:
                _block_32(a, a_stride, b, b_row, blocks, sums.ctypes.data, sums.strides[0])
            else:
                _block_16(a, a_stride, b, b_row, blocks, sums.ctypes.data, sums.strides[0])
            for r in range(count):
                out[m0 + r, n0 : n0 + cols] = sums[r, :cols]
    _tile_release()
    if scale != 1.0:  # a pass of its own: rescaling each block of sums straight after its tile stores stalls
        s = np.float32(scale)
        for m in range(rows):
            row = out[m]
            for c in range(n):
                row[c] *= s
