"""numba plumbing the kernels share: availability (one line logged, once, and the instructions numba
compiles for), the compile decorator, bit casts, bf16 widening/rounding, a vectorizable exp, a row maximum,
rotary angles composed from two tables, a rebuilt key turned by them and the query's logits on such keys.
The LLVM IR pieces of the kernels that emit instructions themselves: `s4r.kernels.intrinsics`.

Kernels take bf16 tensors as their raw 16-bit patterns (numba has no bf16 type): bf16 is the top half of
an fp32, so widening is a shift and a bit cast (`as_f32`), which LLVM vectorizes along a contiguous axis.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from types import FunctionType

import numpy as np
import torch

log = logging.getLogger("s4r.kernels")

try:  # the kernels' only dependency beyond torch; without it every caller keeps its eager path
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - exercised where numba is absent
    numba = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

_state: dict = {"warned": False, "failed": False}
prange = numba.prange if numba is not None else range  # a kernel's loop over its parts (`split_kernel`)
# reassociation lets sums vectorize; no `arcp` (a division must round as torch's does, e.g. the int8
# quantization of a query) and no `ninf`/`nnan` (masked scores are -inf)
FASTMATH = {"reassoc", "contract", "nsz"}


def warn_once(reason: str) -> None:
    """Log the one line saying the fused kernels are off and why (only the first time)."""
    if not _state["warned"]:
        _state["warned"] = True
        log.warning("s4r: fused CPU kernels off (%s); using the eager path", reason)


def available() -> bool:
    """Whether the fused kernels can run here (numba imported and no kernel failed to compile)."""
    if numba is None:
        warn_once(f"numba unavailable: {_IMPORT_ERROR}")
        return False
    if os.environ.get("S4R_KERNELS", "").lower() == "eager":
        return False
    return not _state["failed"]


def bf16_instructions() -> bool:
    """Whether the fused kernels run here and the CPU numba compiles for has AVX512-BF16 (`vdpbf16ps`):
    the bf16 kernels (`bf16_products`, `bf16_matvec`) run, unless `S4R_BF16_PRODUCTS=0` keeps torch's or
    fp32 products."""
    if os.environ.get("S4R_BF16_PRODUCTS") == "0":
        return False
    return compiles_for("avx512f", "avx512bf16") and available()


def mark_failed(exc: BaseException) -> None:
    """A kernel failed to compile or run: fused kernels stay off for this process."""
    _state["failed"] = True
    warn_once(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def kernel(fn: Callable) -> Callable:
    """numba's `njit` as every kernel uses it: cached on disk, reassociated sums (`FASTMATH`)."""
    if numba is None:
        return fn
    return numba.njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy")(fn)


# `prange` loops only: numba's other parallel rewrites would turn a kernel's array fills and allocations into
# thread launches of their own
_PARALLEL = {"prange": True, "comprehension": False, "reduction": False, "inplace_binop": False,
             "setitem": False, "numpy": False, "stencil": False, "fusion": False}


def split_kernel(fn: Callable) -> Callable:
    """`kernel` for a kernel whose last argument `parts` splits its work (a `prange` loop over the parts):
    one part runs a serial build, where `prange` is a plain loop; more run a parallel build, one part a
    thread of numba's threading layer, compiled at its first call (it takes longer to compile)."""
    if numba is None:
        return fn
    serial = kernel(fn)
    twin = FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_split", fn.__defaults__)
    twin.__qualname__ = fn.__qualname__ + "_split"  # its own entry in numba's disk cache
    parallel = numba.njit(cache=True, fastmath=FASTMATH, nogil=True, error_model="numpy",
                          parallel=_PARALLEL)(twin)

    @functools.wraps(fn)
    def run(*args):
        return (parallel if args[-1] > 1 else serial)(*args)

    run.serial = serial  # what a compiled caller calls with one part
    return run


