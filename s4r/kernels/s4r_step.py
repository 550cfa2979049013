"""One S4R decode step of a layer (or of every segment of a layer) through the fused kernels.

Reference: `LowRankLayer.attend_folded` (one layer) and `SegmentedLayer._attend_globally` (segments
chosen together), which stay the eager path; `usable` says where this one applies (one query token or a
block of at most `query_window`, a CPU, `query` scoring with one token set for every head, int8
coefficients, bf16 or fp32 tensors, a rotary embedding with static frequencies for pre-RoPE keys).
Buffers are kept per thread, shared by the layers (`s4r.kernels.scratch`); what the kernels read of a
layer is kept on it (`_Views`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from s4r.core.int8_rebuild import int8_basis
from s4r.core.rope import ANGLE_STEP, angle_parts
from s4r.core.subspace import head_blocks
from s4r.kernels import amx_products, bf16_products, jit, vnni_keys, vnni_scoring
from s4r.kernels.bf16_products import key_pair_logits, value_pair_rows
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
from s4r.kernels.layer_arrays import band_arrays, rebuild_work_dtype, storage_fusable, tail_arrays
from s4r.kernels.query_blocks import (
    PRODUCT_ROWS,
    add_value_basis_product,
    exact_logits_product,
    exact_products,
    exact_values_product,
    key_logits_product,
    mask_later_tokens,
    rotate_keys,
    value_rows_product,
    window_rows,
)
from s4r.kernels.query_rotations import query_rotations
from s4r.kernels.rotated_keys import rotated_key_logits
from s4r.kernels.scratch import Scratch, thread_scratch
from s4r.kernels.sparse_attention import decode_rows, decode_rows_int8, latent_key_logits, weighted_value_rows
from s4r.kernels.step_output import add_value_basis, softmax_exact_values
from s4r.kernels.token_selection import choose_tokens
from s4r.kernels.vnni_keys import vnni_key_logits
from s4r.kernels.vnni_scoring import vnni_latent_logits

BUCKET = 128  # selected-token counts rounded up to this: a few product shapes serve every step
BLOCK = 2048  # selected tokens rebuilt at a time (one block at 5x): bounds the scratch at long contexts
# the least work split over threads: below it a split gained nothing measurable (BENCHMARKS.md, "Two threads")
SPLIT_SCORED, SPLIT_SELECTED = 16384, 1024  # stored tokens scored, selected tokens rebuilt
_NO_OUTLIERS = np.zeros(0, np.int32)


def usable(layer, query: torch.Tensor) -> bool:
    """Whether the fused step computes this layer's attention of `query` [1, Hq, q, d]."""
    return _usable_views(layer, query) is not None


def _usable_views(layer, query: torch.Tensor) -> _Views | None:
    """The layer's `_Views` where the fused step computes its attention of `query`, else None. A block of
    queries shares one selection, scored by its last queries as the eager step's (`scoring_queries`); one
    of more than `query_window` queries only where the keys are rebuilt (post-RoPE keys take every row's
    logits from the scoring)."""
    positions = query.shape[2]
    if not positions or query.device.type != "cpu" or not layer._n:
        return None
    views = _views(layer)
    if positions > layer.cfg.query_window and not (views.fusable and views.pre_rope):
        return None
    return views if views.fusable and jit.available() else None


def _fusable(layer) -> bool:
    """`usable`'s checks of the layer's settings and storage (those `_Views` keeps)."""
    cfg = layer.cfg
    if cfg.scoring != "query" or not cfg.shared_selection or layer.query_coef is not None:
        return False
    return storage_fusable(layer)


def _key(layer) -> tuple:
    """What `_Views` depends on, as the objects themselves (a fold, a growth or a truncation replaces a
    tensor; nothing resizes one in place)."""
    return (layer._ck, layer._sk, layer._ek, layer._ev, layer._cv, layer._sv, layer._tk, layer._tsk,
            layer._tv, layer._tsv, layer.out_idx, layer.plan_k, layer.plan_v, layer.basis_k, layer.basis_v,
            layer.cfg, layer.rope, layer.query_coef, layer.dtype)


