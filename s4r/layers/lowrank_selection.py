"""The decode-side half of `LowRankLayer`: which stored tokens a step attends, and their logits.

Split from `lowrank.py` (storage, folding, truncation) so each file keeps one job. The methods read the
layer's storage (`_ck`/`_cv` coefficients, `_sk`/`_sv` int8 scales, `_tk`/`_tv` lower bands, the exact
workspace `_ek`, `out_idx`, `_rel`) and its configuration; `LowRankLayer` is the only class using them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from s4r.core.latent import (
    chunked_latent_logits,
    gather_value_rows,
    gathered_logits,
    latent_logits,
    weighted_value_rows,
)
from s4r.core.rope import chunk_rotations, last_answer, rotate_half, undo_rope
from s4r.core.selection import (
    latent_scores,
    mass_budget,
    pool_scores,
    ranked_candidates,
    select_tokens,
    update_relevance,
)
from s4r.core.subspace import head_blocks, project_queries
from s4r.core.tail_planes import PlanarTail
from s4r.layers.growable import MIN_SPARE


@dataclass
class LatentStep:
    """What one decode step's scoring of a layer computed, between its two halves (`latent_step`,
    `step_scores`) and for the selected tokens' logits (`selected_logits`)."""

    qf: torch.Tensor  # [H, rows, d] fp32 query rows, query heads of each KV group folded
    q_len: int
    scaling: float
    q_full: torch.Tensor  # [H, rows, r_k] query coefficients, every band
    q_lat: torch.Tensor  # the int8 band's part (what scores)
    coef_t: torch.Tensor  # [G, r_k, N] stored key coefficients
    scale_k: torch.Tensor | None
    scores: torch.Tensor | None = None  # [H or 1, N] before pooling
    full_logits: torch.Tensor | None = None  # [H, rows, N] logits of every row on every stored token
    window_logits: torch.Tensor | None = None  # relevance scoring: [H, rows_w, N + e'] (stored, exact)
    window: int = 0
    stored: int = 0
    # chunked pre-RoPE scoring: the int8-band query of each chunk [C, H, rows, lead] and the chunks'
    # stored-token bounds (C + 1)
    chunks: tuple[torch.Tensor, list[int]] | None = None
    # adaptive budget (`recon_drop`): the scored rows' probabilities on the stored tokens [G, R, N]
    probs: torch.Tensor | None = None