def parts() -> int:
    """How many parts the fused step splits its largest kernels into: torch's intra-op thread count where
    numba runs its threads on OpenMP, else 1 (its own work queue, interleaved with torch's pool, ran slower
    here than one thread). Numba's thread count follows torch's; one part never starts its threads."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS) if numba is not None else 1
    if threads <= 1:
        return 1
    if "layer" not in _state:
        try:
            _probe(np.zeros(2), 2)
            _state["layer"] = numba.threading_layer()
        except Exception as exc:  # noqa: BLE001 - no threading layer loads here: one part
            _state["layer"] = None
            log.info("s4r: fused kernels on one thread (%s)", exc)
    if _state["layer"] != "omp":
        return 1
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


def inline(fn: Callable) -> Callable:
    """A helper inlined into the kernels that call it."""
    if numba is None:
        return fn
    return numba.njit(cache=True, fastmath=FASTMATH, inline="always", error_model="numpy")(fn)


def cpu_flags() -> list[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    if "flags" not in _state:
        try:
            with open("/proc/cpuinfo") as f:
                _state["flags"] = next((line for line in f if line.startswith("flags")), "").split()
        except OSError:
            _state["flags"] = []
    return _state["flags"]


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), where oneDNN's bf16 products
    outrun its fp32 ones; without them (AVX2) they run tens of times slower (BENCHMARKS.md, decode speed)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def int8_products() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI or AMX-INT8) and torch's int8 matrix
    product (`torch._int_mm`) runs here: twice oneDNN's bf16 rate without AMX-BF16, about half with it."""
    if "int8_products" not in _state:
        flags = cpu_flags()
        ok = any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))
        if ok:
            try:
                ones = torch.ones(32, 32, dtype=torch.int8)
                ok = int(torch._int_mm(ones, ones)[0, 0]) == 32
            except Exception:  # noqa: BLE001 - a torch without the CPU int8 product
                ok = False
        _state["int8_products"] = ok
    return bool(_state["int8_products"])


VNNI = ("avx512f", "avx512bw", "avx512vnni")  # the LLVM features the int8 dot-product kernels need


def compiles_for(*features: str) -> bool:
    """Whether the CPU numba compiles for has every LLVM feature named (`avx512vnni`, `avx512bf16`): the
    host's, never where NUMBA_CPU_NAME or NUMBA_CPU_FEATURES name another target (it may lack them; LLVM
    aborts, not raises, compiling an instruction for a CPU without it)."""
    if features not in _state:
        ok = False
        named = os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES")
        if numba is not None and not named:
            from llvmlite import binding

            try:
                host = binding.get_host_cpu_features()
                ok = all(host.get(f, False) for f in features)
            except RuntimeError:  # no feature list on this host
                ok = False
        _state[features] = ok
    return bool(_state[features])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor; bf16 as uint16 bit patterns (widened by `as_f32`)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


