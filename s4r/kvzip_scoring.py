"""KVzip's context-reconstruction scores (Kim et al., 2025, arXiv 2505.23416), chunked.

After the prefill the model is asked to repeat the context: a "repeat the previous context" prompt
followed by the context itself is fed after the cached prompt. A KV pair matters as much as the most
any of these reconstruction queries attends to it (max over the queries and the query heads of its KV
group). As in KVzip's chunked scoring, the repeated context goes in chunks: each chunk sees the whole
cached prompt, the repeat prompt and its own tokens (not the earlier chunks), so the extra cost is about
one more prefill of the context, and the scoring cache is dropped afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import handoff, install
from .cache import CompressedCache, staged_tensors
from .generation import forward_tokens
from .layers import CacheLayer


class ScoringLayer(CacheLayer):
    """A staged layer's keys/values (not copied) plus the chunk being fed; records attention maxima."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.ctx_k, self.ctx_v = keys, values  # [H, T, d] post-RoPE
        self.new_k = self.new_v = None
        self.logical = keys.shape[1]
        self.scores = torch.zeros(keys.shape[0], keys.shape[1], dtype=torch.float32, device=keys.device)

    def start_chunk(self) -> None:
        """Forget the previous chunk's tokens (positions restart right after the context)."""
        self.new_k = self.new_v = None
        self.logical = self.ctx_k.shape[1]

    def stored_length(self) -> int:
        return self.logical

    def nbytes(self) -> int:
        return 0  # a transient view of the staged cache

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = key_states[0], value_states[0]
        self.new_k = k if self.new_k is None else torch.cat([self.new_k, k], dim=1)
        self.new_v = v if self.new_v is None else torch.cat([self.new_v, v], dim=1)
        self.logical += k.shape[1]
        keys = torch.cat([self.ctx_k, self.new_k], dim=1).unsqueeze(0)
        handoff(self, keys)  # the attention function gets no handle on the cache: name this layer to it
        return keys, torch.cat([self.ctx_v, self.new_v], dim=1).unsqueeze(0)

    def attend(self, query, key, value, scaling):
        heads, q_len = self.ctx_k.shape[0], query.shape[2]
        n_rep = query.shape[1] // heads
        # the model's dtype (bf16 matmuls are about twice as fast on CPU; ranking tolerates the rounding)
        q = query[0].reshape(heads, n_rep * q_len, -1) * scaling
        # one exp pass over the context logits (in place): the softmax, the scores and the output
        ctx = torch.matmul(q, self.ctx_k.transpose(1, 2))  # [H, n_rep*q, T]
        own = torch.matmul(q, self.new_k.transpose(1, 2))  # [H, n_rep*q, q]
        q_pos = torch.arange(q_len, device=q.device).repeat(n_rep)
        future = torch.arange(q_len, device=q.device).unsqueeze(0) > q_pos.unsqueeze(1)
        own.masked_fill_(future, float("-inf"))
        top = torch.maximum(ctx.amax(dim=-1, keepdim=True), own.amax(dim=-1, keepdim=True))
        ctx.sub_(top).exp_()
        own.sub_(top).exp_()
        denom = (ctx.sum(dim=-1, keepdim=True, dtype=torch.float32)
                 + own.sum(dim=-1, keepdim=True, dtype=torch.float32)).to(ctx.dtype)
        ctx.div_(denom)
        own.div_(denom)
        self.scores = torch.maximum(self.scores, ctx.amax(dim=1).float())
        out = torch.matmul(ctx, self.ctx_v) + torch.matmul(own, self.new_v)
        return out.view(1, heads * n_rep, q_len, -1).to(query.dtype)

    def truncate(self, logical: int) -> None:
        self.logical = min(self.logical, logical)


def kvzip_scores(model, cache: CompressedCache, context_ids: Sequence[int], repeat_ids: Sequence[int],
                 chunk_tokens: int = 512) -> list[torch.Tensor]:
    """Per layer [H, T]: each cached token's largest attention from the context-reconstruction queries.

    `cache` is the staged (uncompressed) cache of `context_ids`; it is read, never changed.
    """
    install(model)
    device = next(model.parameters()).device
    layers = [ScoringLayer(*staged_tensors(layer)[:2]) for layer in cache.layers]
    scoring = CompressedCache(len(layers), cache.shape, query_window=0)
    scoring.layers = layers
    start = cache.logical_length()
    ids = list(context_ids)
    with torch.inference_mode():
        for begin in range(0, len(ids), chunk_tokens):
            for layer in layers:
                layer.start_chunk()
            chunk = torch.tensor(list(repeat_ids) + ids[begin : begin + chunk_tokens], dtype=torch.long,
                                 device=device)
            forward_tokens(model, scoring, chunk.unsqueeze(0), start)
    return [layer.scores for layer in layers]
