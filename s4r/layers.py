"""Per-layer cache storage: full precision (reference and prefill staging) and S4R low-rank.

Each layer keeps its logical length (positions the model has seen) apart from what it stores, and
reports `nbytes()` of everything it keeps.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention import causal_attention, handoff
from .config import S4RConfig
from .rope import RopeFn, apply_rope, undo_rope
from .selection import latent_scores, pool_scores, select_tokens
from .subspace import dequantize_int8, project, quantize_int8


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Sum of the sizes of the given tensors (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class S4RLayerBase(CacheLayerMixin):
    """What every s4r cache layer shares: lengths, bytes, and the attention hand-off."""

    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = True
        self.logical = 0

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is built eagerly
        self.is_initialized = True

    def get_seq_length(self) -> int:
        """Logical length: the positions seen so far (what position ids continue from)."""
        return self.logical

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Stored length plus the query (what a dense mask would span)."""
        return self.stored_length() + query_length, 0

    def stored_length(self) -> int:
        """Tokens held in any form (sinks, coefficients, buffer)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of every tensor the layer keeps."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """Attention output [B, Hq, q, d] of `query` over this layer's context."""
        raise NotImplementedError

    def truncate(self, logical: int) -> None:
        """Forget every token at or past position `logical`."""
        raise NotImplementedError

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: a negative count removes that many tokens, a positive one is a length."""
        self.truncate(self.logical + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove)


class FullLayer(S4RLayerBase):
    """Uncompressed keys/values (post-RoPE), grown in amortized steps instead of a copy per token.

    While `query_window` > 0 it also keeps the last queries, which S4R and SnapKV need at compression.
    """

    def __init__(self, query_window: int = 0) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.query_window = query_window
        self.queries: torch.Tensor | None = None

    @property
    def keys_view(self) -> torch.Tensor:
        return self._k[:, :, : self.logical]

    @property
    def values_view(self) -> torch.Tensor:
        return self._v[:, :, : self.logical]

    def update(self, key_states, value_states, *args, **kwargs):
        n, q = self.logical, key_states.shape[-2]
        if self._k is None or n + q > self._k.shape[-2]:
            cap = max(n + q, 2 * (0 if self._k is None else self._k.shape[-2]), 256)
            shape = (*key_states.shape[:2], cap, key_states.shape[-1])
            k = key_states.new_empty(shape)
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if n:
                k[:, :, :n] = self._k[:, :, :n]
                v[:, :, :n] = self._v[:, :, :n]
            self._k, self._v = k, v
        self._k[:, :, n : n + q] = key_states
        self._v[:, :, n : n + q] = value_states
        self.logical = n + q
        keys = self.keys_view
        handoff(self, keys)
        return keys, self.values_view

    def attend(self, query, key, value, scaling):
        if self.query_window:
            recent = query if self.queries is None else torch.cat([self.queries, query], dim=2)
            self.queries = recent[:, :, -self.query_window :].clone()
        return causal_attention(query, key, value, scaling)

    def stored_length(self) -> int:
        return self.logical

    def nbytes(self) -> int:
        """Bytes of the stored tokens (growth slack is allocator headroom, not cache content)."""
        if self._k is None:
            return 0
        return tensor_bytes(self.keys_view, self.values_view)

    def truncate(self, logical: int) -> None:
        self.logical = max(0, min(self.logical, logical))


def to_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[H, n, d] per-head vectors -> [G, n, width]: per head (G=H) or heads concatenated (G=1)."""
    if groups == x.shape[0]:
        return x
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2])


def head_blocks(basis: torch.Tensor, heads: int) -> torch.Tensor:
    """[G, width, r] basis -> [H, d, r]: the rows of the basis that belong to each KV head (a view)."""
    if basis.shape[0] == heads:
        return basis
    return basis[0].view(heads, -1, basis.shape[-1])


