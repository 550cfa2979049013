"""One token's exact attention over a full bf16 cache in one pass per KV head (numba, CPU): the `full`
cache's decode step, its keys dotted by the AVX512-BF16 instruction (`vdpbf16ps`) and its values summed
under their probabilities in registers, reading each stored row once.

A decode step's exact attention is bound by the cache's bytes. Per KV head the group's query rows share
every key and value row: the logits of a block of keys (kept in L1 for the group's rows), one softmax,
then each value row widened once and added into the group's fp32 sums. Each KV head's tokens split into
`parts` ranges, one a thread, whose partial softmaxes merge at the end (as flash decoding merges them).

Reference: `s4r.hf.attention.causal_attention` (torch's SDPA or its matrix products) over the same keys and
values; the two differ by the order of fp32 additions and this kernel's `fast_exp`. Tests compare them.
"""

from __future__ import annotations

import numpy as np
import torch

from s4r.kernels import jit
from s4r.kernels.jit import LANES, as_f32, as_numpy, fast_exp, inline, largest, numba, prange, split_kernel

KEY_BLOCK = 256  # keys whose logits the group's rows take in turn: 32 KiB of 64-wide bf16 rows, in L1
COLUMNS = 64  # value columns one run of the weighted sum holds in registers (four 16-lane sums a row)
GROUP = 4  # query rows one run serves: at most 16 registers of sums
KEYS = 16  # keys one run dots with a query row: their 16 lane sums added across into one register
SPAN_BUCKET = 1024  # the logits buffer grows in these steps, so its shape holds for many decode steps


def available() -> bool:
    """Whether the kernel runs here: the fused kernels, a CPU with AVX512-BF16, not turned off."""
    return jit.bf16_instructions()


