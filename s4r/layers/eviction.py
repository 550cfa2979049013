"""Token eviction storage: the cache layer of the evicting baselines (StreamingLLM, SnapKV).

An evicting method keeps a subset of the prompt's tokens in full precision and drops the rest for
good. Keys are stored post-RoPE, so a kept token keeps its true position without storing it: the
attention over the kept tokens is exact, only the dropped ones are missing.
"""

from __future__ import annotations

from typing import Any

import torch

from s4r.core.budget import KVShape, eviction_budget_tokens
from s4r.errors import BudgetError
from s4r.hf.attention import causal_attention, handoff
from s4r.layers.full import CacheLayer, StagingLayer, staged_tensors, tensor_bytes

# Appended tokens grow the storage in fixed steps: amortized appends without the doubling slack a
# StagingLayer allows itself (which would show up in a memory benchmark as a bigger cache).
GROW_TOKENS = 128


def eviction_budget(shape: KVShape, tokens: int, ratio: float, reserve: int) -> int:
    """Prompt tokens an evicting method keeps so that, with `reserve` more tokens appended (the question
    and the start of the answer), it stores about 1/ratio of the full cache.

    `reserve` is S4R's `buffer_tokens`: S4R's rank solver counts a full buffer of new tokens, so both
    kinds of method stay within the same bytes at the question.
    """
    kept = eviction_budget_tokens(shape, tokens, ratio) - reserve
    if kept < 1:
        raise BudgetError(
            f"ratio {ratio:g} is not reachable for {tokens} tokens by eviction: 1/ratio of the cache is "
            f"{eviction_budget_tokens(shape, tokens, ratio)} tokens, not more than the {reserve} reserved "
            "for the question (use a lower --ratio or a longer document)"
        )
    return min(kept, tokens)


class EvictedLayer(CacheLayer):
    """The kept prompt tokens of one layer, per KV head, followed by every token appended since.

    Storage is one [H, n, d] tensor per keys and values: first the `kept` prompt tokens (the same count
    for every head, though each head may keep different tokens), then the appended ones in order.
    The logical length stays the true position count; the stored length is smaller. Nothing is
    evicted after compression, so appended tokens each cost a full token.
    """

    exact_fallback = True  # `update` returns every kept and appended token

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, logical: int) -> None:
        """keys/values: [H, K, d] post-RoPE kept tokens; logical: the prompt length they came from."""
        super().__init__()
        if keys.dim() != 3 or keys.shape[:2] != values.shape[:2]:
            raise ValueError("kept keys and values must both be [heads, tokens, dim] with equal tokens")
        if keys.shape[1] > logical:
            raise ValueError(f"cannot keep {keys.shape[1]} tokens of a {logical}-token prompt")
        self._k = keys.contiguous()
        self._v = values.contiguous()
        self.kept = keys.shape[1]
        self._n = self.kept
        self.prompt_length = logical
        self.logical = logical

    @classmethod
    def from_staged(cls, layer: StagingLayer, idx: torch.Tensor) -> EvictedLayer:
        """Keep the prompt tokens `idx` of a staging layer: [K] for every head, or [H, K] per head."""
        keys, values, _ = staged_tensors(layer)
        idx = idx.to(keys.device)
        if idx.dim() == 1:
            # advanced indexing copies, so the full staging storage can be freed afterwards
            return cls(keys[:, idx], values[:, idx], layer.logical)
        heads, k = idx.shape
        if heads != keys.shape[0]:
            raise ValueError(f"per-head indices for {heads} heads, the layer has {keys.shape[0]}")
        kept_k = torch.gather(keys, 1, idx.unsqueeze(-1).expand(heads, k, keys.shape[-1]))
        kept_v = torch.gather(values, 1, idx.unsqueeze(-1).expand(heads, k, values.shape[-1]))
        return cls(kept_k, kept_v, layer.logical)

    # --- views and sizes --------------------------------------------------------------------------
    @property
    def keys_view(self) -> torch.Tensor:
        """[H, n, d]: kept then appended keys (a view of the storage)."""
        return self._k[:, : self._n]

    @property
    def values_view(self) -> torch.Tensor:
        return self._v[:, : self._n]

    @property
    def appended(self) -> int:
        """Tokens added after compression (question, answer, later turns)."""
        return self._n - self.kept

    def stored_length(self) -> int:
        return self._n

    def nbytes(self) -> int:
        """Bytes of the stored tokens (growth slack beyond them is allocator headroom, as in StagingLayer)."""
        return tensor_bytes(self.keys_view, self.values_view)

    # --- cache protocol ---------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("a compressed s4r cache holds one sequence (batch size 1)")
        n, q = self._n, key_states.shape[-2]
        if n + q > self._k.shape[1]:
            cap = n + q + GROW_TOKENS
            k = self._k.new_empty(self._k.shape[0], cap, self._k.shape[-1])
            v = self._v.new_empty(self._v.shape[0], cap, self._v.shape[-1])
            k[:, :n], v[:, :n] = self._k[:, :n], self._v[:, :n]
            self._k, self._v = k, v
        self._k[:, n : n + q] = key_states[0]
        self._v[:, n : n + q] = value_states[0]
        self._n = n + q
        self.logical += q
        keys = self.keys_view.unsqueeze(0)
        handoff(self, keys)  # the attention function gets no handle on the cache: name this layer to it
        return keys, self.values_view.unsqueeze(0)

    def attend(self, query, key, value, scaling):
        # `key`/`value` are the views `update` returned: every kept token is visible to every query, the
        # appended ones end with the queries' own tokens (bottom-right causal)
        return causal_attention(query, key, value, scaling, prefix=self.kept)

    def truncate(self, logical: int) -> None:
        """Forget appended tokens at or past `logical`.

        The kept prompt tokens do not record their positions, so they are one block: like the sinks of
        a LowRankLayer, truncation never cuts into them (it stops at the prompt length).
        """
        logical = max(self.prompt_length, min(self.logical, logical))
        self._n = self.kept + logical - self.prompt_length
        self.logical = logical

    # --- persistence --------------------------------------------------------------------------------
    kind = "evicted"

    def state(self) -> dict[str, torch.Tensor]:
        return {"k": self.keys_view, "v": self.values_view}

    def meta_state(self) -> dict[str, Any]:
        return {"kept": self.kept, "prompt_length": self.prompt_length, "logical": self.logical}

    @classmethod
    def from_state(cls, state, meta, *, rope=None) -> EvictedLayer:
        keys, values, kept = state["k"], state["v"], meta["kept"]
        layer = cls(keys[:, :kept], values[:, :kept], meta["prompt_length"])
        layer._k, layer._v, layer._n = keys.contiguous(), values.contiguous(), keys.shape[1]
        layer.logical = meta["logical"]
        return layer
