"""One S4R decode step of a layer (or of every segment of a layer) through the fused kernels.

Reference: `LowRankLayer.attend_folded` (one layer) and `SegmentedLayer._attend_globally` (segments
chosen together), which stay the eager path; `usable` says where this one applies (one query token, a
CPU, `query` scoring with one token set for every head, int8 coefficients, bf16 or fp32 tensors, a
rotary embedding with static frequencies for pre-RoPE keys). Buffers are kept per thread, shared by the
layers, and reused, grown only when the context outgrows them.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from s4r.core.int8_rebuild import int8_basis
from s4r.core.rope import angle_parts, chunk_rotations, last_answer
from s4r.kernels import jit
from s4r.kernels.jit import as_numpy
from s4r.kernels.latent_scoring import (
    combine_normalisers,
    exact_logits,
    latent_logits,
    normaliser,
    pooled_relevance,
    project_queries,
    query_rows,
)
from s4r.kernels.sparse_attention import (
    add_value_basis,
    band_arrays,
    decode_rows,
    decode_rows_int8,
    latent_key_logits,
    rebuild_work_dtype,
    rotated_key_logits,
    softmax_exact_values,
    storage_fusable,
    tail_arrays,
    weighted_value_rows,
)
from s4r.kernels.token_selection import choose_tokens

BUCKET = 128  # selected-token counts rounded up to this: a few product shapes serve every step
BLOCK = 2048  # selected tokens rebuilt at a time (one block at 5x): bounds the scratch at long contexts
# an int8 product's keys are int32 sums, twice bf16's bytes: blocks of 512 keep them in L2 for the rotation
# (a 5x step at 7,600 tokens 3% faster than in blocks of 2,048; bf16 ones 5% slower in blocks of 512)
INT8_BLOCK = 512
_NO_OUTLIERS = np.zeros(0, np.int32)


def usable(layer, query: torch.Tensor) -> bool:
    """Whether the fused step computes this layer's attention of `query` [1, Hq, q, d]."""
    cfg = layer.cfg
    if query.shape[2] != 1 or query.device.type != "cpu" or not layer._n:
        return False
    if cfg.scoring != "query" or not cfg.shared_selection or layer.query_coef is not None:
        return False
    return storage_fusable(layer)


