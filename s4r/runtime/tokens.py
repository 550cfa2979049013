"""Token-id helpers of a chat: where an answer stops, and cutting a document down to a length."""

from __future__ import annotations

from typing import Any

# end-of-turn tokens of the chat templates s4r meets, besides the tokenizer's and model's own EOS
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<end_of_turn>")


def stop_token_ids(tokenizer: Any, model: Any) -> set[int]:
    """Ids that end an answer: the tokenizer's and the generation config's EOS, and the end-of-turn
    tokens the tokenizer knows."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in END_OF_TURN_TOKENS:
        tid = convert(token) if convert is not None else None
        if isinstance(tid, int) and tid != unk and tid >= 0:
            ids.add(tid)
    return ids


def truncate_ids(ids: list[int], limit: int, how: str) -> list[int]:
    """Keep at most `limit` token ids: the head, the tail, or both ends around a dropped middle."""
    if len(ids) <= limit:
        return ids
    if how == "head":
        return ids[:limit]
    if how == "tail":
        return ids[len(ids) - limit :]
    if how == "middle":
        first = limit // 2
        return ids[:first] + ids[len(ids) - (limit - first) :]
    raise ValueError(f"unknown truncation '{how}' (head, tail or middle)")
