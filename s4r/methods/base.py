"""What a compression method is: a dataclass that turns a staged (full) cache into its stored form.

Each method owns its settings, as a kvpress press does: its dataclass fields (`OwnSettings`), or for the
S4R family the fields of `S4RConfig`. One overrides dict can go to every method (the benchmark and the
CLI pass one): each method takes the keys that name its settings and ignores the others, and
`s4r.methods.make_method` rejects a key that no registered method has (a typo).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

from s4r.core.rope import RopeFn
from s4r.hf.cache import CompressedCache


@dataclass(frozen=True)
class CompressContext:
    """What a method may use besides the staged cache."""

    rope: RopeFn | None
    ratio: float
    # what methods that re-run the model need (kvzip): the model, its tokenizer and the prompt's ids
    model: Any = None
    tokenizer: Any = None
    ids: Sequence[int] | None = None


class Method(Protocol):
    """A KV-cache method: `query_window` tells the prefill how many last queries to keep for it."""

    name: str
    query_window: int
    # optional: True when `compress` only needs the token count before building each layer from that
    # layer alone, so a layer-wise ingest can compress every layer as soon as it is complete (a method
    # without it is given the whole staged cache after a token-chunked prefill)
    layerwise: bool

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        """Compress `cache` in place after prefill; return what it chose (ranks, kept tokens...)."""
        ...


class OwnSettings:
    """A method dataclass whose init fields (besides `name`) are its settings, built from overrides."""

    # override names that mean one of this method's fields (S4R's `buffer_tokens`, the new tokens a
    # budget keeps room for, is an evicting method's `reserve`), so one overrides dict fits every method
    ALIASES: ClassVar[dict[str, str]] = {}

    @classmethod
    def settings(cls) -> frozenset[str]:
        """The override keys this method takes."""
        own = {f.name for f in fields(cls) if f.init and f.name != "name"}
        return frozenset(own | set(cls.ALIASES))

    @classmethod
    def build(cls, ratio: float, overrides: dict[str, Any] | None = None) -> Any:
        """This method for a target `ratio`, with the overrides that name its settings (the others are
        another method's and ignored; an explicit field name wins over an alias)."""
        own = {f.name for f in fields(cls) if f.init and f.name != "name"}
        kwargs: dict[str, Any] = {"ratio": ratio} if "ratio" in own else {}
        items = sorted((overrides or {}).items(), key=lambda kv: kv[0] in own)  # aliases first
        for key, value in items:
            name = key if key in own else cls.ALIASES.get(key)
            if name in own:
                kwargs[name] = value
        return cls(**kwargs)


def settings_of(builder: Any) -> frozenset[str]:
    """The override keys a registry builder takes: a method class's `build` knows its class's settings
    (any other builder declares none)."""
    owner = getattr(builder, "__self__", None)
    return owner.settings() if isinstance(owner, type) and hasattr(owner, "settings") else frozenset()
