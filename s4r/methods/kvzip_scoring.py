"""KVzip's context-reconstruction scores (Kim et al., 2025, arXiv 2505.23416), chunked.

After the prefill the model is asked to repeat the context: for each chunk of the context, a "repeat the
previous context" request (for later chunks: "repeat the part ... starting with" + the last tokens of
the chunk before), the chat template's turn to the assistant, then the chunk itself are fed after the
cached prompt. Each fed chunk attends to the whole cached prompt and its own tokens, exactly as the
model would (so its hidden states are the model's), and is dropped afterwards.

A KV pair's score is the largest attention any reconstruction query (and any query head of its KV
group) gives it, with the softmax taken as KVzip takes it: over the protected head of the prompt (the
chat template's system part), the chunk being repeated and the fed tokens only. That local normalization
is what makes a token score high when the copy of *this* chunk needs it; normalized over the whole
prompt, tokens that every query leans on (punctuation, line breaks) win in every chunk and the rare
tokens a copy needs (a needle's digits) rank no better than chance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from s4r.hf.attention import handoff, install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import forward_tokens
from s4r.layers.full import CacheLayer, staged_tensors


@dataclass(frozen=True)
class RepeatChunk:
    """One scoring forward: the context tokens [begin, end) it repeats and the ids fed for it."""

    begin: int
    end: int
    ids: list[int]


@dataclass(frozen=True)
class RepeatPrompts:
    """Token ids of KVzip's reconstruction requests (already in the model's chat format)."""

    first: list[int]  # "Repeat the previous context exactly."
    part: list[int]  # "Repeat the part of the previous context exactly, starting with "
    to_answer: list[int]  # the chat template from the end of a user turn to the start of the answer
    overlap: int = 8  # tokens of the chunk before quoted after `part`


def repeat_chunks(context_ids: Sequence[int], chunk_tokens: int, prompts: RepeatPrompts) -> list[RepeatChunk]:
    """KVzip's self-task: per chunk of `context_ids`, the request, the turn to the answer, the chunk."""
    ids = list(context_ids)
    chunks = []
    for begin in range(0, len(ids), chunk_tokens):
        end = min(begin + chunk_tokens, len(ids))
        ask = prompts.first if begin == 0 else prompts.part + ids[max(0, begin - prompts.overlap) : begin]
        chunks.append(RepeatChunk(begin, end, ask + prompts.to_answer + ids[begin:end]))
    return chunks


class ScoringLayer(CacheLayer):
    """A staged layer's keys/values (not copied) plus the chunk being fed; records attention maxima."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, head: int = 0, local: bool = True) -> None:
        super().__init__()
        self.ctx_k, self.ctx_v = keys, values  # [H, T, d] post-RoPE
        self.new_k = self.new_v = None
        self.logical = keys.shape[1]
        self.head = head  # always-visible (and always kept) prompt head in the local softmax
        self.local = local
        self.begin, self.end = 0, keys.shape[1]
        self.scores = torch.zeros(keys.shape[0], keys.shape[1], dtype=torch.float32, device=keys.device)

    def start_chunk(self, begin: int = 0, end: int | None = None) -> None:
        """Forget the previous chunk's tokens (positions restart right after the context); the next
        queries repeat the context tokens [begin, end) and score only those."""
        self.new_k = self.new_v = None
        self.logical = self.ctx_k.shape[1]
        self.begin, self.end = begin, self.ctx_k.shape[1] if end is None else end

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
        own_sum = own.sum(dim=-1, keepdim=True, dtype=torch.float32)
        denom = ctx.sum(dim=-1, keepdim=True, dtype=torch.float32) + own_sum
        self._record(ctx, own_sum, denom)
        denom = denom.to(ctx.dtype)
        out = (torch.matmul(ctx, self.ctx_v) + torch.matmul(own, self.new_v)) / denom
        return out.view(1, heads * n_rep, q_len, -1).to(query.dtype)

    def _record(self, weights: torch.Tensor, own_sum: torch.Tensor, denom: torch.Tensor) -> None:
        """Raise the scores of the repeated tokens to this chunk's largest attention to each.

        `weights` [H, rows, T] are the unnormalized context weights, `own_sum` and `denom` [H, rows, 1]
        the fed tokens' and everything's sums (float32).
        """
        b, e = self.begin, self.end
        if self.local:
            head = min(self.head, b)  # the chunk itself may start inside the head
            denom = own_sum + weights[..., b:e].sum(dim=-1, keepdim=True, dtype=torch.float32)
            if head:
                denom = denom + weights[..., :head].sum(dim=-1, keepdim=True, dtype=torch.float32)
        chunk = (weights[..., b:e].float() / denom).amax(dim=1)
        self.scores[:, b:e] = torch.maximum(self.scores[:, b:e], chunk)

    def truncate(self, logical: int) -> None:
        self.logical = min(self.logical, logical)


def kvzip_scores(model, cache: CompressedCache, chunks: Sequence[RepeatChunk], head: int = 0,
                 local: bool = True) -> list[torch.Tensor]:
    """Per layer [H, T]: each cached token's largest attention from the context-reconstruction queries.

    `cache` is the staged (uncompressed) cache of the context; it is read, never changed. `chunks` (see
    `repeat_chunks`) are fed one at a time after it; each scores the context tokens it repeats. `head`
    is the prompt's protected head (the chat template before the document), visible in the local
    softmax; `local=False` normalizes over the whole context instead (the earlier approximation).
    """
    install(model)
    device = next(model.parameters()).device
    layers = [ScoringLayer(*staged_tensors(layer)[:2], head=head, local=local) for layer in cache.layers]
    scoring = CompressedCache(len(layers), cache.shape, query_window=0)
    scoring.layers = layers
    start = cache.logical_length()
    with torch.inference_mode():
        for chunk in chunks:
            for layer in layers:
                layer.start_chunk(chunk.begin, chunk.end)
            ids = torch.tensor(chunk.ids, dtype=torch.long, device=device)
            forward_tokens(model, scoring, ids.unsqueeze(0), start)
    return [layer.scores for layer in layers]