class LatentSelection:
    """Scoring, selection and the selected tokens' logits of a `LowRankLayer` (a mixin of it)."""

    # tokens rebuilt (or attended in latent space) and tokens stored, summed over the steps: the share of
    # the cache a step really touches (`CompressedCache.rebuilt_share`)
    rebuilt_tokens: int = 0
    scored_tokens: int = 0

    def _latent_query(self, qf: torch.Tensor, q_len: int) -> tuple[torch.Tensor, list[int]]:
        """Query coefficients [C, H, rows, r_k] and the C stored-token ranges they score (bounds, C + 1
        entries): C = 1, all tokens, except for pre-RoPE keys scored by `rope_scoring="expected"` with
        chunks. Pre-RoPE queries are un-rotated first."""
        n = self._n
        if self.cfg.key_space != "pre_rope":
            return project_queries(qf, self.basis_k)[None], [0, n]
        end = self.logical if self.query_end is None else self.query_end
        cos, sin = self._query_angles(end, q_len, qf.device)
        n_rep = qf.shape[1] // q_len
        q = undo_rope(qf.view(self.heads, n_rep, q_len, -1), cos, sin).float()
        rotations = None
        if self.cfg.rope_scoring == "expected" and n:
            # stored token j sits at sinks + j: its distance from the last query is last - j
            rotations = chunk_rotations(self.rope, n, self.cfg.rope_chunk or n, end - 1 - self.sinks)
        q = q.reshape(qf.shape)
        if rotations is None:
            return project_queries(q, self.basis_k)[None], [0, n]
        bounds, cos, sin = rotations
        chunks = cos.shape[0]
        # every chunk's rotation of every row at once: [H, C * rows, d], then one product per KV head
        q = q.unsqueeze(1) * cos[:, None] + rotate_half(q).unsqueeze(1) * sin[:, None]
        blocks = head_blocks(self.basis_k, self.heads).float()
        coef = torch.matmul(q.reshape(self.heads, -1, q.shape[-1]), blocks)
        return coef.view(self.heads, chunks, -1, coef.shape[-1]).transpose(0, 1), bounds

    def _query_angles(self, end: int, q_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's tables of the step's query positions end - q_len .. end - 1; every layer of a step asks
        the same, so with static frequencies the last answer is kept on `rope`."""
        def tables() -> tuple[torch.Tensor, torch.Tensor]:  # a host tensor of positions would sync a GPU
            return self._rope(torch.arange(end - q_len, end, device=device))

        if not hasattr(self.rope, "rotary"):  # frequencies that may change: no memo
            return tables()
        return last_answer(self.rope, "query_memo", (end, q_len, self.dtype, device), tables)

    def latent_step(self, qf: torch.Tensor, exact_logits: torch.Tensor, q_len: int,
                    scaling: float) -> LatentStep:
        """First half of scoring a step: the query's coefficients and, for relevance scoring, the logits
        of the scored query rows on every stored token and exact one (`LatentStep.window_logits`)."""
        n = self._n
        scale_k = None if self._sk is None else self._sk[:, :n]
        coef_t = self._ck[..., :n]
        chunks, bounds = self._latent_query(qf, q_len)
        q_full = chunks[-1]  # the chunk nearest the query (the only one but for chunked pre-RoPE scoring)
        lead = self.plan_k.lead
        q_lat = q_full if self._tk is None else q_full[..., :lead].contiguous()  # the int8 band
        step = LatentStep(qf, q_len, scaling, q_full, q_lat, coef_t, scale_k)
        if len(bounds) > 2:
            step.chunks = (chunks if self._tk is None else chunks[..., :lead], bounds)
        if self.cfg.scoring == "summed":
            step.scores = self._summed_scores(q_lat, q_len, coef_t, scale_k, scaling)
            if q_len <= self.cfg.query_window and self.cfg.key_space == "post_rope":
                step.full_logits = latent_logits(q_lat, coef_t, scale_k, scaling)
        else:
            self._window_logits(step, exact_logits)
        return step

    def step_scores(self, step: LatentStep, global_lse: torch.Tensor | None = None) -> torch.Tensor:
        """Second half: pooled scores [H or 1, N] of the stored tokens (outliers -inf). `global_lse`
        [H, rows] normalizes relevance over more tokens than this layer's (every segment of a layer)."""
        if step.scores is None:
            step.scores = self._relevance_from(step, global_lse)
        pool = self.cfg.pool if self.cfg.scoring == "summed" else "max"  # relevance: max keeps peaks
        scores = pool_scores(step.scores, self.cfg.pool_kernel, pool)
        if self.out_idx is not None:
            # outliers are attended exactly already; don't spend reconstruction slots on them
            scores.index_fill_(1, self._out_long(), float("-inf"))
        return scores

    @property
    def selected(self) -> torch.Tensor | None:
        """[H, k] stored tokens the last step attended (inspection); the fused step leaves them as numpy
        indices [k], made a tensor only when asked."""
        chosen = self._selected
        if isinstance(chosen, np.ndarray):
            chosen = self._selected = torch.from_numpy(chosen).unsqueeze(0).expand(self.heads, -1)
        return chosen

    @selected.setter
    def selected(self, chosen: torch.Tensor | np.ndarray | None) -> None:
        self._selected = chosen

    def selection_size(self, local: bool = True) -> tuple[int, int]:
        """(top-k count, forced local-window count) of a step; without `local`, no local window (a
        segment whose tokens are not the most recent)."""
        n = self._n
        forced = max(0, self.cfg.local_window - self._n_buf) if local else 0
        k = min(self.cfg.reconstruct_count(n), n - forced - self._n_out)
        room = self._token_room(forced)
        return (k if room is None else min(k, room)), forced

    def selection_bounds(self, local: bool = True) -> tuple[int, int, int]:
        """(fewest, most, forced) tokens a step rebuilds: the fixed count, and with `recon_drop` up to
        `recon_max` of the stored tokens (`choose_tokens` holds both to `recon_token_cap`)."""
        k, forced = self.selection_size(local)
        if self.cfg.recon_drop is None:
            return k, k, forced
        most = int(self.cfg.recon_ceiling() * self._n)
        return k, max(k, min(most, self._n - forced - self._n_out)), forced

    def _token_room(self, forced: int) -> int | None:
        """The most top-k tokens `recon_token_cap` leaves besides the forced local window (None: no limit)."""
        cap = self.cfg.token_cap()
        return None if cap is None else max(0, cap - forced)

    def choose_tokens(self, scores: torch.Tensor, probs: torch.Tensor | None,
                      bounds: tuple[int, int, int]) -> torch.Tensor:
        """Indices [G, k] of the stored tokens a step rebuilds, within `bounds` (`selection_bounds`, or
        their sum over segments) held to `recon_token_cap`: the fixed count's top tokens, grown by
        `mass_budget` when the step kept its rows' probabilities, and the forced local window."""
        k, k_max, forced = bounds
        if (room := self._token_room(forced)) is not None:  # the cap is the layer's, over every segment
            k, k_max = min(k, room), min(k_max, room)
        if k_max <= k or probs is None:
            return select_tokens(scores, k, forced)
        ranked = ranked_candidates(scores, k_max, forced)  # one top-k serves the count and the choice
        count = mass_budget(scores, probs, k, k_max, forced, self.cfg.recon_drop, ranked=ranked)
        return select_tokens(scores, count, forced, ranked=ranked)

    def _select_and_score(self, qf, exact_logits, q_len, scaling):
        """Indices [H or 1, k] of the stored tokens to attend (1: one set for every head, see
        `shared_selection`), and the queries' logits on them [H, rows, k]."""
        step = self.latent_step(qf, exact_logits, q_len, scaling)
        scores = self.step_scores(step)
        idx = self.choose_tokens(scores, step.probs, self.selection_bounds())  # [1 or H, k]
        return self.selected_logits(step, idx)

    def selected_logits(self, step: LatentStep, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices as the value rows need them, the step's logits on the tokens `idx` [H or 1, k])."""
        self.selected = idx.expand(self.heads, -1)
        self.rebuilt_tokens += idx.shape[-1]
        self.scored_tokens += self._n
        if self._cv.shape[0] != 1:
            idx = self.selected  # per-head coefficients: every head gathers its own rows anyway
        scaling = step.scaling
        if self.cfg.key_space == "pre_rope":
            return idx, self._rebuilt_key_logits(step.qf, idx, scaling)
        if step.full_logits is not None and idx.shape[0] == 1:  # one token set: no expanded index
            logits = step.full_logits.index_select(2, idx[0])
        elif step.full_logits is not None:
            heads, rows, _ = step.full_logits.shape
            logits = torch.gather(step.full_logits, 2, idx.unsqueeze(1).expand(heads, rows, -1))
        else:
            logits = gathered_logits(step.q_lat, step.coef_t, step.scale_k, idx, scaling)
        if self._tk is not None:  # the lower bands' share of the selected tokens' logits
            logits += self.planar_tail(idx, keys=True).logits(step.q_full[..., self.plan_k.lead :] * scaling)
        return idx, logits

    def planar_tail(self, idx: torch.Tensor, keys: bool) -> PlanarTail:
        """The lower bands of the stored tokens `idx` [H or 1, k] as planes (`s4r.core.tail_planes`)."""
        if keys:
            return PlanarTail.gather(self._tk, self._tsk, idx, self.plan_k)
        return PlanarTail.gather(self._tv, self._tsv, idx, self.plan_v)

    def gathered_values(self, idx: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """p_sel [H, M, k] -> z [H, M, r_v]: the stored tokens idx [H or 1, k]' value rows gathered (the lower
        bands as planes) and weighted by their probabilities (`weighted_value_rows`)."""
        scales = None if self._sv is None else self._sv[:, : self._n]
        rows, scale = gather_value_rows(self.coef_v, scales, idx)
        tail = self.planar_tail(idx, keys=False) if self._tv is not None else None
        return lambda p_sel: weighted_value_rows(p_sel, rows, scale, tail)

    def _summed_scores(self, q_lat, q_len, coef_t, scale_k, scaling):
        q_coef = q_lat.reshape(-1, q_len, q_lat.shape[-1]).to(self.dtype)  # [Hq, q, r]
        if self.query_coef is not None:
            q_coef = torch.cat([self.query_coef, q_coef], dim=1)
        self.query_coef = q_coef[:, -self.cfg.query_window :].clone()
        scores = latent_scores(coef_t, scale_k, self.query_coef.float().mean(dim=1), self.heads)
        if self.cfg.pool == "avg":
            scores = torch.softmax(scores * scaling, dim=-1)
        return scores.sum(dim=0, keepdim=True) if self.cfg.shared_selection else scores

    def _window_logits(self, step: LatentStep, exact_logits: torch.Tensor) -> None:
        """The scored query rows' logits on every stored token (outliers: their exact logits) then on the
        other exact tokens, into `step.window_logits` [H, rows, N + e'] (see `_relevance_from`)."""
        n = self._n
        if self._rel is None and self.query_coef is not None:
            self._seed_relevance(step.coef_t, step.scale_k, step.scaling)
        q_len, q_lat = step.q_len, step.q_lat
        window = self.cfg.scoring_queries(q_len)
        n_rep = q_lat.shape[1] // q_len

        def last_rows(x: torch.Tensor) -> torch.Tensor:  # [H, n_rep * q_len, x] -> the window's rows
            if window == q_len:
                return x
            rows = x.view(self.heads, n_rep, q_len, -1)[:, :, -window:]
            return rows.reshape(self.heads, n_rep * window, -1)

        scored, ex = last_rows(q_lat), last_rows(exact_logits)
        s, o = self.sinks, self._n_out
        # one buffer [stored | sinks | buffer tokens]: the softmax's input, with no concatenation
        buf = ex.new_empty(self.heads, scored.shape[1], n + ex.shape[-1] - o)
        if step.chunks is None:
            logits = latent_logits(scored, step.coef_t, step.scale_k, step.scaling, out=buf[..., :n])
        else:
            queries, bounds = step.chunks
            rows = torch.stack([last_rows(q) for q in queries]) if window != q_len else queries
            logits = chunked_latent_logits(rows, bounds, step.coef_t, step.scale_k, step.scaling,
                                           buf[..., :n])
        buf[..., n : n + s] = ex[..., :s]
        buf[..., n + s :] = ex[..., s + o :]
        if o:
            logits.index_copy_(2, self._out_long(), ex[..., s : s + o])  # outliers: their exact logits
        step.window, step.stored = window, n
        step.window_logits = buf
        step.full_logits = logits if window == q_len else None  # they double as the attention logits

    def _relevance_from(self, step: LatentStep, global_lse: torch.Tensor | None) -> torch.Tensor:
        """Relevance [H or 1, N] after this step's queries: their attention probabilities over the stored
        tokens, with this layer's tokens in the normaliser, or all of `global_lse`'s."""
        if global_lse is None:
            # one softmax (logsumexp is far slower on CPU for logits this spread out)
            probs = torch.softmax(step.window_logits, dim=-1)
        else:
            probs = torch.exp(step.window_logits - global_lse.unsqueeze(-1))
        probs = probs[..., : step.stored]
        groups = 1 if self.cfg.shared_selection else self.heads  # shared: every query head is one group
        probs = probs.view(groups, -1, step.window, probs.shape[-1])
        if self.cfg.recon_drop is not None:
            step.probs = probs.reshape(groups, -1, probs.shape[-1])
        rel = update_relevance(self.relevance, probs, self._decay, self.cfg.scoring)
        if self.cfg.scoring != "query":
            self._store_relevance(rel)
        return rel

    def _seed_relevance(self, coef_t, scale_k, scaling) -> None:
        """Relevance from the prompt's last queries (kept at compression), then drop them."""
        qc = self.query_coef  # [Hq, W, r], positions: the W tokens before the stored ones' end
        w = qc.shape[1]
        n_rep = qc.shape[0] // self.heads
        logits = latent_logits(qc.reshape(self.heads, n_rep * w, -1), coef_t, scale_k, scaling)
        # window query i sits at the prompt's position T - w + i and sees stored tokens up to it
        limit = torch.arange(w, device=logits.device) + (self._prompt_coefs - w)
        future = torch.arange(coef_t.shape[-1], device=logits.device).unsqueeze(0) > limit.unsqueeze(1)
        logits = logits.view(self.heads, n_rep, w, -1).masked_fill_(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.cfg.shared_selection:
            probs = probs.view(1, -1, w, probs.shape[-1])
        self._store_relevance(update_relevance(None, probs, self._decay, self.cfg.scoring))
        self.query_coef = None

    def _store_relevance(self, rel: torch.Tensor) -> None:
        n = rel.shape[-1]
        if self._rel is None or self._rel.shape[-1] < n or (
                self._rel.is_inference() and not torch.is_inference_mode_enabled()):
            self._rel = rel.new_empty(rel.shape[0], n + max(MIN_SPARE, n // 16), dtype=self.dtype)
        self._rel[:, :n] = rel

    def _out_long(self) -> torch.Tensor:
        """The outlier indices as int64 (what index ops take), converted once."""
        if getattr(self, "_out_cache", (None, None))[0] is not self.out_idx:
            self._out_cache = (self.out_idx, self.out_idx.long())
        return self._out_cache[1]
