"""`Engine`: one model answering chat requests over the documents of a `DocumentStore`, one at a time.

A request's prompt is rendered (`s4r.serving.prompt`); the longest held document prefix of it is
reused (from memory or from disk), or a long new one is ingested and kept; the rest of the prompt is
prefilled over a fork of that cache and the answer decoded (`s4r.serving.generate`). Requests run in
order behind one lock: the model and its attention hand-off serve a single forward at a time.

Under torchrun (a tensor-parallel model) rank 0's engine takes the calls and the other ranks' engines
`follow` it (`s4r.serving.lockstep`). Once a rank is lost the process group is unusable: the engine
keeps the error in `failed` and raises it for every later call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from s4r.distributed.world import current, lost
from s4r.errors import ContextTooLongError, RankError
from s4r.runtime.tokens import stop_token_ids
from s4r.serving import lockstep
from s4r.serving.disk_index import prefix_key
from s4r.serving.document_store import Checkout, DocumentStore, HeldDocument, StoreSnapshot, cache_bytes
from s4r.serving.generate import Generated, Sampling, generate
from s4r.serving.prompt import Message, RenderedPrompt, render

# a first user message (or system prompt) of at least this many tokens is a document worth keeping
MIN_DOCUMENT_TOKENS = 256


@dataclass(frozen=True)
class Completion:
    """One answer with what it cost: `cached_tokens` of the prompt came from a held document
    (`cache`: "memory", "disk", "new" when ingested now, "none" when not kept)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    cache: str
    document: str | None
    document_seconds: float
    prefill_s: float
    decode_s: float
    kv_bytes: int
    kv_full_bytes: int


