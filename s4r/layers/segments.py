"""Appended documents with bases of their own: a cache layer made of S4R segments.

The first document's bases are fitted on its own tokens. A second document (`/read`, a second
`--file`) folded into them loses most of what those bases do not span: its needle's answer NLL rises
far above the full cache's while the first document's stays level (docs/design.md, "Appended
documents"). So a large append is collected exact in the buffer while it is prefilled
(`LowRankLayer.collecting`) and then settled
(`settle_appended`): compressed like a fresh document (hybrid sample, SVD, banded coefficients,
outliers) into a segment with its own bases, at ranks the budget solver gives its own token count, so
each segment keeps the ratio and so does the layer. Short appends (a chat turn, a small file) still
fold into the current bases.

Decode attends over every segment with one exact softmax: each segment scores and selects its own
tokens, returns its output and logsumexp, and `merge_partial_attention` weighs them by their mass.
Only the last segment takes new tokens. Segments are consecutive: a pre-RoPE segment numbers its tokens
from its own start and rotates them through its `rope` shifted there (`s4r.core.rope.shifted`), and is told
where the queries are (`query_end`), since its own length is not.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from s4r.config import S4RConfig
from s4r.core.budget import KVShape, solve_ranks
from s4r.core.compress import compress_layer, extend_layer_bases, layer_parts
from s4r.core.latent import merge_partial_attention
from s4r.core.rope import shifted
from s4r.errors import BudgetError
from s4r.hf.attention import handoff
from s4r.layers.full import CacheLayer
from s4r.layers.lowrank import LowRankLayer
from s4r.layers.lowrank_dense import attend_every_token, attends_every_token, forget_rebuilt

if TYPE_CHECKING:
    from s4r.hf.cache import CompressedCache


class SegmentedLayer(CacheLayer):
    """One layer stored as consecutive `LowRankLayer` segments, each with its own bases.

    Segment 0 holds the sinks; later segments have none. Every segment but the last has an empty
    buffer: new tokens go to the last one.
    """

    kind = "segmented"

    def __init__(self, segments: list[LowRankLayer]) -> None:
        super().__init__()
        if not segments:
            raise ValueError("a segmented layer needs at least one segment")
        self.segments = list(segments)
        self.logical = sum(s.logical for s in self.segments)

    @property
    def last(self) -> LowRankLayer:
        return self.segments[-1]

    @property
    def collecting(self) -> bool:
        return self.last.collecting

    @collecting.setter
    def collecting(self, value: bool) -> None:
        self.last.collecting = value

    @property
    def selected(self) -> list[torch.Tensor | None]:
        """Per segment, the stored tokens the last step attended (inspection)."""
        return [s.selected for s in self.segments]

    def stored_length(self) -> int:
        return sum(s.stored_length() for s in self.segments)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.segments)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self.last.update(key_states, value_states, *args, **kwargs)
        self.logical += key_states.shape[-2]
        handoff(self, keys)  # the attention must ask every segment, not only the last one
        return keys, values

    def _tell_query_end(self) -> None:
        """Each segment's `query_end`: the step's end, counted from the segment's own start."""
        start = 0
        for segment in self.segments:
            segment.query_end = self.logical - start
            start += segment.logical

    def attend(self, query, key, value, scaling):
        q_heads, q_len = query.shape[1], query.shape[2]
        self._tell_query_end()
        if attends_every_token(self.last, q_len):
            return attend_every_token(self.segments, query, scaling)
        forget_rebuilt()
        if self._global_selection():
            from s4r.kernels.s4r_step import attend_segmented

            parts = attend_segmented(self.segments, query, scaling) or self._attend_globally(query, scaling)
        else:
            parts = [s.attend_folded(query, scaling, with_lse=True) for s in self.segments]
        out = merge_partial_attention([p[0] for p in parts], [p[1] for p in parts])
        return out.to(query.dtype).reshape(1, q_heads, q_len, self.last.head_dim)

    def _global_selection(self) -> bool:
        """Whether the tokens to rebuild can be chosen over all segments at once: per-query relevance
        (comparable across segments once normalized together) and one token set for every head."""
        return all(s.cfg.scoring == "query" and s.cfg.shared_selection and s.stored_coefs
                   for s in self.segments)

    def _attend_globally(self, query: torch.Tensor,
                         scaling: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each segment's (output, logsumexp), its rebuilt tokens chosen by one top-k over every segment
        with relevance normalized over all of them, as one unsegmented layer chooses (a question about
        one document may spend the whole budget on it)."""
        exact = [s.exact_step(query, scaling) for s in self.segments]
        steps = [s.latent_step(*e, scaling) for s, e in zip(self.segments, exact, strict=True)]
        lses = [torch.logsumexp(st.window_logits, dim=-1) for st in steps]
        total = torch.logsumexp(torch.stack(lses), dim=0)  # [H, rows]: the normaliser of every token
        scores = [s.step_scores(st, total) for s, st in zip(self.segments, steps, strict=True)]
        bounds = [s.selection_bounds(local=s is self.last) for s in self.segments]
        # the local window is the last segment's tail, which is the concatenation's tail
        total_bounds = (sum(b[0] for b in bounds), sum(b[1] for b in bounds), bounds[-1][2])
        joined = torch.cat(scores, dim=-1)
        # the rows' probabilities are normalized over every segment, so they concatenate
        probs = None if any(st.probs is None for st in steps) else torch.cat([st.probs for st in steps], -1)
        chosen = self.last.choose_tokens(joined, probs, total_bounds)[0]
        parts, start = [], 0
        for segment, step, (_, exact_logits, _), sc in zip(self.segments, steps, exact, scores, strict=True):
            end = start + sc.shape[-1]
            mine = chosen[(chosen >= start) & (chosen < end)] - start
            picked = segment.selected_logits(step, mine.unsqueeze(0))
            parts.append(segment.attend_chosen(exact_logits, picked, with_lse=True))
            start = end
        return parts

    def fold_buffer(self) -> None:
        """Fold the last segment's buffer down to its cap."""
        self.last.fold_buffer()

    def drop_buffer(self) -> None:
        """Forget the last segment's buffer (see `LowRankLayer.drop_buffer`)."""
        self.logical -= self.last.buffered
        self.last.drop_buffer()

    def truncate(self, logical: int) -> None:
        forget_rebuilt()
        logical = max(0, min(self.logical, logical))
        starts = [0]
        for segment in self.segments[:-1]:
            starts.append(starts[-1] + segment.logical)
        # the segment the cut falls in becomes the last one (segment 0 stays, whatever is cut)
        keep = max(1, sum(1 for start in starts if start < logical))
        if keep < len(self.segments):
            del self.segments[keep:]
            share_bases(self.segments)  # the dropped segments' extra basis columns are freed
        self.last.truncate(logical - starts[keep - 1])
        self.logical = starts[keep - 1] + self.last.logical

    # --- persistence ------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, segment in enumerate(self.segments):
            state = segment.state()
            # an extended basis is saved as its own columns; loading puts the shared ones back in front
            state["basis_k"], state["basis_v"] = (b.contiguous() for b in segment.own_bases())
            out.update({f"{i}.{key}": t for key, t in state.items()})
        return out

    def meta_state(self) -> dict[str, Any]:
        return {"segments": [s.meta_state() for s in self.segments]}

    @classmethod
    def from_state(cls, state, meta, *, rope=None) -> SegmentedLayer:
        segments, start = [], 0
        for i, seg_meta in enumerate(meta["segments"]):
            prefix = f"{i}."
            own = {key[len(prefix):]: t for key, t in state.items() if key.startswith(prefix)}
            shared_k, shared_v = seg_meta.get("shared", (0, 0))
            if shared_k or shared_v:
                if not segments or (segments[-1].basis_k.shape[-1], segments[-1].basis_v.shape[-1]) != (
                        shared_k, shared_v):
                    raise ValueError(f"segment {i} extends bases its predecessor does not have")
                before = segments[-1]
                own["basis_k"] = torch.cat([before.basis_k, own["basis_k"]], dim=-1)
                own["basis_v"] = torch.cat([before.basis_v, own["basis_v"]], dim=-1)
            segments.append(LowRankLayer.from_state(own, seg_meta, rope=shifted(rope, start)))
            start += segments[-1].logical
        share_bases(segments)
        return cls(segments)


def share_bases(segments: list[LowRankLayer]) -> None:
    """Store each run of extended bases once: in a run of segments each extending its predecessor's basis
    (`shared_k`/`shared_v`), the last one's basis is the storage and every earlier one's a view of its
    leading columns, so `nbytes` (each segment counting its own columns) is what memory holds."""
    end = len(segments)
    while end > 0:
        first = end - 1
        while first > 0 and (segments[first].shared_k or segments[first].shared_v):
            first -= 1
        last = segments[end - 1]
        union_k, union_v = last.basis_k.clone(), last.basis_v.clone()
        for segment in segments[first:end]:
            segment.basis_k = union_k[..., : segment.basis_k.shape[-1]]
            segment.basis_v = union_v[..., : segment.basis_v.shape[-1]]
        end = first


def new_segment(keys: torch.Tensor, values: torch.Tensor, cfg: S4RConfig, shape: KVShape,
                rope, start: int = 0, spare_bytes: float = 0.0,
                before: LowRankLayer | None = None) -> LowRankLayer:
    """An appended text's keys/values [H, n, d] (post-RoPE, the first at position `start`) compressed
    into a segment of its own: no sinks, ranks the budget allows for n tokens plus `spare_bytes` (what
    the layer's earlier segments left unspent). With `segment_bases="extend"` and the segment `before`
    it, its bases begin with that segment's (stored once, see `share_bases`) and add columns fitted on
    what those leave, where the ranks allow any; else they are fitted on it alone. Raises BudgetError
    when the ratio cannot pay for its bases at this length."""
    seg_cfg = replace(cfg, sinks=0)
    n = keys.shape[1]
    rope = shifted(rope, start)
    if cfg.segment_bases == "extend" and before is not None:
        shared = (before.basis_k.shape[-1], before.basis_v.shape[-1])
        try:
            plan = solve_ranks(shape, seg_cfg, n, spare_bytes, shared)
        except BudgetError:
            plan = None
        # an extension adds columns: with none to add (fixed ranks, a tight budget) it would be a fold
        if (plan is not None and plan.rank_k >= shared[0] and plan.rank_v >= shared[1]
                and plan.rank_k + plan.rank_v > sum(shared)):
            parts = layer_parts(keys, values, seg_cfg, rope)  # the fit and the encoding share them
            bases = extend_layer_bases(keys, values, seg_cfg, rope, before.basis_k, before.basis_v,
                                       plan.rank_k, plan.rank_v, parts)
            segment = compress_layer(keys, values, None, seg_cfg, plan.rank_k, plan.rank_v, rope, bases=bases,
                                     shared=shared, parts=parts)
            segment.shared_k, segment.shared_v = shared
            return segment
    plan = solve_ranks(shape, seg_cfg, n, spare_bytes)
    return compress_layer(keys, values, None, seg_cfg, plan.rank_k, plan.rank_v, rope)


def unspent_bytes(layer: CacheLayer, shape: KVShape, tokens: int) -> float:
    """Bytes the layer's first `tokens` tokens may still take under the ratio, beyond what they hold with
    the buffer emptied: the room their plan kept for a full buffer of new tokens (which a new last segment
    takes over, with its own room) and the rank solver's rounding. A new segment may spend them, so two
    documents keep the ratio together instead of each keeping it alone (which stores less than the ratio
    allows)."""
    last = layer.last if isinstance(layer, SegmentedLayer) else layer
    if last.cfg.ratio is None or last.cfg.segment_budget != "layer":  # explicit ranks: no budget to share
        return 0.0
    held = layer.nbytes() - last.buffered * shape.full_bytes_per_token()
    return max(0.0, tokens * shape.full_bytes_per_token() / last.cfg.ratio - held)


def settle_layer(cache: CompressedCache, i: int) -> None:
    """Layer `i` of `cache` has the whole appended text: store it (a segment of its own, or folded)."""
    cache.layers[i] = settle_appended(cache.layers[i], cache.shape)


def settle_cache(cache: CompressedCache) -> None:
    """Settle every layer after appending a text (oversized buffers folded into coefficients)."""
    for i in range(len(cache.layers)):
        settle_layer(cache, i)


def settle_appended(layer: CacheLayer, shape: KVShape) -> CacheLayer:
    """The layer after an appended text has been collected in its buffer: that text as a new segment
    when it is long enough (`S4RConfig.segment_tokens`) and the ratio affords its bases, else folded
    into the current bases; layers of other methods fold their buffer if they have one. Returns the
    layer to keep (a new `SegmentedLayer`, or `layer` itself)."""
    forget_rebuilt()  # the text's blocks are done: their layer's rebuilt tokens go back
    if not hasattr(layer, "collecting"):
        if hasattr(layer, "fold_buffer"):
            layer.fold_buffer()
        return layer
    layer.collecting = False
    last = layer.last if isinstance(layer, SegmentedLayer) else layer
    cfg = last.cfg
    if cfg.segment_tokens and last.buffered >= cfg.segment_tokens:
        start = layer.logical - last.buffered  # where the appended text begins
        base = getattr(last.rope, "base", last.rope)  # the model's own, not the last segment's shift
        try:
            segment = new_segment(last.buf_k, last.buf_v, cfg, shape, base, start,
                                  unspent_bytes(layer, shape, start), before=last)
        except BudgetError:
            segment = None
        if segment is not None:
            layer.drop_buffer()
            segments = [*(layer.segments if isinstance(layer, SegmentedLayer) else [layer]), segment]
            share_bases(segments)
            return SegmentedLayer(segments)
    layer.fold_buffer()
    return layer
