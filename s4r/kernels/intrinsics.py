"""The LLVM IR of the kernels that emit instructions themselves, and the small vector intrinsics built from
it: a band's codes decoded 32 values at a time, a prefetch, a value times up to 16 query rows at once.

numba compiles an intrinsic's IR into the kernel that calls it; every address is a 64-bit integer. Nothing
here imports the rest of s4r (the kernels' modules sit at the bottom of the import floors).
"""

from __future__ import annotations

try:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except Exception:  # pragma: no cover - without numba no kernel compiles, and `jit.available()` says so
    ir = None

UNPACKED = 32  # values a vector run decodes: 16 bytes of a 4-bit band, 8 of a 2-bit one
ROW_LANES = 16  # query rows a vector holds (fp32): `lane_dots`
CHAINS = 4  # its sums kept side by side: a multiply-add's latency is about four of its issue slots

if ir is not None:

    class BFloat(ir.Type):
        """LLVM's `bfloat`, which llvmlite's IR builder does not name."""

        def _to_string(self) -> str:
            return "bfloat"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, BFloat)

        def __hash__(self) -> int:
            return hash("bfloat")

    def ir_at(builder, addr, offset, kind):
        """LLVM IR: a pointer to `kind` at the integer address addr + offset (intrinsics' raw addresses)."""
        return builder.inttoptr(builder.add(addr, offset), kind.as_pointer())

    def ir_splat(builder, word, vector):
        """LLVM IR: the scalar `word` in every lane of the vector type `vector`."""
        one = builder.insert_element(ir.Constant(vector, ir.Undefined), word, ir.Constant(ir.IntType(32), 0))
        lanes = ir.Constant(ir.VectorType(ir.IntType(32), vector.count), [0] * vector.count)
        return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), lanes)

    def ir_loop(builder, trip, first, body):
        """LLVM IR of a counted loop over i < trip (an i64 value, at least 1) carrying the values `first`
        through `body(i, values) -> values`; the last values, with the builder after the loop."""
        i64 = ir.IntType(64)
        entry = builder.block
        loop, done = builder.append_basic_block("loop"), builder.append_basic_block("loop_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), entry)
        carried = []
        for value in first:
            phi = builder.phi(value.type)
            phi.add_incoming(value, entry)
            carried.append(phi)
        new = body(i, carried)
        nxt = builder.add(i, ir.Constant(i64, 1))
        end = builder.block
        i.add_incoming(nxt, end)
        for phi, value in zip(carried, new, strict=True):
            phi.add_incoming(value, end)
        builder.cbranch(builder.icmp_signed("<", nxt, trip), loop, done)
        builder.position_at_end(done)
        return new

    def _unpack_codegen(bits: int):
        """LLVM IR decoding 32 // (8 // bits) bytes of `bits`-bit codes into UNPACKED fp32 values."""
        per = 8 // bits
        nbytes = UNPACKED // per

        def codegen(context, builder, signature, args):
            src, step, dst = args
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vi = ir.VectorType(i32, nbytes)
            vf = ir.VectorType(f32, nbytes)
            zero = ir.Constant(i64, 0)
            packed = builder.load(ir_at(builder, src, zero, ir.VectorType(i8, nbytes)), align=1)
            codes = builder.zext(packed, vi)
            offset = ir.Constant(vf, [float((1 << bits) / 2 - 0.5)] * nbytes)
            scale = ir_splat(builder, step, vf)
            parts = []
            for s in range(per):
                c = builder.and_(builder.lshr(codes, ir.Constant(vi, [s * bits] * nbytes)),
                                 ir.Constant(vi, [(1 << bits) - 1] * nbytes))
                parts.append(builder.fmul(builder.fsub(builder.uitofp(c, vf), offset), scale))

            def zip_two(a, b, n):  # a[0], b[0], a[1], b[1], ... of two n-lane vectors
                lanes = [(j % 2) * n + j // 2 for j in range(2 * n)]
                return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 2 * n), lanes))

            if per == 2:
                out = zip_two(parts[0], parts[1], nbytes)
            else:  # byte i's codes 0, 1 from the first pair's zip, 2, 3 from the second's
                low, high = zip_two(parts[0], parts[1], nbytes), zip_two(parts[2], parts[3], nbytes)
                lanes = [(s // 2) * 2 * nbytes + 2 * i + s % 2 for i in range(nbytes) for s in range(4)]
                out = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, UNPACKED), lanes))
            builder.store(out, ir_at(builder, dst, zero, ir.VectorType(f32, UNPACKED)), align=4)
            return context.get_dummy_value()

        return codegen

    def _unpack_intrinsic(bits: int):
        """An intrinsic: dst[:UNPACKED] (fp32) = the `bits`-bit codes of the bytes at src, decoded as
        `sparse_attention._unpack` decodes them (addresses as 64-bit integers, step fp32)."""

        def run(typingctx, src, step, dst):
            return types.void(types.intp, types.float32, types.intp), _unpack_codegen(bits)

        run.__name__ = f"_unpack_{bits}bit"
        return intrinsic(run)

    unpack4, unpack2 = _unpack_intrinsic(4), _unpack_intrinsic(2)

    def _prefetch_codegen(context, builder, signature, args):
        i8, i32 = ir.IntType(8), ir.IntType(32)
        kind = ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
        fetch = cgutils.get_or_insert_function(builder.module, kind, "llvm.prefetch.p0")
        # a read, kept in every cache level, of data
        builder.call(fetch, [builder.inttoptr(args[0], i8.as_pointer()), ir.Constant(i32, 0),
                             ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    @intrinsic
    def prefetch(typingctx, addr):
        """Ask the cache for the line at the address `addr` (a 64-bit integer) without waiting for it."""
        return types.void(types.intp), _prefetch_codegen

    def _lane_dots_codegen(context, builder, signature, args):
        rows, values, steps, out = args
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vf = ir.VectorType(f32, ROW_LANES)
        fast = ("fast",)

        def step(i, sums):
            new = []
            for c in range(CHAINS):
                col = builder.add(builder.mul(i, ir.Constant(i64, CHAINS)), ir.Constant(i64, c))
                value = builder.load(ir_at(builder, values, builder.mul(col, ir.Constant(i64, 4)), f32))
                at = builder.mul(col, ir.Constant(i64, 4 * ROW_LANES))
                row = builder.load(ir_at(builder, rows, at, vf), align=4)
                product = builder.fmul(row, ir_splat(builder, value, vf), flags=fast)
                new.append(builder.fadd(sums[c], product, flags=fast))
            return new

        sums = ir_loop(builder, steps, [ir.Constant(vf, [0.0] * ROW_LANES)] * CHAINS, step)
        total = sums[0]
        for c in range(1, CHAINS):
            total = builder.fadd(total, sums[c], flags=fast)
        builder.store(total, ir_at(builder, out, ir.Constant(i64, 0), vf), align=4)
        return context.get_dummy_value()

    @intrinsic
    def lane_dots(typingctx, rows, values, steps, out):
        """out[l] = sum over c < CHAINS * steps of values[c] * rows[c, l], l < ROW_LANES (rows fp32
        [., ROW_LANES], values and out fp32; addresses and the step count as 64-bit integers, steps >= 1):
        the query rows as one vector's lanes, CHAINS sums side by side."""
        return types.void(types.intp, types.intp, types.intp, types.intp), _lane_dots_codegen

    def _row_sums_codegen(chunks: int):
        """LLVM IR of `row_sums` over `chunks` 16-lane column chunks."""

        def codegen(context, builder, signature, args):
            block, row_bytes, weights, tokens, acc = args
            f32, i64 = ir.FloatType(), ir.IntType(64)
            vf = ir.VectorType(f32, 16)
            fast = ("fast",)
            first = [builder.load(ir_at(builder, acc, ir.Constant(i64, 64 * c), vf), align=4)
                     for c in range(chunks)]

            def step(b, sums):
                weight = builder.load(ir_at(builder, weights, builder.mul(b, ir.Constant(i64, 4)), f32))
                weight = ir_splat(builder, weight, vf)
                row = builder.mul(b, row_bytes)
                new = []
                for c in range(chunks):
                    at = builder.add(row, ir.Constant(i64, 64 * c))
                    values = builder.load(ir_at(builder, block, at, vf), align=4)
                    new.append(builder.fadd(sums[c], builder.fmul(weight, values, flags=fast), flags=fast))
                return new

            sums = ir_loop(builder, tokens, first, step)
            for c in range(chunks):
                builder.store(sums[c], ir_at(builder, acc, ir.Constant(i64, 64 * c), vf), align=4)
            return context.get_dummy_value()

        return codegen

    def _row_sums_intrinsic(chunks: int):
        """An intrinsic: acc[:16 * chunks] += sum over b < tokens of weights[b] * block row b (fp32; the
        rows row_bytes apart), each column's sum in order over b, one sum a 16-lane chunk kept in a register
        throughout (tokens >= 1)."""

        def run(typingctx, block, row_bytes, weights, tokens, acc):
            return types.void(*([types.intp] * 5)), _row_sums_codegen(chunks)

        run.__name__ = f"row_sums_{chunks}"
        return intrinsic(run)

    row_sums_6, row_sums_4, row_sums_2, row_sums_1 = (_row_sums_intrinsic(c) for c in (6, 4, 2, 1))