if numba is not None:

    @intrinsic
    def u32_as_f32(typingctx, x):
        """The float32 whose bits are the uint32 `x`."""
        sig = types.float32(types.uint32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen

    @intrinsic
    def f32_as_u32(typingctx, x):
        """The bits of the float32 `x` as a uint32."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    def as_f32(x):  # pragma: no cover - replaced by its overload inside kernels
        """float32 of a stored element: bf16 bits (uint16) widened, anything else converted."""
        raise NotImplementedError

    @overload(as_f32, inline="always")
    def _as_f32(x):
        if x == types.uint16:
            return lambda x: u32_as_f32(np.uint32(x) << np.uint32(16))
        return lambda x: np.float32(x)

    @inline
    def round_bf16(x):
        """The bf16 bits (uint16) of float32 `x`, rounded to nearest even as torch rounds."""
        bits = f32_as_u32(np.float32(x))
        bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return np.uint16(bits >> np.uint32(16))

    @inline
    def pair(a, b):
        """The uint32 word of two bf16 values (`round_bf16` of float32 a, the low half, and of b)."""
        return np.uint32(round_bf16(a)) | (np.uint32(round_bf16(b)) << np.uint32(16))

    @inline
    def fast_exp(x):
        """exp(x) in float32 for x <= 0 (relative error below 5e-6; 0 below -80, whose products would be slow
        denormals), a polynomial of 2^frac times a power of two from its exponent bits: it vectorizes."""
        x = max(np.float32(x), np.float32(-87.0))
        t = x * np.float32(1.4426950408889634)
        i = np.int32(t)  # truncation toward zero: frac in (-1, 0]
        f = t - np.float32(i)
        p = np.float32(1.5252734e-5) * f + np.float32(1.5403530e-4)
        p = p * f + np.float32(1.3333558e-3)
        p = p * f + np.float32(9.6181291e-3)
        p = p * f + np.float32(5.5504109e-2)
        p = p * f + np.float32(2.4022651e-1)
        p = p * f + np.float32(6.9314718e-1)
        p = p * f + np.float32(1.0)
        big = x > np.float32(-80.0)
        return p * u32_as_f32(np.uint32(i + 127) << np.uint32(23)) if big else np.float32(0.0)


LANES = 64  # running maxima kept side by side: a single running maximum waits on each compare


@inline
def largest(x, n, lanes):
    """max(x[:n]) (-inf for none), as LANES running maxima over whole blocks, then the rest; `lanes`: a
    float32 scratch of LANES (a kernel allocates it once)."""
    for u in range(LANES):
        lanes[u] = -np.inf
    whole = n - n % LANES
    for t0 in range(0, whole, LANES):
        block = x[t0 : t0 + LANES]
        for u in range(LANES):
            v = block[u]
            lanes[u] = v if v > lanes[u] else lanes[u]
    m = np.float32(-np.inf)
    for u in range(LANES):
        m = max(m, lanes[u])
    for t in range(whole, n):
        m = max(m, x[t])
    return m


@inline
def fine_shift(fine):
    """log2 of the fine table's rows (`rope.angle_parts`): position p's rows are p >> s and p & (2^s - 1)."""
    shift = 0
    while (1 << shift) < fine.shape[0]:
        shift += 1
    return shift


@inline
def compose_angles(p, coarse, fine, shift, half, ang):
    """ang [2 * half] = position p's angles (cos of the pairs, then sin) from its coarse and fine rows."""
    a, b = coarse[p >> shift], fine[p & (fine.shape[0] - 1)]
    for i in range(half):
        ca, sa, cb, sb = a[i], a[half + i], b[i], b[half + i]
        ang[i] = ca * cb - sa * sb
        ang[half + i] = sa * cb + ca * sb


@inline
def rotated_row(src, factor, cols, ang, half, width, row, rot):
    """rot [W] = the rebuilt key src [W] (int32 sums or values) widened, scaled by factor * cols and turned
    by the angles ang (`compose_angles`), each d-column head alike; `row`: a float32 scratch of W."""
    d = 2 * half
    for i in range(width):
        row[i] = as_f32(src[i]) * (factor * cols[i])
    for base in range(0, width, d):
        for i in range(half):
            x1, x2 = row[base + i], row[base + half + i]
            c, s = ang[i], ang[half + i]
            rot[base + i] = x1 * c - x2 * s
            rot[base + half + i] = x2 * c + x1 * s


@inline
def rotated_logits(q, keys, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out, half):
    """`rotated_key_logits` with the head size's half a constant (the kernels' common sizes: 32, 64)."""
    heads, rows = q.shape[0], q.shape[1]
    d = 2 * half
    shift = fine_shift(fine)
    shared = keys.shape[0] == 1
    scaled = col_scale.shape[1] > 0
    ang = np.empty(d, np.float32)
    rot = np.empty(d, np.float32)
    for j in range(k):
        compose_angles(idx[j] + pos0, coarse, fine, shift, half, ang)
        for h in range(heads):
            g = 0 if shared else h
            base = h * d if shared else 0
            for i in range(half):
                x1 = as_f32(keys[g, j, base + i])
                x2 = as_f32(keys[g, j, base + half + i])
                if scaled:
                    x1 *= col_scale[g, base + i]
                    x2 *= col_scale[g, base + half + i]
                c, s = ang[i], ang[half + i]
                rot[i] = x1 * c - x2 * s
                rot[half + i] = x2 * c + x1 * s
            factor = np.float32(scaling) * row_scale[g, j] if scaled else np.float32(scaling)
            for m in range(rows):
                acc = np.float32(0.0)
                for i in range(d):
                    acc += q[h, m, i] * rot[i]
                out[h * rows + m, j] = acc * factor


@split_kernel
def _probe(x, parts):
    """A parallel loop that loads numba's threading layer (`parts`)."""
    for p in prange(parts):
        x[p] = p
