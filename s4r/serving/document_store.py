"""`DocumentStore`: compressed caches of document prefixes kept within a byte budget.

Each held document is a session whose cache holds one prefix of a prompt (a long system prompt, or that
with the first user message). Requests never write to it: they get a fork (`s4r.serving.forking`). The
documents in memory are kept within `budget_bytes` of stored cache bytes; the least recently used leave
first. With a cache folder every new document is saved there as soon as it is ingested (so a crash or a
restart loses none), leaving memory only drops it, and the next request for it loads it back; an index
in the folder (`s4r.serving.disk_index`) lets a restarted store find them by prefix. Without a folder, a
document that leaves memory is forgotten.

Under torchrun every rank has a store holding its heads' share of each cache (and its own part files),
and the ranks must decide alike (an ingest on one rank alone would leave the model's collectives
waiting): a document's bytes are its bytes over all ranks, so the budget and the eviction order are the
same on every rank, and a document counts as saved, loaded or found on disk only when it is on every
rank.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from s4r.distributed.rank_files import rank_path
from s4r.distributed.world import current, gather
from s4r.errors import CacheFileError
from s4r.hf.cache import CompressedCache
from s4r.runtime.session import Session
from s4r.runtime.session_files import session_identity
from s4r.serving.disk_index import SavedDocument, identity_folder, prefix_key, read_index, write_index
from s4r.serving.forking import fork_cache
from s4r.serving.prompt import RenderedPrompt

# Session settings that shape how a cache is made but are not part of what a saved cache must match
LOAD_KWARGS = ("truncate", "ingest", "hidden_spill")


def cache_bytes(cache: CompressedCache) -> tuple[int, int]:
    """The stored and the uncompressed bytes of `cache` over all ranks (under torchrun each holds its
    heads' share; called on every rank)."""
    parts = gather((int(cache.nbytes()), int(cache.full_nbytes())))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def on_every_rank(ok: bool) -> bool:
    """Whether `ok` holds on every rank (called on every rank; `ok` itself without torchrun)."""
    return all(gather(bool(ok)))


@dataclass
class HeldDocument:
    """One document prefix the store knows: in memory (`session` set), saved (`file` set), or both."""

    key: str
    length: int
    tokens: int
    name: str
    stored_bytes: int
    full_bytes: int
    session: Session | None = None
    file: str | None = None
    hits: int = 0

    def saved(self) -> SavedDocument:
        """Its record in the on-disk index."""
        return SavedDocument(self.key, self.length, self.tokens, self.name, self.stored_bytes,
                             self.full_bytes, str(self.file))


@dataclass(frozen=True)
class Checkout:
    """A cache for one request: a fork of a held document (`source` "memory" or "disk", how it was
    found; "new" when ingested for this request), or a one-off cache not kept ("none")."""

    cache: CompressedCache
    tokens: int
    source: str
    seconds: float
    document: HeldDocument | None


@dataclass
class StoreCounters:
    """What the store did since it started."""

    ingests: int = 0
    ingested_tokens: int = 0
    ingest_seconds: float = 0.0
    memory_hits: int = 0
    disk_hits: int = 0
    evictions: int = 0
    forgotten: int = 0
    load_failures: int = 0
    save_failures: int = 0


@dataclass(frozen=True)
class StoreSnapshot:
    """The store's figures at one moment (for /metrics and tests)."""

    budget_bytes: int
    resident_documents: int
    resident_bytes: int
    resident_full_bytes: int
    saved_documents: int
    counters: StoreCounters = field(default_factory=StoreCounters)

    @property
    def ratio(self) -> float:
        """Achieved compression ratio of the documents in memory (uncompressed bytes / stored bytes)."""
        return self.resident_full_bytes / self.resident_bytes if self.resident_bytes else 0.0


class DocumentStore:
    """Compressed document caches within `budget_bytes`, spilled to `cache_dir` (see the module doc).

    `session_kwargs` are the `Session` settings every document is made with (method, ratio, truncate,
    ingest, hidden_spill, config_overrides). Not thread-safe for its heavy work: one caller at a time
    (the engine's lock); `snapshot` may be called from anywhere.
    """

    def __init__(self, loaded: Any, *, budget_bytes: int, cache_dir: str | Path | None = None,
                 session_kwargs: dict[str, Any] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("the memory budget must not be negative")
        self.loaded = loaded
        self._budget_bytes = int(budget_bytes)
        self.session_kwargs = dict(session_kwargs or {})
        self._log = log or (lambda message: None)
        self.identity = session_identity(Session(loaded, **self.session_kwargs))
        ranks = current().size  # caches saved by N ranks keep to folders of their own
        where = self.identity if ranks == 1 else {**self.identity, "ranks": ranks}
        self.folder = identity_folder(Path(cache_dir), where) if cache_dir is not None else None
        self._docs: OrderedDict[str, HeldDocument] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.counters = StoreCounters()
        if self.folder is not None:
            found = read_index(self.folder)
            everywhere = set.intersection(*(set(keys) for keys in gather(sorted(found))))
            for key, saved in found.items():
                if key not in everywhere:
                    continue
                self._docs[key] = HeldDocument(key, saved.length, saved.tokens, saved.name,
                                               saved.stored_bytes, saved.full_bytes, file=saved.file)

    @property
    def budget_bytes(self) -> int:
        """Bytes of compressed caches kept in memory at most."""
        return self._budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError("the memory budget must not be negative")
        with self._lock:
            self._budget_bytes = int(value)
            self._keep_budget_locked()

    # --- finding ----------------------------------------------------------------------------------
    def find(self, prompt: RenderedPrompt) -> HeldDocument | None:
        """The longest held document whose prefix text starts `prompt` (and leaves some of it to prefill)."""
        text = prompt.text
        with self._lock:
            lengths = sorted({d.length for d in self._docs.values()}, reverse=True)
            for length in lengths:
                if length >= len(text) or not prompt.may_end_at(length):
                    continue
                doc = self._docs.get(prefix_key(text[:length]))
                if doc is not None and doc.length == length:
                    return doc
        return None

    def get(self, key: str) -> HeldDocument | None:
        """The document held under `key` (`s4r.serving.disk_index.prefix_key` of its prefix), or None."""
        with self._lock:
            return self._docs.get(key)

    def documents(self) -> list[HeldDocument]:
        """Every document the store knows, least recently used first."""
        with self._lock:
            return list(self._docs.values())

    # --- serving ----------------------------------------------------------------------------------
    def checkout(self, doc: HeldDocument) -> Checkout | None:
        """A fork of `doc`'s cache, loading it from disk when it is not in memory; None when its file
        cannot be loaded (then the store forgets it)."""
        t0 = time.perf_counter()
        source = "memory"
        session = doc.session
        if session is None:
            session = self._load(doc)
            if session is None:
                return None
            source = "disk"
        assert session.cache is not None
        cache = fork_cache(session.cache, session.rope)
        with self._lock:
            doc.hits += 1
            if source == "memory":
                self.counters.memory_hits += 1
            else:
                self.counters.disk_hits += 1
            doc.session = session  # counted and kept within the budget in one step
            self._docs.move_to_end(doc.key)
            self._keep_budget_locked()
        return Checkout(cache, doc.tokens, source, time.perf_counter() - t0, doc)

    def ingest(self, prefix: str, *, system: str | None, body: str, name: str, keep: bool = True,
               fork: bool = True) -> Checkout:
        """Ingest `body` after the text before the first user message (with `system`); `prefix` is the
        text they make together. Kept (in memory and, with a folder, on disk) when `keep`, and a fork of
        it handed out (the document's own cache with `fork=False`, which must not be written to);
        otherwise the one-off cache itself."""
        t0 = time.perf_counter()
        session = Session(self.loaded, system=system, **self.session_kwargs)
        session.ingest(body, name=name)
        assert session.cache is not None
        seconds = time.perf_counter() - t0
        tokens = session.logical_length
        with self._lock:
            self.counters.ingests += 1
            self.counters.ingested_tokens += tokens
            self.counters.ingest_seconds += seconds
        if not keep:
            return Checkout(session.cache, tokens, "none", seconds, None)
        stored, full = cache_bytes(session.cache)
        doc = HeldDocument(prefix_key(prefix), len(prefix), tokens, name, stored, full, session=session)
        self._save(doc)
        cache = fork_cache(session.cache, session.rope) if fork else session.cache
        with self._lock:
            self._docs[doc.key] = doc
            self._docs.move_to_end(doc.key)
            self._keep_budget_locked()
        return Checkout(cache, tokens, "new", seconds, doc)

    # --- memory and disk ----------------------------------------------------------------------------
    def _keep_budget_locked(self) -> None:
        """Drop the least recently used documents from memory until the rest fit the budget (the
        caller holds the lock, so no snapshot sees the store over its budget)."""
        resident = [d for d in self._docs.values() if d.session is not None]
        total = sum(d.stored_bytes for d in resident)
        for doc in resident:
            if total <= self._budget_bytes:
                break
            total -= doc.stored_bytes
            doc.session = None
            self.counters.evictions += 1
            if doc.file is None:  # nowhere to load it back from
                del self._docs[doc.key]
                self.counters.forgotten += 1
            self._log(f"{doc.name}: left memory ({'on disk' if doc.file else 'forgotten'})")

    def _save(self, doc: HeldDocument) -> None:
        """Write `doc`'s cache to the folder and the index; a failure leaves it in memory only."""
        if self.folder is None or doc.session is None:
            return
        file = f"{doc.key[:32]}.s4r"
        problem = None
        try:
            doc.session.save(self.folder / file)
        except (OSError, CacheFileError) as exc:
            problem = str(exc)
        if not on_every_rank(problem is None):
            self.counters.save_failures += 1
            self._log(f"{doc.name}: could not be saved ({problem or 'on another rank'}); kept in memory only")
            return
        doc.file = file
        with self._lock:
            saved = {d.key: d.saved() for d in self._docs.values() if d.file is not None}
        saved[doc.key] = doc.saved()
        try:
            write_index(self.folder, self.identity, saved)
        except OSError as exc:  # the cache is saved (and loads back); only a restart will not find it
            self.counters.save_failures += 1
            self._log(f"{doc.name}: the index in {self.folder} could not be written ({exc})")

    def _load(self, doc: HeldDocument) -> Session | None:
        """`doc`'s session from its file, or None (the file is gone or damaged: the store forgets it)."""
        assert self.folder is not None and doc.file is not None
        path = self.folder / doc.file
        kwargs = {k: v for k, v in self.session_kwargs.items() if k in LOAD_KWARGS}
        session, problem = None, "on another rank"
        try:
            session = Session.load(path, self.loaded, **kwargs)
            if session.logical_length != doc.tokens:
                raise CacheFileError(f"{path} holds {session.logical_length} tokens, "
                                     f"the index says {doc.tokens}")
        except CacheFileError as exc:
            session, problem = None, str(exc)
        if not on_every_rank(session is not None):
            with self._lock:
                self._docs.pop(doc.key, None)
                self.counters.load_failures += 1
                saved = {d.key: d.saved() for d in self._docs.values() if d.file is not None}
            self._log(f"{doc.name}: saved cache refused ({problem}); it will be read again")
            try:
                rank_path(path).unlink(missing_ok=True)
                write_index(self.folder, self.identity, saved)
            except OSError:
                pass
            return None
        return session

    def snapshot(self) -> StoreSnapshot:
        """Resident and saved documents and bytes now, with the counters."""
        with self._lock:
            resident = [d for d in self._docs.values() if d.session is not None]
            saved = sum(1 for d in self._docs.values() if d.file is not None)
            counters = StoreCounters(**vars(self.counters))
        return StoreSnapshot(self._budget_bytes, len(resident), sum(d.stored_bytes for d in resident),
                             sum(d.full_bytes for d in resident), saved, counters)