@dataclass
class EngineCounters:
    """Totals since the engine started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cancelled: int = 0
    last: dict[str, float] = field(default_factory=dict)


class Engine:
    """Answers chat messages over held documents (see the module doc). Thread-safe: one request at a
    time holds `lock`."""

    def __init__(self, loaded: Any, store: DocumentStore, *, default_system: str | None = None,
                 max_tokens: int = 512, min_document_tokens: int = MIN_DOCUMENT_TOKENS,
                 chunk_size: int = 512) -> None:
        self.loaded = loaded
        self.store = store
        self.default_system = default_system
        self.max_tokens = max_tokens
        self.min_document_tokens = min_document_tokens
        self.chunk_size = chunk_size
        self.context_length = int(loaded.context_length)
        self.lock = threading.Lock()
        self.counters = EngineCounters()
        self.failed: RankError | None = None
        self._stop_ids = stop_token_ids(loaded.tokenizer, loaded.model)

    def _encode(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: Sequence[Message]) -> RenderedPrompt:
        """The prompt of `messages` (PromptError when they are no chat)."""
        return render(messages, self.loaded.tokenizer, self.default_system)

    def preload(self, text: str, name: str) -> tuple[HeldDocument, bool]:
        """Hold `text` as a first user message's document (after the default system prompt). Returns the
        document and whether it was ingested now (False: it was held already, in memory or on disk)."""
        prompt = self.render([Message("user", text)])
        prefix = prompt.text[:prompt.first_end]
        with self.lock, self._ranks_checked():
            lockstep.lead(lockstep.PRELOAD, text, name)
            doc = self.store.get(prefix_key(prefix))
            if doc is not None:
                return doc, False
            checkout = self.store.ingest(prefix, system=prompt.system, body=prompt.first_user, name=name,
                                         fork=False)
            assert checkout.document is not None
            return checkout.document, True

    def _document(self, prompt: RenderedPrompt, name: str) -> tuple[Checkout, int]:
        """A cache for the prompt's document part, and where in the prompt text the rest starts."""
        doc = self.store.find(prompt)
        if doc is not None:
            checkout = self.store.checkout(doc)
            if checkout is not None:
                return checkout, doc.length
        text = prompt.text
        if len(self._encode(prompt.first_user)) >= self.min_document_tokens:
            end, body, keep = prompt.first_end, prompt.first_user, True
        elif prompt.system and len(self._encode(text[:prompt.head_end])) >= self.min_document_tokens:
            end, body, keep = prompt.head_end, "", True
        else:
            end, body, keep = prompt.first_end, prompt.first_user, False
        return self.store.ingest(text[:end], system=prompt.system, body=body, name=name, keep=keep), end

    def complete(self, messages: Sequence[Message] | RenderedPrompt, sampling: Sampling, *,
                 on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] = lambda: False,
                 on_prefilled: Callable[[], None] | None = None, name: str = "request") -> Completion:
        """Answer `messages`; text pieces stream through `on_text`, `on_prefilled` is called once the
        prompt is in the cache and the answer begins. A request cancelled before it gets the lock
        answers nothing (finish reason "cancelled").

        Raises PromptError for messages that are no chat and ContextTooLongError for a prompt over the
        model's context.
        """
        prompt = messages if isinstance(messages, RenderedPrompt) else self.render(messages)
        with self.lock:
            if cancelled():
                self.counters.cancelled += 1
                return Completion("", "cancelled", 0, 0, 0, 0, "none", None, 0.0, 0.0, 0.0, 0, 0)
            with self._ranks_checked():
                lockstep.lead(lockstep.COMPLETE, prompt, sampling, name)
                completion = self._complete(prompt, sampling, name, on_text, on_prefilled, cancelled)
            self._count(completion)
        return completion

    def _complete(self, prompt: RenderedPrompt, sampling: Sampling, name: str,
                  on_text: Callable[[str], None] | None, on_prefilled: Callable[[], None] | None,
                  cancelled: Callable[[], bool]) -> Completion:
        """`complete` once it holds the lock (and, under torchrun, the followers make the same call)."""
        checkout, end = self._document(prompt, name)
        rest_ids = self._encode(prompt.text[end:])
        start = checkout.cache.logical_length()
        room = self.context_length - start - len(rest_ids)
        if room < 1:
            raise ContextTooLongError(start + len(rest_ids) + 1, self.context_length)
        limited = Sampling(**{**vars(sampling), "max_tokens": min(sampling.max_tokens, room)})
        out: Generated = generate(
            self.loaded.model, self.loaded.tokenizer, checkout.cache, rest_ids, start=start,
            stop_ids=self._stop_ids, sampling=limited, chunk_size=self.chunk_size,
            device=self.loaded.device, on_text=on_text, on_prefilled=on_prefilled, cancelled=cancelled)
        reused = checkout.source in ("memory", "disk")
        doc = checkout.document
        stored, full = cache_bytes(checkout.cache)
        completion = Completion(
            text=out.text, finish_reason=out.finish_reason, prompt_tokens=start + len(rest_ids),
            cached_tokens=start if reused else 0, prefilled_tokens=len(rest_ids),
            completion_tokens=out.tokens, cache=checkout.source, document=doc.key if doc else None,
            document_seconds=checkout.seconds, prefill_s=out.prefill_s, decode_s=out.decode_s,
            kv_bytes=stored, kv_full_bytes=full)
        return completion

    @contextmanager
    def _ranks_checked(self) -> Iterator[None]:
        """Under torchrun: refuse work once a rank was lost, and keep the error of a collective that
        failed (raised as RankError)."""
        if self.failed is not None:
            raise self.failed
        try:
            yield
        except RankError as exc:
            self.failed = exc
            raise
        except RuntimeError as exc:
            if not current().distributed:
                raise
            self.failed = lost(exc)
            raise self.failed from None
        except KeyboardInterrupt:
            if current().distributed:  # stopped between two collectives: the other ranks wait in one
                self.failed = RankError("rank 0 was interrupted in the middle of a call all ranks make")
            raise

    def follow(self) -> bool:
        """On a follower rank under torchrun: make rank 0's calls until it releases the ranks (see
        `s4r.serving.lockstep.follow`). Returns whether rank 0 ended well."""
        return lockstep.follow(self)

    def keepalive(self) -> bool:
        """On rank 0 under torchrun, between requests: tell the waiting followers this rank is still
        there. Returns False once a rank is lost (then `failed` says why)."""
        with self.lock:
            try:
                with self._ranks_checked():
                    lockstep.keepalive()
            except RankError:
                return False
        return True

    def release_followers(self, ok: bool = True) -> None:
        """On rank 0 under torchrun, at the end: end the followers' `follow` (nothing to do once a rank
        was lost: the followers end on their own then)."""
        with self.lock:
            if self.failed is None:
                with suppress(RankError):  # a follower that died unnoticed: rank 0 is ending anyway
                    lockstep.release(ok)

    def _count(self, c: Completion) -> None:
        n = self.counters
        n.requests += 1
        n.cancelled += c.finish_reason == "cancelled"
        n.prompt_tokens += c.prompt_tokens
        n.cached_tokens += c.cached_tokens
        n.prefilled_tokens += c.prefilled_tokens
        n.completion_tokens += c.completion_tokens
        n.prefill_seconds += c.prefill_s
        n.decode_seconds += c.decode_s
        n.last = {"prefill_tok_s": c.prefilled_tokens / c.prefill_s if c.prefill_s > 0 else 0.0,
                  "decode_tok_s": c.completion_tokens / c.decode_s if c.decode_s > 0 else 0.0}

    def snapshot(self) -> tuple[EngineCounters, StoreSnapshot]:
        """The engine's and the store's figures now."""
        return self.counters, self.store.snapshot()