class Scratch:
    """Named buffers (of one segment position), reused from layer to layer and regrown when a shape
    outgrows them; each name keeps the views of its last few shapes, so the shapes a step alternates
    between cost nothing."""

    SHAPES = 8  # views kept per name (a name asked at a new shape every step keeps only its latest)

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._views: dict[str, dict[tuple, tuple[torch.Tensor, np.ndarray]]] = {}

    def _view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        views = self._views.setdefault(name, {})
        hit = views.get((shape, dtype))
        if hit is not None:
            return hit
        size = math.prod(shape)
        buf = self._bufs.get(name)
        # normal tensors, also when asked under inference_mode: torch writes into some of them (`out=`),
        # which it refuses outside inference_mode for a tensor or a view made inside it
        with torch.inference_mode(False):
            if buf is None or buf.numel() < size or buf.dtype != dtype:
                buf = torch.zeros(max(size, 1) + size // 8, dtype=dtype)
                self._bufs[name] = buf
                views.clear()
            if len(views) >= self.SHAPES:
                views.clear()
            view = buf[:size].view(shape)
        hit = views[(shape, dtype)] = (view, as_numpy(view))
        return hit

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The buffer `name` as a tensor of `shape` (contents left from earlier steps)."""
        return self._view(name, shape, dtype)[0]

    def np(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> np.ndarray:
        """`get` as a numpy view (bf16 as its bits)."""
        return self._view(name, shape, dtype)[1]


_pool = threading.local()


def _scratch(position: int) -> Scratch:
    """The scratch of the `position`th segment of a step, one per thread shared by every layer: a step's
    layers run one after another, and buffers the previous layer just used are still in cache where a
    buffer of each layer's own (30 of them on the default model) is not."""
    scratches = getattr(_pool, "scratches", None)
    if scratches is None:
        scratches = _pool.scratches = []
    while len(scratches) <= position:
        scratches.append(Scratch())
    return scratches[position]


class _Storage:
    """Numpy views of what the kernels read of one layer, `as_numpy` of its tensors."""

    __slots__ = ("ck", "sk", "ek", "ev", "cv", "sv", "tk", "tsk", "tv", "tsv", "out_idx", "bits_k",
                 "widths_k", "bits_v", "widths_v")

    def __init__(self, layer) -> None:
        self.ck, self.sk, self.ek = as_numpy(layer._ck), as_numpy(layer._sk), as_numpy(layer._ek)
        self.cv, self.sv, self.ev = as_numpy(layer._cv), as_numpy(layer._sv), as_numpy(layer._ev)
        self.tk, self.tsk = tail_arrays(layer, keys=True)
        self.tv, self.tsv = tail_arrays(layer, keys=False)
        self.out_idx = _NO_OUTLIERS if layer.out_idx is None else layer.out_idx.numpy()
        self.bits_k, self.widths_k = band_arrays(layer, keys=True)
        self.bits_v, self.widths_v = band_arrays(layer, keys=False)


def _storage(layer) -> _Storage:
    """The layer's `_Storage`, kept while its tensors are the same objects (a fold, a growth or a
    truncation replaces them; nothing resizes one in place)."""
    tensors = (layer._ck, layer._sk, layer._ek, layer._ev, layer._cv, layer._sv, layer._tk, layer._tsk,
               layer._tv, layer._tsv, layer.out_idx, layer.plan_k, layer.plan_v)
    memo = getattr(layer, "_fused_storage", None)
    if memo is not None:
        kept = memo[0]
        for i in range(len(tensors)):
            if kept[i] is not tensors[i]:
                break
        else:
            return memo[1]
    views = _Storage(layer)
    layer._fused_storage = (tensors, views)
    return views


def _bases(layer) -> tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]:
    """(fp32 key blocks [H, d, rk] as numpy, the key basis transposed for the rebuild [G, rk, W], fp32
    value blocks transposed [H, rv, d], the rebuild basis' scales per key dimension [G, W] (int8; else
    empty)), kept while the bases are the same tensors and the rebuild's dtype the same."""
    int8 = layer.rebuild_int8
    memo = getattr(layer, "_fused_bases", None)
    if memo is None or memo[0] is not layer.basis_k or memo[1] is not layer.basis_v or memo[2] != int8:
        from s4r.core.subspace import head_blocks

        blocks_k = head_blocks(layer.basis_k, layer.heads).float().contiguous()
        if int8:  # codes [G, W, rk] with a scale per key dimension, as `int8_basis` quantizes
            codes, scale = int8_basis(layer.basis_k)
            rebuild, col_scale = codes.transpose(1, 2).contiguous(), scale[..., 0].contiguous().numpy()
        else:
            # keys rebuilt in the eager step's dtype (`rebuild_dtype`) where the CPU has bf16 products; in
            # fp32 where bf16 ones are emulated (tens of times slower there: BENCHMARKS.md, decode speed)
            dtype = rebuild_work_dtype(layer)
            rebuild = layer.basis_k.transpose(1, 2).to(dtype).contiguous()
            col_scale = np.zeros((rebuild.shape[0], 0), np.float32)
        blocks_v = head_blocks(layer.basis_v, layer.heads).float().transpose(1, 2).contiguous()
        memo = (layer.basis_k, layer.basis_v, int8, blocks_k.numpy(), rebuild, blocks_v.numpy(), col_scale)
        layer._fused_bases = memo
    return memo[3], memo[4], memo[5], memo[6]


def _rotations(layer, n: int, d: int):
    """(undo, cos_q, sin_q, chunk cos [C, d], chunk sin [C, d], bounds [C + 1]) of the step's query."""
    if layer.cfg.key_space != "pre_rope":
        return (False, np.ones(d, np.float32), np.zeros(d, np.float32), np.ones((1, d), np.float32),
                np.zeros((1, d), np.float32), np.array([0, n], dtype=np.int64))
    end = layer.logical if layer.query_end is None else layer.query_end
    expected = layer.cfg.rope_scoring == "expected"
    chunk = layer.cfg.rope_chunk or n

    def compute() -> tuple:
        cos_q, sin_q = layer._query_angles(end, 1, torch.device("cpu"))
        cos_q, sin_q = cos_q[0].float().numpy(), sin_q[0].float().numpy()
        rotations = chunk_rotations(layer.rope, n, chunk, end - 1 - layer.sinks) if expected else None
        if rotations is None:
            return (True, cos_q, sin_q, np.ones((1, d), np.float32), np.zeros((1, d), np.float32),
                    np.array([0, n], dtype=np.int64))
        bounds, cos, sin = rotations
        return True, cos_q, sin_q, cos.numpy(), sin.numpy(), np.asarray(bounds, dtype=np.int64)

    if not hasattr(layer.rope, "rotary"):  # frequencies that may change: no memo
        return compute()
    # every layer of a step asks the same: the numpy tables are kept once on the shared rope
    key = (end, n, d, chunk, expected, layer.sinks, layer.dtype)
    return last_answer(layer.rope, "fused_rotation_memo", key, compute)


