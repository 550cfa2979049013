"""`LowRankLayer`: S4R storage of one layer and its decode step.

Storage, all grown by capacity (appending never copies what is stored, except when a capacity doubles):
- one exact workspace per keys and values, [H, cap, d]: sinks | outliers | buffer of new tokens, so the
  tokens attended exactly are one view, never concatenated per step;
- key coefficients with the token axis last, [G, r_k, cap] (what the latent logits multiply), value
  coefficients [G, cap, r_v] (what the selected rows are gathered from), int8 scales [G, cap];
- the per-KV-head relevance of every stored token [H, cap] (or, for `summed` scoring, the recent
  queries' coefficients).

Decode (post-RoPE keys): the query is projected on the key basis once; its logits on every stored
token come from the coefficients (`latent.latent_logits`), which both score the tokens and give the
attention logits of the selected ones; values are combined in latent space. Pre-RoPE keys are
reconstructed and rotated for the selected tokens (their latent dot products ignore the rotation).
"""

from __future__ import annotations

import math

import torch

from s4r.config import S4RConfig
from s4r.core.coef_bands import Encoded, encode_coefficients, plan_bands
from s4r.core.latent import merged_attention
from s4r.core.rope import RopeFn, undo_rope
from s4r.core.selection import decay_factor
from s4r.core.subspace import coefficients, head_blocks, relative_residual, unit_columns
from s4r.hf.attention import causal_mask, handoff
from s4r.layers.full import CacheLayer, tensor_bytes, to_groups
from s4r.layers.growable import cloned, contiguous, grown
from s4r.layers.lowrank_dense import attend_every_token, attends_every_token, forget_rebuilt
from s4r.layers.lowrank_rebuild import KeyRebuild, gpu_kernels
from s4r.layers.lowrank_selection import LatentSelection
from s4r.layers.lowrank_views import StoredViews

# per-token stores with the token axis second (the key coefficients `_ck` have it last)
_TOKEN_ROW_STORES = ("_cv", "_sk", "_sv", "_rel", "_tk", "_tv", "_tsk", "_tsv")