class _Views:
    """What the kernels read of one layer (numpy views of its storage, its bases as the kernels take
    them) and the settings of its step, kept while `_key` is the same: a step asks for them once and
    then reads attributes."""

    def __init__(self, layer, key: tuple) -> None:
        self.key, self.fusable = key, _fusable(layer)
        if not self.fusable:
            return
        cfg = layer.cfg
        self.ck, self.sk, self.ek = as_numpy(layer._ck), as_numpy(layer._sk), as_numpy(layer._ek)
        self.vnni_scoring = vnni_scoring.available() and self.ck.strides[2] == 1  # its tokens of unit stride
        self.cv, self.sv, self.ev = as_numpy(layer._cv), as_numpy(layer._sv), as_numpy(layer._ev)
        self.tk, self.tsk = tail_arrays(layer, keys=True)
        self.tv, self.tsv = tail_arrays(layer, keys=False)
        self.out_idx = _NO_OUTLIERS if layer.out_idx is None else layer.out_idx.numpy()
        self.bits_k, self.widths_k = band_arrays(layer, keys=True)
        self.bits_v, self.widths_v = band_arrays(layer, keys=False)
        self.int8 = layer.rebuild_int8
        self.blocks_k = head_blocks(layer.basis_k, layer.heads).float().transpose(1, 2).contiguous().numpy()
        self.packed = self.start = None  # the basis as `vnni_key_logits` reads it, where that kernel runs
        if self.int8:  # codes [G, W, rk] with a scale per key dimension, as `int8_basis` quantizes
            codes, scale = int8_basis(layer.basis_k)
            rebuild, self.col_scale = codes.transpose(1, 2).contiguous(), scale[..., 0].contiguous().numpy()
            if vnni_keys.serves(rebuild.shape[2]):
                self.packed, self.start = vnni_keys.pack_basis(rebuild)
        else:
            # keys rebuilt in the eager step's dtype (`rebuild_dtype`) where the CPU has bf16 products; in
            # fp32 where bf16 ones are emulated (tens of times slower there: BENCHMARKS.md, decode speed)
            rebuild = layer.basis_k.transpose(1, 2).to(rebuild_work_dtype(layer)).contiguous()
            self.col_scale = np.zeros((rebuild.shape[0], 0), np.float32)
        self.rebuild, self.rebuild_g = rebuild, list(rebuild)
        self.groups, self.rk, self.width = rebuild.shape
        self.blocks_v = head_blocks(layer.basis_v, layer.heads).float().transpose(1, 2).contiguous().numpy()
        self.groups_v, self.rv = layer._cv.shape[0], self.blocks_v.shape[1]
        self.lead, self.pool, self.drop = layer.plan_k.lead, cfg.pool_kernel, cfg.recon_drop
        self.chunk, self.expected, self.dtype = cfg.rope_chunk, cfg.rope_scoring == "expected", layer.dtype
        self.pre_rope = cfg.key_space == "pre_rope"
        # a block's product of bf16 roundings where the model computes in bf16 (as its exact products do)
        tiles = amx_products.product if amx_products.available() else bf16_products.product
        self.bf16_products = tiles if layer.dtype == torch.bfloat16 and bf16_products.available() else None
        self.rotary = layer.rope.rotary if self.pre_rope else None
        self.offset = getattr(layer.rope, "offset", 0)
        self.angles, self.angles_upto = None, -1  # (coarse, fine) numpy tables once asked for

    def __deepcopy__(self, memo: dict) -> None:
        # a copy's numpy arrays would be frozen copies, not views of its tensors: it builds its own views
        return None

    def angle_parts(self, upto: int) -> tuple[np.ndarray, np.ndarray]:
        """`angle_parts` of the layer's rotary embedding as numpy, covering the positions up to `upto`."""
        if self.angles is None or upto > self.angles_upto:
            coarse, fine = angle_parts(self.rotary, upto)
            self.angles, self.angles_upto = (coarse.numpy(), fine.numpy()), coarse.shape[0] * ANGLE_STEP - 1
        return self.angles


def _views(layer) -> _Views:
    """The layer's `_Views`, rebuilt when any object of its `_key` changed."""
    key = _key(layer)
    memo = getattr(layer, "_fused_views", None)
    if memo is not None:
        kept = memo.key
        for i in range(len(key)):
            if kept[i] is not key[i]:
                break
        else:
            return memo
    memo = layer._fused_views = _Views(layer, key)
    return memo


def prepare_layers(parts) -> None:
    """Build ahead the `_Views` of each compressed layer or segment of `parts` the fused step may serve on
    this CPU, so a question right after a document does not wait for them; a later change of storage
    rebuilds them."""
    if jit.available():
        for seg in parts:
            if getattr(seg, "plan_k", None) is not None and seg._n and seg._ck.device.type == "cpu":
                _views(seg)


