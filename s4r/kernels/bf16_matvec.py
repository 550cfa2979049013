"""A one-token product of a bf16 weight matrix by the AVX512-BF16 dot-product instruction (`vdpbf16ps`,
numba, CPU): what the lean decode step's projections and LM head run, reading each weight once in its
own row-major layout (nothing repacked, no second copy of the weights).

A decode step's products are matrix-vector products, bound by the weights' bytes. Four weight rows a run
are dotted with the input 32 bf16 values at a time, each row's sums held in a 16-lane fp32 register and
added across its lanes at the end: one pass over the matrix, which reads it faster than torch's bf16
product of one row does (BENCHMARKS.md, "The whole step on the Xeon machine").

Reference: `torch.nn.functional.linear` of the same bf16 operands, which sums in fp32 and rounds the
result to bf16 as this does; the two differ only by the order of the fp32 additions. The lean step's
"lean-torch" setting runs torch's product; `S4R_BF16_PRODUCTS=0` turns this kernel off with the other
bf16 kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from s4r.kernels import jit
from s4r.kernels.jit import as_f32, as_numpy, inline, numba, prange, split_kernel

ROWS = 4  # weight rows a run dots with the input: each input load serves four
CHUNK = 32  # bf16 values a run takes of each row per instruction (one 64-byte load)


def available() -> bool:
    """Whether the product runs here: the fused kernels, a CPU with AVX512-BF16, not turned off."""
    return jit.bf16_instructions()


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from s4r.kernels.intrinsics import BFloat, ir_at, ir_loop
    from s4r.kernels.jit import round_bf16

    def _sum_lanes(builder, v):
        """LLVM IR: the sum of the 16 fp32 lanes of v, halved four times."""
        width = 16
        while width > 1:
            width //= 2
            low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                           list(range(width))))
            high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                            list(range(width, 2 * width))))
            v = builder.fadd(low, high)
        return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))

    def _rows_codegen(rows: int):
        """LLVM IR of a run over `rows` weight rows."""

        def codegen(context, builder, signature, args):
            weight, weight_row, x, chunks, sums = args
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            vf, vi, vb = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(BFloat(), 32)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vb, vb]),
                                                 "llvm.x86.avx512bf16.dpbf16ps.512")

            def step(c, acc):
                at = builder.mul(c, ir.Constant(i64, 2 * CHUNK))
                xs = builder.bitcast(builder.load(ir_at(builder, x, at, vi), align=2), vb)
                new = []
                for r in range(rows):
                    row = builder.add(builder.mul(ir.Constant(i64, r), weight_row), at)
                    ws = builder.bitcast(builder.load(ir_at(builder, weight, row, vi), align=2), vb)
                    new.append(builder.call(dot, [acc[r], ws, xs]))
                return new

            acc = ir_loop(builder, chunks, [ir.Constant(vf, [0.0] * 16)] * rows, step)
            for r in range(rows):
                builder.store(_sum_lanes(builder, acc[r]), ir_at(builder, sums, ir.Constant(i64, 4 * r), f32))
            return context.get_dummy_value()

        return codegen

    def _rows_intrinsic(rows: int):
        """An intrinsic: sums[r] (fp32) = weight row r (at weight + r * weight_row, bf16) dotted with x
        (bf16) over their first 32 * chunks values, for r < rows (chunks >= 1; addresses and sizes as
        64-bit integers)."""

        def run(typingctx, weight, weight_row, x, chunks, sums):
            return types.void(*([types.intp] * 5)), _rows_codegen(rows)

        run.__name__ = f"_rows_{rows}"
        return intrinsic(run)

    _rows, _row = _rows_intrinsic(ROWS), _rows_intrinsic(1)
else:  # pragma: no cover
    def _rows(*args):
        raise RuntimeError("numba is not available")

    _row = _rows


@inline
def _matvec_range(x, weight, out, first, last):
    """`bf16_matvec` of the weight rows first <= o < last."""
    n = weight.shape[1]
    chunks = n // CHUNK
    sums = np.empty(ROWS, np.float32)
    at_x, at_w, at_s = np.intp(x.ctypes.data), np.intp(weight.ctypes.data), np.intp(sums.ctypes.data)
    row = np.intp(weight.strides[0])
    o = first
    while o < last:
        count = ROWS if last - o >= ROWS else 1
        if chunks:
            if count == ROWS:
                _rows(at_w + o * row, row, at_x, np.intp(chunks), at_s)
            else:
                _row(at_w + o * row, row, at_x, np.intp(chunks), at_s)
        else:
            sums[:count] = 0.0
        for r in range(count):
            total = sums[r]
            src = weight[o + r]
            for i in range(chunks * CHUNK, n):  # the columns past the last whole chunk
                total += as_f32(src[i]) * as_f32(x[i])
            out[o + r] = round_bf16(total)
        o += count


@split_kernel
def bf16_matvec(x, weight, out, parts):
    """out [O] (bf16 bits) = weight [O, N] (bf16 bits, rows of unit stride) times x [N] (bf16 bits), each
    sum in fp32 rounded to bf16 as torch rounds. The rows split into `parts` runs, one a thread."""
    rows = weight.shape[0]
    span = -(-rows // (parts * ROWS)) * ROWS
    for p in prange(parts):
        _matvec_range(x, weight, out, min(rows, p * span), min(rows, (p + 1) * span))


class MatvecWeight:
    """A bf16 weight matrix of the lean step with its numpy view, made once: `product` multiplies one input
    row by `bf16_matvec`, more rows (or after a kernel failed) by torch's product."""

    __slots__ = ("tensor", "array", "fused")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.bfloat16 or tensor.device.type != "cpu" or tensor.stride(-1) != 1:
            raise ValueError("a bf16 CPU matrix with rows of unit stride")
        self.tensor = tensor
        self.array = as_numpy(tensor)
        self.fused = True

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ tensor.T` in bf16, x [..., N] in any float dtype."""
        rows, n = self.tensor.shape
        if self.fused and x.numel() == n:
            flat = x.reshape(n)
            if flat.dtype != torch.bfloat16 or not flat.is_contiguous():
                flat = flat.to(torch.bfloat16).contiguous()
            out = torch.empty(rows, dtype=torch.bfloat16)
            try:
                bf16_matvec(as_numpy(flat), self.array, as_numpy(out), jit.parts())
                return out.view(*x.shape[:-1], rows)
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here: torch's product
                self.fused = False
                jit.mark_failed(exc)
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.tensor)


def matvec_weights(tensors: list[torch.Tensor]) -> list[torch.Tensor | MatvecWeight]:
    """`tensors` as `MatvecWeight`s where the product runs here (bf16 CPU matrices and `available`), else
    as they are."""
    if not available():
        return list(tensors)
    return [MatvecWeight(t) if t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(-1) == 1
            else t for t in tensors]