def fusable(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `decode_attention` takes this step: one query token, bf16 on a CPU, batch 1, head width a
    multiple of 64, whole groups of query heads per KV head, keys and values of unit row stride."""
    return (query.shape[-2] == 1 and query.shape[0] == 1 and query.dtype == torch.bfloat16
            and key.dtype == torch.bfloat16 and query.device.type == "cpu"
            and query.shape[-1] % COLUMNS == 0 and query.shape[1] % key.shape[1] == 0
            and key.stride(-1) == 1 and key.stride(-2) == key.shape[-1] and available())


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from s4r.kernels.intrinsics import BFloat, ir_at, ir_loop, ir_splat
    from s4r.kernels.jit import round_bf16

    def _lane_sums(builder, vectors):
        """LLVM IR: one 16-lane vector whose lane j is the sum of the 16 lanes of vectors[j] (16 vectors):
        pairs' halves shuffled apart and added, four times, each time halving the lanes a sum spans."""
        lanes = ir.VectorType(ir.IntType(32), 16)
        span = 16
        while len(vectors) > 1:
            half = span // 2
            lo = [s * span + i for s in range(16 // span) for i in range(half)]
            hi = [s * span + half + i for s in range(16 // span) for i in range(half)]
            low = ir.Constant(lanes, lo + [16 + j for j in lo])
            high = ir.Constant(lanes, hi + [16 + j for j in hi])
            paired = [builder.fadd(builder.shuffle_vector(x, y, low), builder.shuffle_vector(x, y, high))
                      for x, y in zip(vectors[0::2], vectors[1::2], strict=True)]
            vectors, span = paired, half
        return vectors[0]

    def _dots_codegen(context, builder, signature, args):
        keys, key_row, x, chunks, out, scale = args
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        vf, vi, vb = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(BFloat(), 32)
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vb, vb]),
                                             "llvm.x86.avx512bf16.dpbf16ps.512")

        def step(c, acc):
            at = builder.mul(c, ir.Constant(i64, 64))
            xs = builder.bitcast(builder.load(ir_at(builder, x, at, vi), align=2), vb)
            new = []
            for r in range(KEYS):
                row = builder.add(builder.mul(ir.Constant(i64, r), key_row), at)
                ks = builder.bitcast(builder.load(ir_at(builder, keys, row, vi), align=2), vb)
                new.append(builder.call(dot, [acc[r], ks, xs]))
            return new

        acc = ir_loop(builder, chunks, [ir.Constant(vf, [0.0] * 16)] * KEYS, step)
        sums = builder.fmul(_lane_sums(builder, acc), ir_splat(builder, scale, vf))
        builder.store(sums, ir_at(builder, out, ir.Constant(i64, 0), vf), align=4)
        return context.get_dummy_value()

    @intrinsic
    def _dots(typingctx, keys, key_row, x, chunks, out, scale):
        """out[0:16] (fp32) = scale * key rows r < 16 (bf16, at keys + r * key_row) dotted with x (bf16)
        over their first 32 * chunks values (chunks >= 1; addresses and sizes as 64-bit integers)."""
        return types.void(*([types.intp] * 5), types.float32), _dots_codegen

    def _weighted_codegen(queries: int):
        """LLVM IR: sums[g, 0:64] += p[g, t] * row t of the values (widened from bf16) over t < n, for
        g < queries."""

        def codegen(context, builder, signature, args):
            values, value_row, probs, prob_row, n, sums, sum_row = args
            i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
            vf, vh, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 16), ir.VectorType(i32, 16)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]),
                                                 "llvm.fma.v16f32")
            shift = ir.Constant(vi, [16] * 16)

            def step(t, acc):
                row, prob = builder.mul(t, value_row), builder.mul(t, ir.Constant(i64, 4))
                wide = []
                for c in range(COLUMNS // 16):
                    at = builder.add(row, ir.Constant(i64, 32 * c))
                    half = builder.load(ir_at(builder, values, at, vh), align=2)
                    wide.append(builder.bitcast(builder.shl(builder.zext(half, vi), shift), vf))
                new = list(acc)
                for g in range(queries):
                    at = builder.add(builder.mul(ir.Constant(i64, g), prob_row), prob)
                    p = ir_splat(builder, builder.load(ir_at(builder, probs, at, f32)), vf)
                    for c in range(COLUMNS // 16):
                        new[4 * g + c] = builder.call(fma, [p, wide[c], acc[4 * g + c]])
                return new

            at = [builder.add(builder.mul(ir.Constant(i64, g), sum_row), ir.Constant(i64, 64 * c))
                  for g in range(queries) for c in range(COLUMNS // 16)]
            first = [builder.load(ir_at(builder, sums, a, vf), align=4) for a in at]
            last = ir_loop(builder, n, first, step)
            for a, acc in zip(at, last, strict=True):
                builder.store(acc, ir_at(builder, sums, a, vf), align=4)
            return context.get_dummy_value()

        return codegen

    def _weighted_intrinsic(queries: int):
        """An intrinsic: `queries` rows of 64 fp32 sums (at `sums`, rows `sum_row` bytes apart) plus the
        probability-weighted value rows t < n (n >= 1; bf16 rows `value_row` bytes apart, probabilities
        fp32 rows `prob_row` bytes apart); addresses and sizes as 64-bit integers."""

        def run(typingctx, values, value_row, probs, prob_row, n, sums, sum_row):
            return types.void(*([types.intp] * 7)), _weighted_codegen(queries)

        run.__name__ = f"_weighted_{queries}"
        return intrinsic(run)

    _weighted = [_weighted_intrinsic(g) for g in range(1, GROUP + 1)]
    _weighted1, _weighted2, _weighted3, _weighted4 = _weighted
else:  # pragma: no cover
    def _weighted1(*args):
        raise RuntimeError("numba is not available")

    _weighted2 = _weighted3 = _weighted4 = _weighted1


@inline
def _weighted_rows(at_v, value_row, at_p, prob_row, n, at_s, sum_row, queries):
    """`queries` (1-4) rows of sums plus their weighted value rows: the intrinsic of that row count."""
    if queries == 4:
        _weighted4(at_v, value_row, at_p, prob_row, n, at_s, sum_row)
    elif queries == 3:
        _weighted3(at_v, value_row, at_p, prob_row, n, at_s, sum_row)
    elif queries == 2:
        _weighted2(at_v, value_row, at_p, prob_row, n, at_s, sum_row)
    else:
        _weighted1(at_v, value_row, at_p, prob_row, n, at_s, sum_row)


@inline
def _logits(q, k, t0, t1, scaling, lg):
    """lg[g, t - t0] = scaling * q[g] . k[t] for t0 <= t < t1: a block of keys at a time, every query row
    of the group over it while it is in L1, 16 keys a run."""
    width = q.shape[1]
    chunks, at_k, row = np.intp(width // 32), np.intp(k.ctypes.data), np.intp(k.strides[0])
    for b0 in range(t0, t1, KEY_BLOCK):
        b1 = min(t1, b0 + KEY_BLOCK)
        for g in range(q.shape[0]):
            at_q = np.intp(q[g].ctypes.data)
            t = b0
            while t + KEYS <= b1:
                _dots(at_k + t * row, row, at_q, chunks, np.intp(lg[g, t - t0 :].ctypes.data), scaling)
                t += KEYS
            for u in range(t, b1):  # the block's last keys short of a run
                acc = np.float32(0.0)
                for i in range(width):
                    acc += as_f32(q[g, i]) * as_f32(k[u, i])
                lg[g, u - t0] = acc * scaling


@inline
def _part(q, k, v, t0, t1, scaling, lg, top, total, acc):
    """One range of one KV head's tokens: its logits, their softmax's maximum `top` and sum `total` per
    query row, and the rows' unnormalized value sums `acc` [G, D]."""
    group, width = q.shape
    acc[:] = 0.0
    if t1 <= t0:
        top[:] = -np.inf
        total[:] = 0.0
        return
    _logits(q, k, t0, t1, scaling, lg)
    n = t1 - t0
    lanes = np.empty(LANES, np.float32)
    for g in range(group):
        row = lg[g]
        m = largest(row, n, lanes)
        s = np.float32(0.0)
        for t in range(n):
            p = fast_exp(row[t] - m)
            row[t] = p
            s += p
        top[g], total[g] = m, s
    value_row, prob_row, sum_row = np.intp(v.strides[0]), np.intp(lg.strides[0]), np.intp(acc.strides[0])
    for c in range(0, width, COLUMNS):
        for g0 in range(0, group, GROUP):
            _weighted_rows(np.intp(v[t0, c:].ctypes.data), value_row, np.intp(lg[g0].ctypes.data), prob_row,
                           np.intp(n), np.intp(acc[g0, c:].ctypes.data), sum_row, min(GROUP, group - g0))


@split_kernel
def decode_attention(q, k, v, n, span, scaling, out, lg, top, total, acc, parts):
    """out [H, G, D] (bf16 bits) = one token's exact attention of the query rows q [H, G, D] (bf16 bits; G
    rows share KV head h) over the first n keys and values k, v [H, >=n, D] (bf16 bits), each head's tokens
    split into `parts` ranges of `span` (parts * span >= n). Scratch: lg [H * parts, G, >= span] fp32
    logits, top and total [H * parts, G] (top left holding each part's rescale factor), acc
    [H * parts, G, D]; 64 | D."""
    heads = q.shape[0]
    for w in prange(heads * parts):
        h, p = w // parts, w % parts
        t0, t1 = min(n, p * span), min(n, (p + 1) * span)
        _part(q[h], k[h], v[h], t0, t1, np.float32(scaling), lg[w], top[w], total[w], acc[w])
    for h in range(heads):
        for g in range(q.shape[1]):
            m = np.float32(-np.inf)
            for p in range(parts):
                m = max(m, top[h * parts + p, g])
            s = np.float32(0.0)
            for p in range(parts):  # each part's maximum becomes its rescale factor, made once
                factor = fast_exp(top[h * parts + p, g] - m)
                top[h * parts + p, g] = factor
                s += total[h * parts + p, g] * factor
            inv = np.float32(1.0) / s
            for i in range(q.shape[2]):
                x = np.float32(0.0)
                for p in range(parts):
                    x += acc[h * parts + p, g, i] * top[h * parts + p, g]
                out[h, g, i] = round_bf16(x * inv)


def fused_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                           scratch) -> torch.Tensor:
    """`causal_attention` of one query token over every key (`fusable` holds) by `decode_attention`.
    query [1, Hq, 1, D]; key/value [1, H, S, D] views of a cache's buffers; `scratch`: a
    `kernels.scratch.Scratch` for the logits and the parts' sums. Returns [1, Hq, 1, D] bf16."""
    _, q_heads, _, width = query.shape
    heads, n = key.shape[1], key.shape[2]
    group, parts = q_heads // heads, jit.parts()
    rows = query.reshape(heads, group, width).contiguous()
    span = -(-n // (parts * 4)) * 4  # a multiple of 4 tokens a part
    work = heads * parts
    lg = scratch.np("full_logits", (work, group, -(-span // SPAN_BUCKET) * SPAN_BUCKET))
    top, total = scratch.np("full_top", (work, group)), scratch.np("full_total", (work, group))
    acc = scratch.np("full_sums", (work, group, width))
    out = torch.empty(heads, group, width, dtype=torch.bfloat16)
    decode_attention(as_numpy(rows), as_numpy(key[0]), as_numpy(value[0]), n, span, scaling, as_numpy(out),
                     lg, top, total, acc, parts)
    return out.view(1, q_heads, 1, width)