class _Part:
    """What scoring one segment left for its attention."""

    __slots__ = ("layer", "views", "scratch", "off", "el", "qfull", "products")

    def __init__(self, layer, views: _Views, scratch: Scratch, off: int, el: np.ndarray,
                 qfull: np.ndarray, products: bool) -> None:
        self.layer, self.views, self.scratch = layer, views, scratch
        self.off, self.el, self.qfull = off, el, qfull
        self.products = products  # the exact logits were products, so the exact values are too


def attend(segments: list, query: torch.Tensor, scaling: float,
           views: list[_Views] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each segment's (fp32 output [H, M, d], logsumexp [H, M]) of `query` [1, Hq, Q, d] (M = Hq / H * Q
    rows per KV head, folded as `query_rows` says), the stored tokens chosen once over every segment and
    every query (for one segment: `LowRankLayer.attend_folded`); `views`: the segments' `_views` where
    the caller has them."""
    last = segments[-1]
    heads, d, positions = last.heads, last.head_dim, query.shape[2]
    group = query.shape[1] // heads
    rows = group * positions
    views = views or [_views(s) for s in segments]
    split = jit.parts()  # the largest kernels split their work over this many threads
    total_n = sum(s._n for s in segments)
    joint = thread_scratch(0)
    q = joint.np("query", (heads, rows, d))
    query_rows(as_numpy(query), q)
    # the rows that score: the block's last queries' (every row of a decode step)
    window = last.cfg.scoring_queries(positions)
    qs = window_rows(q, heads, group, positions, window, joint.np("scoring", (heads, group * window, d)))
    srows = group * window
    nrows = heads * srows
    logits, scores = joint.np("logits", (nrows, total_n)), joint.np("scores", (total_n,))
    rowmax, rowsum, candsum = (joint.np(nm, (len(segments), nrows)) for nm in ("rowmax", "rowsum", "candsum"))
    lse, candmass = joint.np("lse", (nrows,)), joint.np("candmass", (nrows,))
    k, k_max, forced = 0, 0, 0
    for seg in segments:
        fewest, most, forced = seg.selection_bounds(local=seg is last)
        k, k_max = k + fewest, k_max + most
    cand_total = total_n - min(forced, total_n)
    parts, off = [], 0
    for i, seg in enumerate(segments):
        v, scratch, n, e = views[i], thread_scratch(i), seg._n, seg.exact_length
        undo, cos_q, sin_q, ccos, csin, bounds = query_rotations(seg, v, n, d, positions)
        chunks = ccos.shape[0]
        q8 = scratch.np("q8", (chunks, nrows, v.lead), torch.int8)
        full = 0 if v.pre_rope else v.rk  # pre-RoPE keys are rebuilt, not dotted in latent
        qscale, qfull = scratch.np("qscale", (chunks, nrows)), scratch.np("qfull", (nrows, full))
        project_queries(qs, cos_q[-window:], sin_q[-window:], undo, ccos, csin, v.blocks_k, v.lead, scaling,
                        q8, qscale, qfull)
        el = scratch.np("el", (heads * rows, e))
        products = exact_products(rows, e)
        if products:  # a document's block through the selection: its own tokens, still in the buffer
            exact_logits_product(q, v.ek, e, scaling, el, scratch.get("exact_keys", (heads, e, d)))
        else:
            exact_logits(q, v.ek, e, scaling, el)
        if positions > 1:
            mask_later_tokens(el, seg, heads, positions)
        els = window_rows(el, heads, group, positions, window, scratch.np("el_scoring", (nrows, e)))
        scored_split = split if n >= SPLIT_SCORED else 1
        score = vnni_latent_logits if v.vnni_scoring else latent_logits
        score(q8, qscale, bounds, v.ck, v.sk, n, srows, logits, off, scored_split)
        cand = min(max(cand_total - off, 0), n)
        normaliser(logits, off, n, els, seg.sinks, seg._n_out, e, v.out_idx, cand, rowmax[i], rowsum[i],
                   candsum[i], scratch.np("keep", (n,)), scored_split)
        parts.append(_Part(seg, v, scratch, off, el, qfull, products))
        off += n
    combine_normalisers(rowmax, rowsum, candsum, lse, candmass)
    for part in parts:
        seg, v = part.layer, part.views
        pooled_relevance(logits, part.off, seg._n, lse, v.pool, v.out_idx, seg._n_out,
                         part.scratch.np("pool", (seg._n + v.pool,)), scores)
    if (room := last._token_room(forced)) is not None:  # the last segment's cap holds over every segment
        k, k_max = min(k, room), min(k_max, room)
    picked = joint.np("picked", (total_n,), torch.int64)
    drop = views[-1].drop
    count = choose_tokens(scores, total_n, k, k_max, forced, 0.0 if drop is None else drop, drop is not None,
                          logits, lse, candmass, joint.np("work", (2 * total_n,)), picked)
    picked = picked[:count]
    results = []
    for part in parts:
        seg, mine = part.layer, picked
        if len(parts) > 1:  # picked is in ascending order: each segment's tokens are one run of it
            lo, hi = np.searchsorted(picked, (part.off, part.off + seg._n))
            mine = picked[lo:hi] - part.off if part.off else picked[lo:hi]
        results.append(_attend_part(part, mine, q, logits, scaling, rows, split))
        seg.fold_buffer()
    return results


def _blocks(k: int, block: int):
    """(start, end, padded rows) of the selected tokens' blocks: `block` at a time, the last one's rows
    rounded up to `BUCKET`, so a few product shapes serve every step."""
    for start in range(0, k, block):
        end = min(k, start + block)
        yield start, end, max(BUCKET, -(-(end - start) // BUCKET) * BUCKET)


def _attend_part(part: _Part, idx: np.ndarray, q: np.ndarray, logits: np.ndarray, scaling: float,
                 rows: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    seg, v, scratch = part.layer, part.views, part.scratch
    heads, d = seg.heads, seg.head_dim
    nrows = heads * rows
    k = idx.shape[0]
    split = split if k >= SPLIT_SELECTED else 1
    # a copy (contiguous): the scratch `idx` views serves the next layer, this one keeps its choice
    idx = seg.selected = idx.copy()
    seg.rebuilt_tokens += k
    seg.scored_tokens += seg._n
    sel = scratch.np("sel", (nrows, max(BUCKET, -(-k // BUCKET) * BUCKET)))
    e = seg.exact_length
    if v.pre_rope:
        # rebuilt a block at a time, so each block's keys are still in cache when they are rotated
        groups, rk, width, rebuild = v.groups, v.rk, v.width, v.rebuild
        pos0 = seg.sinks + v.offset
        coarse, fine = v.angle_parts(pos0 + seg._n)
        if v.int8:  # every selected row decoded at once, then one int8 product and rotation per block
            vnni = v.packed is not None and rows <= PRODUCT_ROWS  # or the tiles of `vnni_key_logits`
            cols = 4 * v.packed.shape[1] if vnni else rk  # it reads each row's codes by whole words
            coefs, coefs_np = scratch.view("coefs", (groups, sel.shape[1], cols), torch.int8)
            row_scale = scratch.np("row_scale", (groups, sel.shape[1]))
            decode_rows_int8(idx, k, v.ck, v.sk, v.tk, v.tsk, v.bits_k, v.widths_k, coefs_np[..., :rk],
                             row_scale, split)
            if vnni:
                tiles = scratch.np("key_tiles", (split, groups, vnni_keys.TILE, width), torch.int32)
                vnni_key_logits(q, coefs_np, v.packed, v.start, idx, k, pos0, coarse, fine, scaling,
                                v.col_scale, row_scale, sel, tiles, split)
            for start, end, pad in _blocks(0 if vnni else k, BLOCK):
                sums, keys_np = scratch.view("sums", (groups, pad, width), torch.int32)
                for g in range(groups):
                    torch._int_mm(coefs[g, start : start + pad], v.rebuild_g[g], out=sums[g])
                _key_logits(q, keys_np, idx[start:end], pos0, coarse, fine, scaling, v.col_scale,
                            row_scale[:, start:end], sel[:, start:end], scratch, v.bf16_products)
        else:
            no_scale = scratch.np("row_scale", (groups, 0))
            for start, end, pad in _blocks(k, BLOCK):
                coefs, coefs_np = scratch.view("coefs", (groups, pad, rk), rebuild.dtype)
                block = idx[start:end]
                decode_rows(block, end - start, v.ck, v.sk, v.tk, v.tsk, v.bits_k, v.widths_k, True, coefs_np)
                keys, keys_np = scratch.view("keys", (groups, pad, width), rebuild.dtype)
                if groups == 1:  # one 2-D product: a batched bf16 product with `out` takes a path ~10x slower
                    torch.matmul(coefs[0], v.rebuild_g[0], out=keys[0])
                else:
                    torch.matmul(coefs, rebuild, out=keys)
                _key_logits(q, keys_np, block, pos0, coarse, fine, scaling, v.col_scale, no_scale,
                            sel[:, start:end], scratch, v.bf16_products)
    else:
        latent_key_logits(logits, part.off, idx, k, part.qfull, v.lead, np.float32(scaling), v.tk, v.tsk,
                          v.bits_k, v.widths_k, sel)
    out_np = np.empty((heads, rows, d), np.float32)
    lse_np = np.empty((heads, rows), np.float32)
    softmax_exact_values(part.el, e, sel, k, v.ev, out_np, lse_np.reshape(-1), not part.products)
    if part.products:
        exact_values_product(part.el, e, v.ev, out_np, scratch.get("exact_values", (heads, e, d)))
    if k:
        z = scratch.np("z", (v.groups_v, nrows // v.groups_v, v.rv))
        if rows > PRODUCT_ROWS:  # a block of queries: the value rows decoded once, products a group/head
            decoded = scratch.np("value_rows", (v.groups_v, k, v.rv))
            decode_rows(idx, k, v.cv, v.sv, v.tv, v.tsv, v.bits_v, v.widths_v, False, decoded)
            if v.bf16_products:
                z = value_pair_rows(sel, k, decoded, nrows // v.groups_v, scratch.np, v.bf16_products)
            else:
                value_rows_product(sel, k, decoded, z)
            add_value_basis_product(z.reshape(nrows, v.rv), v.blocks_v, out_np)
        else:
            weighted_value_rows(sel, idx, k, v.cv, v.sv, v.tv, v.tsv, v.bits_v, v.widths_v, z, split)
            add_value_basis(z.reshape(nrows, v.rv), v.blocks_v, out_np)
    return torch.from_numpy(out_np), torch.from_numpy(lse_np)


def _key_logits(q: np.ndarray, keys: np.ndarray, idx: np.ndarray, pos0: int, coarse: np.ndarray,
                fine: np.ndarray, scaling: float, col_scale: np.ndarray, row_scale: np.ndarray,
                out: np.ndarray, scratch: Scratch, mul: Callable | None) -> None:
    """`rotated_key_logits` of the rebuilt keys of the tokens idx into out; for a block of queries' many
    rows the keys rotated once (`rotate_keys`) and one product a head (`mul`: a product of bf16 pairs)."""
    k = idx.shape[0]
    if q.shape[1] <= PRODUCT_ROWS:
        rotated_key_logits(q, keys, idx, k, pos0, coarse, fine, scaling, col_scale, row_scale, out)
    elif mul:
        key_pair_logits(q, keys, idx, pos0, coarse, fine, scaling, col_scale, row_scale, out, scratch.np, mul)
    else:
        rotated = scratch.np("rotated", (keys.shape[0], k, keys.shape[2]))
        rotate_keys(keys, idx, k, pos0, coarse, fine, col_scale, row_scale, rotated)
        key_logits_product(q, rotated, k, scaling, out)


def attend_layer(layer, query: torch.Tensor, scaling: float, with_lse: bool,
                 one_token=None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`LowRankLayer.attend_folded` through the fused kernels, or None where they do not apply (or
    failed, after which the eager path runs for the rest of the process). `one_token`: the module
    `one_token_step` (below this one's import floor, so passed in), which takes the steps it applies to."""
    if (views := _usable_views(layer, query)) is None:
        return None
    try:
        if one_token is not None and one_token.applies(views, query) and jit.parts() == 1:
            out, lse = one_token.attend_one(layer, views, query, scaling)
        else:
            out, lse = attend([layer], query, scaling, [views])[0]
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here: eager from now on
        jit.mark_failed(exc)
        return None
    return out, (lse if with_lse else None)


def attend_segmented(segments: list, query: torch.Tensor,
                     scaling: float) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """`SegmentedLayer._attend_globally` through the fused kernels, or None where they do not apply."""
    views = [_usable_views(s, query) for s in segments]
    if any(v is None for v in views):
        return None
    try:
        return attend(segments, query, scaling, views)
    except Exception as exc:  # noqa: BLE001
        jit.mark_failed(exc)
        return None