def gather_rows(coef: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` [H, k] of per-group coefficients [G, N, r] -> [H, k, r]."""
    heads, k = idx.shape
    if coef.shape[0] == heads:
        return torch.gather(coef, 1, idx.unsqueeze(-1).expand(heads, k, coef.shape[-1]))
    return coef[0].index_select(0, idx.reshape(-1)).view(heads, k, coef.shape[-1])


class LowRankLayer(S4RLayerBase):
    """S4R storage of one layer: full-precision sinks, K/V bases, coefficients of every other token, the
    recent queries' key coefficients, and a full-precision buffer of new tokens.

    Positions are implicit: sinks 0..s-1, coefficients s..s+N-1, buffer after them.
    """

    def __init__(self, *, cfg: S4RConfig, sink_k: torch.Tensor, sink_v: torch.Tensor, basis_k: torch.Tensor,
                 basis_v: torch.Tensor, coef_k: torch.Tensor, coef_v: torch.Tensor,
                 scale_k: torch.Tensor | None, scale_v: torch.Tensor | None, query_coef: torch.Tensor | None,
                 rope: RopeFn | None, out_idx: torch.Tensor | None = None,
                 out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.sink_k, self.sink_v = sink_k, sink_v  # [H, s, d]
        self.basis_k, self.basis_v = basis_k, basis_v  # [G, width, r]
        self.coef_k, self.coef_v = coef_k, coef_v  # [G, N, r]
        self.scale_k, self.scale_v = scale_k, scale_v  # [G, N, 1] for int8, else None
        self.query_coef = query_coef  # [Hq, W, r_k], None until a query was seen
        # outliers: stored tokens the bases represent worst, also kept exact (indices into coefficients)
        self.out_idx, self.out_k, self.out_v = out_idx, out_k, out_v  # [n] int32, [H, n, d]
        self.heads, _, self.head_dim = sink_k.shape
        self.buf_k = sink_k.new_empty(self.heads, 0, self.head_dim)
        self.buf_v = sink_v.new_empty(self.heads, 0, self.head_dim)
        self.rope = rope
        if cfg.key_space == "pre_rope" and rope is None:
            raise ValueError("pre-RoPE keys need the model's rotary embedding")
        self.logical = self.sinks + self.stored_coefs

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def sinks(self) -> int:
        return self.sink_k.shape[1]

    @property
    def stored_coefs(self) -> int:
        return self.coef_k.shape[1]

    def stored_length(self) -> int:
        return self.sinks + self.stored_coefs + self.buf_k.shape[1]

    def nbytes(self) -> int:
        return tensor_bytes(self.sink_k, self.sink_v, self.basis_k, self.basis_v, self.coef_k, self.coef_v,
                            self.scale_k, self.scale_v, self.query_coef, self.buf_k, self.buf_v,
                            self.out_idx, self.out_k, self.out_v)

    # --- coefficients <-> vectors -----------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope(positions)
        return cos.to(self.sink_k.dtype), sin.to(self.sink_k.dtype)

    def _encode(self, x: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        coef = project(to_groups(x, basis.shape[0]).float(), basis.float())
        if self.cfg.coef_dtype == "int8":
            return quantize_int8(coef, self.sink_k.dtype)
        return coef.to(self.sink_k.dtype), None

    def _decode_rows(self, coef, scale, basis, idx) -> torch.Tensor:
        rows = gather_rows(coef, idx)
        if scale is not None:
            rows = dequantize_int8(rows, gather_rows(scale, idx), basis.dtype)
        return torch.matmul(rows.to(basis.dtype), head_blocks(basis, self.heads).transpose(1, 2))

    def _fold(self, n: int) -> None:
        """Move the oldest `n` buffer tokens into coefficients with the existing bases."""
        if n <= 0:
            return
        k, v = self.buf_k[:, :n], self.buf_v[:, :n]
        if self.cfg.key_space == "pre_rope":
            start = self.sinks + self.stored_coefs
            k = undo_rope(k, *self._rope(torch.arange(start, start + n)))
        ck, sk = self._encode(k, self.basis_k)
        cv, sv = self._encode(v, self.basis_v)
        self.coef_k = torch.cat([self.coef_k, ck], dim=1)
        self.coef_v = torch.cat([self.coef_v, cv], dim=1)
        if sk is not None:
            self.scale_k = torch.cat([self.scale_k, sk], dim=1)
            self.scale_v = torch.cat([self.scale_v, sv], dim=1)
        self.buf_k, self.buf_v = self.buf_k[:, n:].clone(), self.buf_v[:, n:].clone()

    # --- cache protocol ---------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("a compressed s4r cache holds one sequence (batch size 1)")
        q = key_states.shape[-2]
        excess = self.buf_k.shape[1] + q - self.cfg.buffer_tokens
        if excess > 0:
            step = self.cfg.fold_tokens
            self._fold(min(self.buf_k.shape[1], math.ceil(excess / step) * step))
        self.buf_k = torch.cat([self.buf_k, key_states[0]], dim=1)
        self.buf_v = torch.cat([self.buf_v, value_states[0]], dim=1)
        self.logical += q
        keys = self.buf_k.unsqueeze(0)
        handoff(self, keys)
        return keys, self.buf_v.unsqueeze(0)

    def compact(self) -> None:
        """Fold the buffer down to its cap (after a long appended document)."""
        excess = self.buf_k.shape[1] - self.cfg.buffer_tokens
        if excess > 0:
            self._fold(excess)

    def attend(self, query, key, value, scaling):
        q_len = query.shape[2]
        qh = query[0]  # [Hq, q, d]
        if self.cfg.key_space == "pre_rope":
            qh = undo_rope(qh, *self._rope(torch.arange(self.logical - q_len, self.logical)))
        n_rep = qh.shape[0] // self.heads
        kb = head_blocks(self.basis_k, self.heads)  # [H, d, r]
        q_coef = torch.matmul(qh.reshape(self.heads, n_rep * q_len, -1).to(kb.dtype), kb)
        q_coef = q_coef.view(qh.shape[0], q_len, -1).to(self.sink_k.dtype)
        if self.query_coef is not None:
            q_coef = torch.cat([self.query_coef, q_coef], dim=1)
        self.query_coef = q_coef[:, -self.cfg.query_window :].clone()

        parts_k, parts_v = [self.sink_k], [self.sink_v]
        if self.out_k is not None:
            parts_k.append(self.out_k)
            parts_v.append(self.out_v)
        n = self.stored_coefs
        if n:
            idx = self._select(scaling, n)
            rec_k = self._decode_rows(self.coef_k, self.scale_k, self.basis_k, idx)
            rec_v = self._decode_rows(self.coef_v, self.scale_v, self.basis_v, idx)
            if self.cfg.key_space == "pre_rope":
                cos, sin = self._rope(idx.reshape(-1) + self.sinks)
                rec_k = apply_rope(rec_k, cos.view(*idx.shape, -1), sin.view(*idx.shape, -1))
            parts_k.append(rec_k.to(self.sink_k.dtype))
            parts_v.append(rec_v.to(self.sink_v.dtype))
        parts_k.append(self.buf_k)
        parts_v.append(self.buf_v)
        keys = torch.cat(parts_k, dim=1).unsqueeze(0)
        values = torch.cat(parts_v, dim=1).unsqueeze(0)
        prefix = keys.shape[2] - self.buf_k.shape[1]
        return causal_attention(query, keys, values, scaling, prefix=prefix)

    def _select(self, scaling: float, n: int) -> torch.Tensor:
        q_mean = self.query_coef.float().mean(dim=1)
        scores = latent_scores(self.coef_k, self.scale_k, q_mean, self.heads)
        if self.cfg.pool == "avg":
            scores = torch.softmax(scores * scaling, dim=-1)
        scores = pool_scores(scores, self.cfg.pool_kernel, self.cfg.pool)
        if self.out_idx is not None:
            # outliers are attended exactly already; don't spend reconstruction slots on them
            scores[:, self.out_idx.long()] = float("-inf")
        forced = max(0, self.cfg.local_window - self.buf_k.shape[1])
        exact = 0 if self.out_idx is None else self.out_idx.shape[0]
        k = min(self.cfg.reconstruct_count(n), n - forced - exact)
        return select_tokens(scores, k, forced)

    def truncate(self, logical: int) -> None:
        logical = max(self.sinks, min(self.logical, logical))
        keep_buf = max(0, logical - self.sinks - self.stored_coefs)
        self.buf_k, self.buf_v = self.buf_k[:, :keep_buf], self.buf_v[:, :keep_buf]
        keep_coef = min(self.stored_coefs, logical - self.sinks)
        if self.out_idx is not None and bool((self.out_idx >= keep_coef).any()):
            keep = self.out_idx < keep_coef
            self.out_idx = self.out_idx[keep]
            self.out_k, self.out_v = self.out_k[:, keep], self.out_v[:, keep]
        if keep_coef < self.stored_coefs:
            # clone so the dropped rows are freed, not kept alive behind a view
            self.coef_k, self.coef_v = self.coef_k[:, :keep_coef].clone(), self.coef_v[:, :keep_coef].clone()
            if self.scale_k is not None:
                self.scale_k = self.scale_k[:, :keep_coef].clone()
                self.scale_v = self.scale_v[:, :keep_coef].clone()
        self.logical = logical
