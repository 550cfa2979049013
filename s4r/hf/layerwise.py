"""Layer-wise prefill: a whole text through one decoder layer at a time.

Token-chunked prefill sends every chunk through all layers, so each layer's keys/values of the whole
document exist at once before anything can be compressed. Here the order is swapped: every query block
of the document goes through layer 0, then through layer 1, and so on. As soon as a layer has seen the
whole text its cache layer is complete and can be compressed (`on_layer_done`), so an ingest holds the
compressed layers plus one layer's full keys/values, and the hidden states of the document (those
can wait in a temporary file between layers instead: `s4r.hf.hidden_spill`).

Each layer's state only depends on its own inputs in order, so the result is the same as token-chunked
prefill with the same block size: the same cache updates and attention calls, in a different order
across layers. The model's own decoder layers, rotary embedding, final norm and LM head are called;
nothing of the architecture is reimplemented.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from s4r.hf.attention import drop_handoff, ensure_handoff_taken
from s4r.hf.hidden_spill import HiddenInMemory, HiddenSpill, HiddenStates
from s4r.layers.segments import settle_layer

# architectures whose decoder is embed -> layers(hidden, position_embeddings, cache) -> norm -> lm_head,
# with nothing else between them (no embedding scale, no logit soft-capping)
LAYERWISE_ARCHS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# largest query block a session sends through one layer: the attention's transient memory grows with
# block x keys, and one layer's weights are cheap to apply again, so small blocks cost little time
LAYERWISE_BLOCK = 256


@dataclass(frozen=True)
class DecoderParts:
    """The pieces of a causal LM that layer-wise prefill calls, in order."""

    embed: Any
    layers: Any
    rotary: Any
    norm: Any
    lm_head: Any


def decoder_parts(model) -> DecoderParts | None:
    """The model's embedding, decoder layers, rotary embedding, final norm and head; None where the
    architecture is not one layer-wise prefill knows to be a plain stack of them."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "model_type", None) not in LAYERWISE_ARCHS:
        return None
    inner = getattr(model, "model", None)
    parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "rotary_emb", "norm")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if any(p is None for p in parts) or head is None:
        return None
    embed, layers, rotary, norm = parts
    return DecoderParts(embed, layers[: cfg.num_hidden_layers], rotary, norm, head)


def layerwise_prefill(model, cache, ids: torch.Tensor, start: int, block_size: int,
                      on_layer_done: Callable[[int], None] | None = None,
                      progress: Callable[[int, int], None] | None = None, *,
                      spill: bool = False, spill_dir: str | None = None) -> torch.Tensor:
    """Forward `ids` [n] at positions start..start+n-1 layer by layer; logits [vocab] of the last token.

    Queries go through each layer in blocks of `block_size` (attention memory stays bounded by a block
    against the keys so far); `on_layer_done(i)` runs once layer i has every token, before layer i+1
    starts. `progress(done, total)` is told the tokens' share of the layers done so far. With `spill`
    the hidden states wait between layers in a temporary file in `spill_dir` (default: the system's
    temp dir; see `s4r.hf.hidden_spill`), removed however this returns; the results are the same.
    """
    parts = decoder_parts(model)
    if parts is None:
        raise ValueError("layer-wise prefill does not support this model architecture")
    total = ids.shape[0]
    if total == 0:
        raise ValueError("nothing to prefill")
    positions = torch.arange(start, start + total, device=ids.device).unsqueeze(0)
    hidden = embed_text(parts.embed, ids, block_size, spill, spill_dir)
    try:
        run_layers(parts, hidden, cache, positions, block_size, on_layer_done, progress)
        last = hidden.read(total - 1, total)
    finally:
        hidden.close()
    return parts.lm_head(parts.norm(last))[0, -1]


def embed_text(embed, ids: torch.Tensor, block_size: int, spill: bool,
               spill_dir: str | None) -> HiddenStates:
    """The input embeddings of `ids`: one tensor, or written block by block into a spill file."""
    if not spill:
        return HiddenInMemory(embed(ids.unsqueeze(0)))
    store: HiddenSpill | None = None
    try:
        for begin in range(0, ids.shape[0], block_size):
            block = embed(ids[begin:begin + block_size].unsqueeze(0))
            if store is None:
                store = HiddenSpill(ids.shape[0], block.shape[-1], block.dtype, ids.device, spill_dir)
            store.write(begin, block)
    except BaseException:
        if store is not None:
            store.close()
        raise
    assert store is not None  # ids is not empty
    return store


def run_layers(parts: DecoderParts, hidden: HiddenStates, cache, positions: torch.Tensor,
               block_size: int, on_layer_done: Callable[[int], None] | None,
               progress: Callable[[int, int], None] | None) -> None:
    """Every block of `hidden` through layer 0, then layer 1, ...; each block's output replaces its
    input (a block's input is needed only by that block: earlier tokens are in the cache)."""
    total = positions.shape[1]
    n_layers = len(parts.layers)
    for i, layer in enumerate(parts.layers):
        for begin in range(0, total, block_size):
            end = min(begin + block_size, total)
            block, pos = hidden.read(begin, end), positions[:, begin:end]
            # per block: the rotary tables of a whole long document would be one more layer-sized tensor
            rotary = parts.rotary(block, pos)
            try:
                out = layer(block, attention_mask=None, position_ids=pos, cache=cache,
                            use_cache=True, position_embeddings=rotary)
            except BaseException:
                drop_handoff()  # stopped between the cache update and its attention
                raise
            ensure_handoff_taken()  # this layer's attention went through s4r attention
            hidden.write(begin, out)
        if on_layer_done is not None:
            on_layer_done(i)
        if progress is not None:
            progress(total * (i + 1) // n_layers, total)


def ingest_layerwise(model, cache, ids: torch.Tensor, start: int, block_size: int, *,
                     compress: Callable[[], None] | None,
                     progress: Callable[[int, int], None] | None = None,
                     after_layer: Callable[[], None] | None = None, spill: bool = False,
                     spill_dir: str | None = None) -> torch.Tensor:
    """Layer-wise prefill of `ids` into an `CompressedCache`, keeping at most one layer's full K/V.

    With `compress` (a fresh cache), it runs once layer 0 holds the whole text: the method plans from
    the token count and calls `cache.compress(build)` as usual, which builds layer 0 and keeps `build`
    for the layers still held; each later layer is built as soon as it is complete. Without it (text
    appended to a compressed cache), each layer folds its new tokens into its compressed form as soon as
    it has them. `after_layer` runs after each layer (to give freed memory back). Returns the last
    token's logits. On any error the held layers are let go; the caller restores or drops the cache.
    `spill` and `spill_dir`: where the hidden states wait between layers (see `layerwise_prefill`).
    """
    fresh = compress is not None
    total = ids.shape[0]
    dtype = model.get_input_embeddings().weight.dtype

    def layer_done(i: int) -> None:
        if fresh and i == 0:
            compress()
        elif fresh:
            cache.release_layer(i)
        else:
            settle_layer(cache, i)
        if after_layer is not None:
            after_layer()
        # the next layer's storage only once this one is compressed and freed
        if fresh and i + 1 < len(cache.layers):
            cache.reserve_layer(i + 1, total, dtype, ids.device)

    if fresh:
        cache.hold_layers(range(1, len(cache.layers)))
        cache.reserve_layer(0, total, dtype, ids.device)
    try:
        return layerwise_prefill(model, cache, ids, start, block_size, layer_done, progress,
                                 spill=spill, spill_dir=spill_dir)
    finally:
        cache.hold_layers(())