class LowRankLayer(StoredViews, LatentSelection, KeyRebuild, CacheLayer):
    """S4R storage of one layer: full-precision sinks, K/V bases, coefficients of every other token,
    the outliers kept exact, the scoring state, and a full-precision buffer of new tokens.

    Positions are implicit: sinks 0..s-1, coefficients s..s+N-1, buffer after them. The constructor
    takes the parts as `compress_layer` produces them (coef [G, N, r], scales [G, N, 1]).
    """

    def __init__(self, *, cfg: S4RConfig, sink_k: torch.Tensor, sink_v: torch.Tensor, basis_k: torch.Tensor,
                 basis_v: torch.Tensor, coef_k: torch.Tensor, coef_v: torch.Tensor,
                 scale_k: torch.Tensor | None, scale_v: torch.Tensor | None, query_coef: torch.Tensor | None,
                 rope: RopeFn | None, out_idx: torch.Tensor | None = None,
                 out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None,
                 relevance: torch.Tensor | None = None, tail_k: torch.Tensor | None = None,
                 tail_v: torch.Tensor | None = None, tail_step_k: torch.Tensor | None = None,
                 tail_step_v: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = rope
        if cfg.key_space == "pre_rope" and rope is None:
            raise ValueError("pre-RoPE keys need the model's rotary embedding")
        self.heads, self.sinks, self.head_dim = sink_k.shape
        self.dtype = sink_k.dtype
        self.basis_k, self.basis_v = basis_k, basis_v  # [G, width, r]
        # leading basis columns another segment stores (an extended basis, `s4r.layers.segments`): ours are
        # views
        # of the same storage, counted there
        self.shared_k = self.shared_v = 0
        self.out_idx = out_idx  # [o] int32 indices into the coefficients, or None
        self._set_exact(sink_k, sink_v, out_k, out_v, sink_k[:, :0], sink_v[:, :0])
        n = coef_k.shape[1]
        self._n = n
        self._ck = coef_k.transpose(1, 2).contiguous()  # [G, r_k, N]
        self._cv = coef_v.contiguous()  # [G, N, r_v]
        self._sk = None if scale_k is None else scale_k[..., 0].contiguous()  # [G, N]
        self._sv = None if scale_v is None else scale_v[..., 0].contiguous()
        # lower coefficient bands (coef_bands): packed codes [G, N, bytes] and steps [G, N, bands]
        self.plan_k = plan_bands(basis_k.shape[-1], cfg.bands)
        self.plan_v = plan_bands(basis_v.shape[-1], cfg.band_spec(values=True))
        self._tk, self._tv = contiguous(tail_k), contiguous(tail_v)
        self._tsk, self._tsv = contiguous(tail_step_k), contiguous(tail_step_v)
        if bool(self.plan_k.tails) != (tail_k is not None) or bool(self.plan_v.tails) != (tail_v is not None):
            raise ValueError("coefficient bands do not match the configuration's coef_bands")
        # [Hq, W, r_k]: the prompt's last queries, until they seed relevance (`query` scoring needs none)
        self.query_coef = None if cfg.scoring == "query" or query_coef is None else (
            query_coef[..., : self.plan_k.lead].contiguous())  # scoring runs on the int8 band
        self._rel = None if relevance is None else relevance.contiguous()  # [H, N]
        self._decay = decay_factor(cfg.query_window)
        self._prompt_coefs = n  # where the prompt's last queries (query_coef) sat
        self.selected = None  # the stored tokens the last step attended (`LatentSelection.selected`)
        # where the step's queries end, counted like this layer's tokens: a segment of a `SegmentedLayer`
        # that is not the last one is told (its own length is not where the queries are); None: logical
        self.query_end: int | None = None
        self.logical = self.sinks + n
        # while True an appended document stays exact in the buffer (no folds) until it is settled
        self.collecting = False

    # --- exact workspace: sinks | outliers | buffer -----------------------------------------------
    def _set_exact(self, sink_k, sink_v, out_k, out_v, buf_k, buf_v) -> None:
        parts_k = [sink_k] + ([] if out_k is None else [out_k]) + [buf_k]
        parts_v = [sink_v] + ([] if out_v is None else [out_v]) + [buf_v]
        self._n_out = 0 if out_k is None else out_k.shape[1]
        self._n_buf = buf_k.shape[1]
        used = self.sinks + self._n_out + self._n_buf
        cap = used + self.cfg.buffer_tokens  # the buffer's room, which the rank budget counts full
        self._ek = sink_k.new_empty(self.heads, cap, self.head_dim)
        self._ev = sink_v.new_empty(self.heads, cap, self.head_dim)
        at = 0
        for pk, pv in zip(parts_k, parts_v, strict=True):
            self._ek[:, at : at + pk.shape[1]] = pk
            self._ev[:, at : at + pv.shape[1]] = pv
            at += pk.shape[1]

    @property
    def exact_length(self) -> int:
        return self.sinks + self._n_out + self._n_buf

    @property
    def sink_k(self) -> torch.Tensor:
        return self._ek[:, : self.sinks]

    @property
    def sink_v(self) -> torch.Tensor:
        return self._ev[:, : self.sinks]

    @property
    def out_k(self) -> torch.Tensor | None:
        return None if self.out_idx is None else self._ek[:, self.sinks : self.sinks + self._n_out]

    @property
    def out_v(self) -> torch.Tensor | None:
        return None if self.out_idx is None else self._ev[:, self.sinks : self.sinks + self._n_out]

    @property
    def buf_k(self) -> torch.Tensor:
        return self._ek[:, self.sinks + self._n_out : self.exact_length]

    @property
    def buf_v(self) -> torch.Tensor:
        return self._ev[:, self.sinks + self._n_out : self.exact_length]

    def set_buffer(self, buf_k: torch.Tensor, buf_v: torch.Tensor) -> None:
        """Replace the buffer of new tokens (a loaded cache) and recount the logical length."""
        self._set_exact(self.sink_k.clone(), self.sink_v.clone(), cloned(self.out_k), cloned(self.out_v),
                        buf_k, buf_v)
        self.logical = self.stored_length()

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def stored_coefs(self) -> int:
        return self._n

    @property
    def buffered(self) -> int:
        """Tokens in the exact buffer of new tokens."""
        return self._n_buf

    def stored_length(self) -> int:
        return self.sinks + self._n + self._n_buf

    def nbytes(self) -> int:
        """Bytes of what the layer holds (spare capacity is allocator headroom, not cache content)."""
        e = self.exact_length
        return tensor_bytes(self._ek[:, :e], self._ev[:, :e], *self.own_bases(), self.coef_k,
                            self.coef_v, self.scale_k, self.scale_v, self.query_coef, self.relevance,
                            self.out_idx, self.tail_k, self.tail_v, self.tail_step_k, self.tail_step_v)

    def own_bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value basis columns this layer stores itself (all of them unless it extends
        another segment's)."""
        return self.basis_k[..., self.shared_k :], self.basis_v[..., self.shared_v :]

    # --- coefficients <-> vectors -----------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope(positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    def _encode(self, x: torch.Tensor, basis: torch.Tensor, values: bool = False) -> Encoded:
        coef = coefficients(to_groups(x, basis.shape[0]).float(), basis.float(), self.cfg.tails_normed)
        return encode_coefficients(coef, self.cfg, self.dtype, values)

    def _append_coefs(self, ck, sk, cv, sv, tails=(None, None, None, None)) -> None:
        n, m = self._n, ck.shape[1]
        # keys and values have their own bands (plain int8 keys may sit beside banded values)
        for name, new in zip(("_tk", "_tsk", "_tv", "_tsv"), tails, strict=True):
            store = getattr(self, name)
            if store is not None:
                store = grown(store, 1, n, n + m)
                store[:, n : n + m] = new
                setattr(self, name, store)
        self._ck = grown(self._ck, 2, n, n + m)
        self._cv = grown(self._cv, 1, n, n + m)
        self._ck[..., n : n + m] = ck.transpose(1, 2)
        self._cv[:, n : n + m] = cv
        if sk is not None:
            self._sk, self._sv = grown(self._sk, 1, n, n + m), grown(self._sv, 1, n, n + m)
            self._sk[:, n : n + m], self._sv[:, n : n + m] = sk[..., 0], sv[..., 0]
        if self._rel is not None:
            self._rel = grown(self._rel, 1, n, n + m)
            self._rel[:, n : n + m] = 0  # not attended yet; the local window covers them meanwhile
        self._n = n + m

    def _fold(self, n: int) -> None:
        """Move the oldest `n` buffer tokens into coefficients with the existing bases."""
        if n <= 0:
            return
        exact_k, v = self.buf_k[:, :n], self.buf_v[:, :n]
        k = exact_k
        if self.cfg.key_space == "pre_rope":
            start = self.sinks + self._n
            k = undo_rope(k, *self._rope(torch.arange(start, start + n, device=k.device)))
        picks = self._new_outliers(k, v)
        first = self._n
        ck, sk, tk, tsk = self._encode(k, self.basis_k)
        cv, sv, tv, tsv = self._encode(v, self.basis_v, values=True)
        self._append_coefs(ck, sk, cv, sv, (tk, tsk, tv, tsv))
        # workspace: sinks | outliers | buffer -> sinks | outliers | new outliers | rest of the buffer
        start, o, rest = self.sinks + self._n_out, picks.numel(), self._n_buf - n
        moved_k, moved_v = exact_k[:, picks].clone(), v[:, picks].clone()
        self._ek[:, start + o : start + o + rest] = self._ek[:, start + n : start + n + rest].clone()
        self._ev[:, start + o : start + o + rest] = self._ev[:, start + n : start + n + rest].clone()
        if o:
            self._ek[:, start : start + o], self._ev[:, start : start + o] = moved_k, moved_v
            new_idx = (picks + first).to(torch.int32)
            self.out_idx = new_idx if self.out_idx is None else torch.cat([self.out_idx, new_idx])
            self._n_out += o
        self._n_buf = rest

    def _new_outliers(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Which of the tokens being folded stay exact: the same share as at compression, the ones the
        bases represent worst, so a second document or a long chat keeps its rare tokens (a needle)."""
        count = self.cfg.outlier_count(k.shape[1])
        if not count:
            return torch.zeros(0, dtype=torch.long, device=k.device)
        groups = self.basis_k.shape[0]
        unit_k, unit_v = (unit_columns(b.float()) if self.cfg.tails_normed else b.float()
                          for b in (self.basis_k, self.basis_v))
        worst = (relative_residual(to_groups(k, groups).float(), unit_k)
                 + relative_residual(to_groups(v, groups).float(), unit_v))
        return torch.topk(worst, count).indices.sort().values

    # --- cache protocol ---------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("a compressed s4r cache holds one sequence (batch size 1)")
        q = key_states.shape[-2]
        self._ek = grown(self._ek, 1, self.exact_length, self.exact_length)  # writable here
        self._ev = grown(self._ev, 1, self.exact_length, self.exact_length)
        excess = self._n_buf + q - self.cfg.buffer_tokens
        if excess > 0 and not self.collecting:
            step = self.cfg.fold_tokens
            self._fold(min(self._n_buf, math.ceil(excess / step) * step))
        end = self.exact_length
        self._ek = grown(self._ek, 1, end, end + q)
        self._ev = grown(self._ev, 1, end, end + q)
        self._ek[:, end : end + q] = key_states[0]
        self._ev[:, end : end + q] = value_states[0]
        self._n_buf += q
        self.logical += q
        keys = self._ek[:, : end + q].unsqueeze(0)
        handoff(self, keys)  # the attention function gets no handle on the cache: name this layer to it
        return keys, self._ev[:, : end + q].unsqueeze(0)

    def fold_buffer(self) -> None:
        """Fold the buffer down to its cap (after a long appended document; not while one is collected)."""
        excess = self._n_buf - self.cfg.buffer_tokens
        if excess > 0 and not self.collecting:
            self._fold(excess)

    def drop_buffer(self) -> None:
        """Forget the buffer's tokens (an appended document now stored in a segment of its own,
        `s4r.layers.segments`)."""
        self.logical -= self._n_buf
        self._n_buf = 0

    def attend(self, query, key, value, scaling):
        q_heads, q_len = query.shape[1], query.shape[2]
        if self._n and attends_every_token(self, q_len):
            return attend_every_token([self], query, scaling)
        forget_rebuilt()
        out, _ = self.attend_folded(query, scaling)
        return out.to(query.dtype).reshape(1, q_heads, q_len, self.head_dim)

    def attend_folded(self, query: torch.Tensor, scaling: float, *,
                      with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `query` [1, Hq, q, d] over this layer's tokens, query heads folded per KV head:
        (fp32 output [H, group*q, d], logsumexp [H, group*q] when `with_lse`), see `merged_attention`."""
        from s4r.kernels import one_token_step  # numba loads only where a step asks for it
        from s4r.kernels.s4r_step import attend_layer

        if (fused := attend_layer(self, query, scaling, with_lse, one_token_step)) is not None:
            return fused
        qf, exact_logits, q_len = self.exact_step(query, scaling)
        chosen = self._select_and_score(qf, exact_logits, q_len, scaling) if self._n else None
        return self.attend_chosen(exact_logits, chosen, with_lse=with_lse)

    def exact_step(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(query rows [H, group*q, d] fp32, their masked logits on the exact tokens, q) of a step."""
        q_len = query.shape[2]
        heads, n_rep = self.heads, query.shape[1] // self.heads
        # folded (row j*q + i = head j, position i), fp32: the query is small, its logits need precision
        qf = query[0].reshape(heads, n_rep * q_len, self.head_dim).float()
        e = self.exact_length
        exact_logits = torch.matmul(qf, self._ek[:, :e].float().transpose(1, 2)).mul_(scaling)
        mask = causal_mask(q_len, e, e - self._n_buf, query.device)
        if mask is not None:
            exact_logits.masked_fill_(~mask.repeat(n_rep, 1), float("-inf"))
        return qf, exact_logits, q_len

    def attend_chosen(self, exact_logits: torch.Tensor, chosen: tuple[torch.Tensor, torch.Tensor] | None, *,
                      with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's attention over the exact tokens and the `chosen` stored ones ((indices, logits) from
        `selected_logits`; None: no stored token), see `attend_folded`."""
        heads, rows, e = exact_logits.shape
        weighted = None
        if chosen is not None:
            idx, sel_logits = chosen
            kernels = gpu_kernels(self)  # a GPU's value rows in one kernel, where it serves
            weighted = (kernels and kernels.weighted_rows(self, idx)) or self.gathered_values(idx)
        else:
            sel_logits = exact_logits.new_empty(heads, rows, 0)
        blocks = head_blocks(self.basis_v, heads)
        out = merged_attention(exact_logits, self._ev[:, :e], sel_logits, weighted, blocks, with_lse=with_lse)
        # a question longer than the buffer would hold the cache over its ratio until the next step
        self.fold_buffer()
        return out

    # --- truncation ---------------------------------------------------------------------------------
    def _forget_queries(self, removed: int) -> None:
        """Drop the scoring state of the last `removed` positions' queries (a forgotten turn)."""
        if self.cfg.scoring == "summed":
            if self.query_coef is not None:  # the window's rows are the last positions, in order
                keep = self.query_coef.shape[1] - removed
                self.query_coef = self.query_coef[:, :keep].clone() if keep > 0 else None
        else:
            # a relevance aggregate cannot be split by query: the next queries start it again
            self.query_coef, self._rel = None, None

    def truncate(self, logical: int) -> None:
        forget_rebuilt()
        self.collecting = False  # an interrupted append is rolled back by this truncation
        logical = max(self.sinks, min(self.logical, logical))
        if logical < self.logical:
            self._forget_queries(self.logical - logical)
        keep_buf = max(0, logical - self.sinks - self._n)
        keep_coef = min(self._n, logical - self.sinks)
        out_k, out_v = self.out_k, self.out_v
        drop_out = self.out_idx is not None and bool((self.out_idx >= keep_coef).any())
        if drop_out:
            keep = self.out_idx < keep_coef
            self.out_idx = self.out_idx[keep]
            out_k, out_v = out_k[:, keep], out_v[:, keep]
        if drop_out:
            self._set_exact(self.sink_k.clone(), self.sink_v.clone(), cloned(out_k), cloned(out_v),
                            self.buf_k[:, :keep_buf].clone(), self.buf_v[:, :keep_buf].clone())
        self._n_buf = min(self._n_buf, keep_buf)  # the workspace keeps its room
        if keep_coef < self._n:
            # copy so the dropped rows are freed, not kept alive behind a view
            self._ck = self._ck[..., :keep_coef].clone()
            for name in _TOKEN_ROW_STORES:
                if (store := getattr(self, name)) is not None:
                    setattr(self, name, store[:, :keep_coef].clone())
            self._n = keep_coef
        self.logical = logical

    # --- persistence --------------------------------------------------------------------------------
    kind = "lowrank"
    _STATE = ("sink_k", "sink_v", "basis_k", "basis_v", "coef_k", "coef_v", "scale_k", "scale_v",
              "query_coef", "out_idx", "out_k", "out_v", "relevance", "tail_k", "tail_v", "tail_step_k",
              "tail_step_v", "buf_k", "buf_v")

    def state(self) -> dict[str, torch.Tensor]:
        return {key: value for key in self._STATE if (value := getattr(self, key)) is not None}

    def meta_state(self) -> dict:
        # the value bands and tail scaling in force are written out: a file reads back as stored whatever the
        # presets become
        meta = {"config": {**self.cfg.to_dict(), "value_bands": self.cfg.band_spec(values=True),
                           "tail_norm": self.cfg.tails_normed}}
        if self.shared_k or self.shared_v:
            meta["shared"] = [self.shared_k, self.shared_v]
        return meta

    @classmethod
    def from_state(cls, state, meta, *, rope=None) -> LowRankLayer:
        parts = {key: state.get(key) for key in cls._STATE if key not in ("buf_k", "buf_v")}
        config = dict(meta["config"])
        if config.get("value_bands") is None:  # written before the ratio presets: values used the keys' bands
            config["value_bands"] = config.get("coef_bands") or "8:1"  # "8:1": every column int8
        config.setdefault("tail_norm", False)  # written before it: orthonormal bases
        layer = cls(cfg=S4RConfig(**config), rope=rope, **parts)
        layer.shared_k, layer.shared_v = meta.get("shared", (0, 0))
        layer.set_buffer(state["buf_k"], state["buf_v"])
        return layer
