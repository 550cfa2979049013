"""OpenAI-style chat messages rendered into the text a session sees, with the places a held document
prefix may end.

The rendering follows the session's own chat segments (`s4r.runtime.chat_format`): the text before the
first user message (system prompt included), the first user message, then answers and later questions,
ending where the assistant's answer starts. A document cache holds the first part of that text: either
the text before the first user message (a long system prompt) or that text with the first user message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from s4r.errors import S4RError
from s4r.runtime.chat_format import chat_segments

SYSTEM_ROLES = ("system", "developer")
CHAT_ROLES = ("user", "assistant")


class PromptError(S4RError):
    """The messages of a request cannot be rendered into a chat (bad roles, order or content)."""


@dataclass(frozen=True)
class Message:
    """One chat message with its text content."""

    role: str
    content: str


@dataclass(frozen=True)
class RenderedPrompt:
    """A request's prompt text and where its parts end.

    `head_end`: end of the text before the first user message; `first_end`: end of the first user
    message's content. `boundaries` are the ends of every part, where a held prefix may stop.
    """

    system: str | None
    first_user: str
    text: str
    head_end: int
    first_end: int
    boundaries: frozenset[int]

    def may_end_at(self, length: int) -> bool:
        """Whether a held prefix of `length` characters ends at a part's end or before whitespace (so
        the rest is not tokenized from inside a word)."""
        return length in self.boundaries or (length < len(self.text) and self.text[length].isspace())


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise PromptError("only text content parts are supported ({'type': 'text', 'text': ...})")
            texts.append(text)
        return "\n".join(texts)
    if content is None:
        raise PromptError("a message has no content")
    raise PromptError("message content must be a string or a list of text parts")


def _turns(messages: Sequence[Message]) -> tuple[str | None, list[tuple[str, str]]]:
    """(system text, [(role, text)] of the rest); refuses what no chat is."""
    if not messages:
        raise PromptError("messages must not be empty")
    system = None
    rest = list(messages)
    if rest[0].role in SYSTEM_ROLES:
        system, rest = rest[0].content.strip(), rest[1:]
    turns: list[tuple[str, str]] = []
    for m in rest:
        if m.role in SYSTEM_ROLES:
            raise PromptError("a system message may only come first")
        if m.role not in CHAT_ROLES:
            raise PromptError(f"unsupported message role '{m.role}' (system, user or assistant)")
        if turns and turns[-1][0] == m.role == "assistant":
            raise PromptError("two assistant messages in a row")
        turns.append((m.role, m.content.strip()))
    if not turns or turns[0][0] != "user":
        raise PromptError("the first message after the system message must be a user message")
    if turns[-1][0] != "user":
        raise PromptError("the last message must be a user message")
    if not turns[0][1]:
        raise PromptError("the first user message is empty")
    return system or None, turns


def render(messages: Sequence[Message], tokenizer: Any, default_system: str | None = None) -> RenderedPrompt:
    """The prompt of `messages` in the tokenizer's chat format, up to the start of the answer.

    `default_system` stands in for a missing system message.
    """
    system, turns = _turns(messages)
    if system is None:
        system = default_system
    seg = chat_segments(tokenizer, system)
    text = seg.first_user
    head_end = len(text)
    bounds = {head_end}
    text += turns[0][1]
    first_end = len(text)
    bounds.add(first_end)
    for (before, _), (role, content) in zip(turns, turns[1:], strict=False):
        # user messages in a row make one turn, joined as documents are
        if role == "assistant":
            text += seg.to_assistant
        else:
            text += "\n\n" if before == "user" else seg.next_user
        bounds.add(len(text))
        text += content
        bounds.add(len(text))
    text += seg.to_assistant
    return RenderedPrompt(system, turns[0][1], text, head_end, first_end, frozenset(bounds))