class _Part:
    """What scoring one segment left for its attention."""

    def __init__(self, layer, scratch: Scratch, off: int, el: np.ndarray, qfull: np.ndarray) -> None:
        self.layer, self.scratch, self.off, self.el, self.qfull = layer, scratch, off, el, qfull


def attend(segments: list, query: torch.Tensor, scaling: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each segment's (fp32 output [H, M, d], logsumexp [H, M]) of `query` [1, Hq, 1, d], the stored
    tokens chosen once over every segment (for one segment: `LowRankLayer.attend_folded`)."""
    last = segments[-1]
    heads, d = last.heads, last.head_dim
    rows = query.shape[1] // heads
    nrows = heads * rows
    total_n = sum(s._n for s in segments)
    joint = _scratch(0)
    q = joint.np("query", (heads, rows, d))
    query_rows(as_numpy(query), q)
    logits = joint.np("logits", (nrows, total_n))
    scores = joint.np("scores", (total_n,))
    rowmax = joint.np("rowmax", (len(segments), nrows))
    rowsum = joint.np("rowsum", (len(segments), nrows))
    candsum = joint.np("candsum", (len(segments), nrows))
    lse, candmass = joint.np("lse", (nrows,)), joint.np("candmass", (nrows,))
    k, k_max, forced = 0, 0, 0
    for seg in segments:
        fewest, most, forced = seg.selection_bounds(local=seg is last)
        k, k_max = k + fewest, k_max + most
    cand_total = total_n - min(forced, total_n)
    parts, off = [], 0
    for i, seg in enumerate(segments):
        scratch, n, e, st = _scratch(i), seg._n, seg.exact_length, _storage(seg)
        blocks_k = _bases(seg)[0]
        lead, rk = seg.plan_k.lead, blocks_k.shape[2]
        undo, cos_q, sin_q, ccos, csin, bounds = _rotations(seg, n, d)
        chunks = ccos.shape[0]
        q8 = scratch.np("q8", (chunks, nrows, lead), torch.int8)
        full = 0 if seg.cfg.key_space == "pre_rope" else rk  # pre-RoPE keys are rebuilt, not dotted in latent
        qscale, qfull = scratch.np("qscale", (chunks, nrows)), scratch.np("qfull", (nrows, full))
        project_queries(q, cos_q, sin_q, undo, ccos, csin, blocks_k, lead, scaling, q8, qscale, qfull)
        el = scratch.np("el", (nrows, e))
        exact_logits(q, st.ek, e, scaling, el)
        latent_logits(q8, qscale, bounds, st.ck, st.sk, n, rows, logits, off)
        cand = min(max(cand_total - off, 0), n)
        normaliser(logits, off, n, el, seg.sinks, seg._n_out, e, st.out_idx, cand, rowmax[i], rowsum[i],
                   candsum[i], scratch.np("keep", (n,)))
        parts.append(_Part(seg, scratch, off, el, qfull))
        off += n
    combine_normalisers(rowmax, rowsum, candsum, lse, candmass)
    for part in parts:
        seg = part.layer
        pool = seg.cfg.pool_kernel
        pooled_relevance(logits, part.off, seg._n, lse, pool, _storage(seg).out_idx, seg._n_out,
                         part.scratch.np("pool", (seg._n + pool,)), scores)
    if (room := last._token_room(forced)) is not None:
        k, k_max = min(k, room), min(k_max, room)
    picked = joint.np("picked", (total_n,), torch.int64)
    drop = last.cfg.recon_drop
    count = choose_tokens(scores, total_n, k, k_max, forced, 0.0 if drop is None else drop, drop is not None,
                          logits, lse, candmass, joint.np("work", (2 * total_n,)), picked)
    picked = picked[:count]
    results = []
    for part in parts:
        seg = part.layer
        mine = picked
        if len(parts) > 1:  # picked is in ascending order: each segment's tokens are one run of it
            lo, hi = np.searchsorted(picked, (part.off, part.off + seg._n))
            mine = picked[lo:hi] - part.off if part.off else picked[lo:hi]
        results.append(_attend_part(part, mine, q, logits, scaling, rows))
        seg.fold_buffer()
    return results


def _blocks(k: int, block: int):
    """(start, end, padded rows) of the selected tokens' blocks: `block` at a time, the last one's rows
    rounded up to `BUCKET`, so a few product shapes serve every step."""
    for start in range(0, k, block):
        end = min(k, start + block)
        yield start, end, max(BUCKET, -(-(end - start) // BUCKET) * BUCKET)


def _attend_part(part: _Part, idx: np.ndarray, q: np.ndarray, logits: np.ndarray, scaling: float,
                 rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    seg = part.layer
    heads, d = seg.heads, seg.head_dim
    nrows = heads * rows
    k = idx.shape[0]
    seg.selected = torch.from_numpy(idx.copy()).unsqueeze(0).expand(heads, -1)
    seg.rebuilt_tokens += k
    seg.scored_tokens += seg._n
    idx = np.ascontiguousarray(idx)
    scratch, st = part.scratch, _storage(seg)
    _, rebuild_t, blocks_v, col_scale = _bases(seg)
    sel = scratch.np("sel", (nrows, max(BUCKET, -(-k // BUCKET) * BUCKET)))
    e = seg.exact_length
    if seg.cfg.key_space == "pre_rope":
        # rebuilt a block at a time, so each block's keys are still in cache when they are rotated
        groups, rk, width = rebuild_t.shape
        bits, widths, tk, tsk, ck, sk = st.bits_k, st.widths_k, st.tk, st.tsk, st.ck, st.sk
        offset = getattr(seg.rope, "offset", 0)
        coarse, fine = (t.numpy() for t in angle_parts(seg.rope.rotary, seg.sinks + seg._n + offset))
        int8 = rebuild_t.dtype == torch.int8
        row_scale = scratch.np("row_scale", (groups, 0))
        for start, end, pad in _blocks(k, INT8_BLOCK if int8 else BLOCK):
            coefs, coefs_np = scratch._view("coefs", (groups, pad, rk), rebuild_t.dtype)
            if int8:
                row_scale = scratch.np("row_scale", (groups, pad))
                decode_rows_int8(idx[start:end], end - start, ck, sk, tk, tsk, bits, widths, coefs_np,
                                 row_scale)
                sums, keys_np = scratch._view("sums", (groups, pad, width), torch.int32)
                for g in range(groups):
                    torch._int_mm(coefs[g], rebuild_t[g], out=sums[g])
            else:
                decode_rows(idx[start:end], end - start, ck, sk, tk, tsk, bits, widths, True, coefs_np)
                keys, keys_np = scratch._view("keys", (groups, pad, width), rebuild_t.dtype)
                if groups == 1:  # one 2-D product: a batched bf16 product with `out` takes a path ~10x slower
                    torch.matmul(coefs[0], rebuild_t[0], out=keys[0])
                else:
                    torch.matmul(coefs, rebuild_t, out=keys)
            rotated_key_logits(q, keys_np, idx[start:end], end - start, seg.sinks + offset, coarse, fine,
                               scaling, col_scale, row_scale, sel[:, start:end])
    else:
        lead = seg.plan_k.lead
        qtail = scratch.np("qtail", (nrows, part.qfull.shape[1] - lead))
        np.multiply(part.qfull[:, lead:], np.float32(scaling), out=qtail)
        latent_key_logits(logits, part.off, idx, k, qtail, st.tk, st.tsk, st.bits_k, st.widths_k, rows, sel)
    out = torch.empty(heads, rows, d)
    lse = torch.empty(heads, rows)
    out_np = out.numpy()
    softmax_exact_values(part.el, e, sel, k, st.ev, out_np, lse.view(-1).numpy())
    if k:
        groups_v, rv = seg._cv.shape[0], blocks_v.shape[1]
        z = scratch.np("z", (groups_v, nrows // groups_v, rv))
        weighted_value_rows(sel, idx, k, st.cv, st.sv, st.tv, st.tsv, st.bits_v, st.widths_v, z)
        add_value_basis(z.reshape(nrows, rv), blocks_v, out_np)
    return out, lse


def attend_layer(layer, query: torch.Tensor, scaling: float,
                 with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`LowRankLayer.attend_folded` through the fused kernels, or None where they do not apply (or
    failed, after which the eager path runs for the rest of the process)."""
    if not usable(layer, query):
        return None
    try:
        out, lse = attend([layer], query, scaling)[0]
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here: eager from now on
        jit.mark_failed(exc)
        return None
    return out, (lse if with_lse else None)


def attend_segmented(segments: list, query: torch.Tensor,
                     scaling: float) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """`SegmentedLayer._attend_globally` through the fused kernels, or None where they do not apply."""
    if not all(usable(s, query) for s in segments):
        return None
    try:
        return attend(segments, query, scaling)
    except Exception as exc:  # noqa: BLE001
        jit.mark_failed(exc)
        return None
