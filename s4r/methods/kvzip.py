"""`kvzip`: query-agnostic eviction by context-reconstruction scores (KVzip, arXiv 2505.23416).

Per KV head, keep the prompt tokens the "repeat the context" queries attend to most (see
`s4r.methods.kvzip_scoring`); the prompt's head (the chat template's system part, as KVzip never evicts the
system prompt) and the attention sinks always among them. The budget is the evicting methods'
`floor(T / ratio) - reserve` tokens per head, the head counted inside it. Against the paper: the same
budget for every head and layer (KVzip's default spreads one threshold over all of them; ragged heads
would need a ragged eviction layer). Scoring runs the model once more over the context, which
`compress_seconds` includes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from s4r.errors import S4RError
from s4r.hf.cache import CompressedCache
from s4r.layers.full import StagingLayer
from s4r.methods.base import CompressContext
from s4r.methods.kvzip_scoring import RepeatPrompts, kvzip_scores, repeat_chunks
from s4r.methods.scorer import ScorerMethod, keep_top, protect_first
from s4r.runtime.chat_format import chat_segments

# KVzip's own requests (its `self_task`), in the model's chat format
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
REPEAT_PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "


def kvzip_indices(scores: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    """Positions [H, K] (ascending) kept per head: the first `sinks`, then the best scores."""
    return keep_top(protect_first(scores, sinks, budget), budget)


def prompt_head(ids: Sequence[int], head_ids: Sequence[int]) -> int:
    """How many of the prompt's first tokens are the chat template's head (0 when it does not start so)."""
    n = len(head_ids)
    return n if n and list(ids[:n]) == list(head_ids) else 0


def repeat_prompts(tokenizer) -> RepeatPrompts:
    """KVzip's requests as this tokenizer writes them, the answer opened by its chat template."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return RepeatPrompts(encode(REPEAT_PROMPT), encode(REPEAT_PART_PROMPT),
                         encode(chat_segments(tokenizer).to_assistant))


@dataclass
class KVzipMethod(ScorerMethod):
    """KVzip eviction; needs the model and the prompt's token ids in the compression context."""

    name: str = "kvzip"
    sinks: int = 4
    chunk_tokens: int = 2000  # KVzip's scoring chunk
    local_softmax: bool = True  # KVzip's normalization (False: over the whole prompt, the old variant)
    layerwise: ClassVar[bool] = False  # scoring re-reads the prompt through every layer
    _scores: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    _protect: int = field(default=0, init=False, repr=False)

    def prepare(self, cache: CompressedCache, ctx: CompressContext) -> None:
        if ctx.model is None or ctx.ids is None or ctx.tokenizer is None:
            raise S4RError("kvzip scores by re-reading the prompt: it needs the model, tokenizer and ids")
        tokens = cache.logical_length()
        if len(ctx.ids) != tokens:
            raise S4RError(f"kvzip got {len(ctx.ids)} prompt ids for a {tokens}-token cache")
        head_ids = ctx.tokenizer.encode(chat_segments(ctx.tokenizer).first_user, add_special_tokens=False)
        head = prompt_head(ctx.ids, head_ids)
        self._protect = max(self.sinks, head)
        chunks = repeat_chunks(ctx.ids, self.chunk_tokens, repeat_prompts(ctx.tokenizer))
        self._scores = kvzip_scores(ctx.model, cache, chunks, head=head, local=self.local_softmax)

    def score(self, i: int, layer: StagingLayer, budget: int) -> torch.Tensor:
        return protect_first(self._scores[i], self._protect, budget)

    def report(self, kept: int) -> dict[str, Any]:
        self._scores = None  # [layers, H, T] floats: not kept past the compression
        return {"chunk_tokens": self.chunk_tokens, "protected_tokens": min(self._protect, kept),
                "local_softmax": self.local_softmax}
