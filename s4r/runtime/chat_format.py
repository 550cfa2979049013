"""Split a tokenizer's chat template into the pieces a long-document chat appends one at a time."""

from __future__ import annotations

from dataclasses import dataclass

_MARKS = ("\x00S4R-USER-1\x00", "\x00S4R-ASSISTANT-1\x00", "\x00S4R-USER-2\x00")


@dataclass(frozen=True)
class ChatSegments:
    """Text around message contents.

    first_user: everything before the first user message's content (system prompt included);
    to_assistant: from the end of a user message to the start of the assistant's answer;
    next_user: from the end of an answer to the start of the next user message's content.
    """

    first_user: str
    to_assistant: str
    next_user: str


def chat_segments(tokenizer, system: str | None = None) -> ChatSegments:
    """Segments rendered by the tokenizer's chat template, or a plain fallback when it has none."""
    if getattr(tokenizer, "chat_template", None):
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages += [{"role": "user", "content": _MARKS[0]}, {"role": "assistant", "content": _MARKS[1]},
                     {"role": "user", "content": _MARKS[2]}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - templates are user data; fall back to the plain format
            text = None
        if text is not None and all(text.count(m) == 1 for m in _MARKS):
            first, rest = text.split(_MARKS[0])
            _, rest = rest.split(_MARKS[1])
            next_user, to_assistant = rest.split(_MARKS[2])
            return ChatSegments(first, to_assistant, next_user)
    head = "" if system is None else f"{system}\n\n"
    return ChatSegments(f"{head}User: ", "\nAssistant:", "\nUser: ")
