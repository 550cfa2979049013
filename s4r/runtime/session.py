"""`Session`: ingest documents into a compressed cache, answer questions, report memory and speed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from s4r.core.budget import KVShape
from s4r.core.rope import model_rope_fn
from s4r.distributed.placement import layer_devices
from s4r.distributed.rank_files import load_path, rank_path
from s4r.distributed.tensor_parallel import rank_kv_shape
from s4r.distributed.world import agree_token
from s4r.errors import BudgetError, ContextTooLongError, S4RError
from s4r.hf.attention import install
from s4r.hf.cache import CompressedCache
from s4r.hf.generation import apply_repetition_penalty, forward_tokens, loops, prefill, sample_token
from s4r.hf.hidden_spill import SPILL_MODES, spill_wanted
from s4r.hf.layerwise import LAYERWISE_BLOCK, decoder_parts, ingest_layerwise
from s4r.layers.segments import settle_cache
from s4r.methods import METHODS, CompressContext, FullMethod, make_method
from s4r.runtime.chat_format import chat_segments
from s4r.runtime.memory import (
    MemoryReport,
    ProcessMemory,
    bound_heap_growth,
    peak_memory_bytes,
    process_memory,
    release_freed_memory,
)
from s4r.runtime.ratio_limits import method_max_ratio
from s4r.runtime.session_files import restore_session, save_session, saved_meta, session_kwargs
from s4r.runtime.tokens import stop_token_ids, truncate_ids
from s4r.runtime.turn_stats import IngestStats, TurnStats, timed_turn
from s4r.validation import check_ratio

__all__ = ["INGEST_MODES", "METHODS", "IngestStats", "MemoryReport", "Session", "TurnStats"]

# how documents are prefilled: layer by layer, compressing each layer when complete (the default where it
# applies), or in token chunks through the whole model into a full staging cache compressed at the end
INGEST_MODES: tuple[str, ...] = ("layerwise", "chunked")

# tokens kept free after the documents for the question and the start of an answer
ANSWER_HEADROOM = 512
STAGING_QUERY_WINDOW = 64


class Session:
    """A long-document chat over one model with one KV-cache method.

    `loaded` is an `s4r.models.loading.LoadedModel` (or anything with model, tokenizer, name, device, dtype
    and
    context_length). `ingest="layerwise"` (the default) prefills documents one decoder layer at a
    time and compresses each layer as soon as it is complete, so an ingest never holds the full cache;
    it falls back to token chunks (`"chunked"`: a full staging cache, compressed once at the end) where
    the model or the method cannot go layer by layer (`ingest_mode_for` says which and why). Questions
    and answers go through the compressed cache. `hidden_spill` ("auto", "on", "off"): whether a
    layer-wise ingest keeps the text's hidden states in a temporary file between layers instead of in
    memory ("auto": on CPU, for long texts, where the temp dir is a disk; see `s4r.hf.hidden_spill`).
    """

    def __init__(self, loaded, *, method: str = "s4r", ratio: float = 5.0, system: str | None = None,
                 truncate: str | None = None, config_overrides: dict[str, Any] | None = None,
                 chunk_size: int = 512, ingest: str = "layerwise", hidden_spill: str = "auto") -> None:
        if method != "full":
            check_ratio(ratio, BudgetError, name="ratio", upper=None)
        if ingest not in INGEST_MODES:
            raise S4RError(f"unknown ingest mode '{ingest}' (choose {' or '.join(INGEST_MODES)})")
        if hidden_spill not in SPILL_MODES:
            raise S4RError(f"unknown hidden-state spill '{hidden_spill}' (choose {', '.join(SPILL_MODES)})")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(loaded.device)
        self.context_length = int(loaded.context_length)
        self.method = method
        self.ratio_requested = float(ratio)
        self.system = system
        self.truncate = truncate
        self.config_overrides = dict(config_overrides or {})
        self.chunk_size = chunk_size
        self.ingest_mode = ingest
        self.hidden_spill = hidden_spill
        try:
            self._method = make_method(method, ratio, self.config_overrides)
        except ValueError as exc:
            raise BudgetError(str(exc)) from None
        dtype = loaded.dtype if isinstance(loaded.dtype, torch.dtype) else next(self.model.parameters()).dtype
        self.dtype = dtype
        # under tensor parallelism this rank's cache holds only its own heads
        whole = KVShape.from_config(self.model.config, torch.empty(0, dtype=dtype).element_size())
        self.shape = rank_kv_shape(whole, self.model)
        # the device each layer runs on where accelerate spread them (its cache layer lives there too)
        self.layer_devices = layer_devices(self.model)
        self.segments = chat_segments(self.tokenizer, system)
        self.rope = model_rope_fn(self.model)
        install(self.model)
        self.cache: CompressedCache | None = None
        self.compress_info: dict[str, Any] = {}
        # why the cache was kept uncompressed although a compressing method was asked for (else None)
        self.uncompressed_reason: str | None = None
        self.document_tokens = 0
        self.documents: list[str] = []
        self._state = "empty"  # empty | open (inside a user message) | closed (after an answer)
        self._doc_checkpoint: tuple[int, str] | None = None
        self._stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.compress_seconds = 0.0
        self.last_ingest: IngestStats | None = None
        self._staged_ids: list[int] | None = None

    # --- helpers ----------------------------------------------------------------------------------
    def _turn_prefix(self) -> str:
        """Text that opens new user content in the current conversation state."""
        seg = self.segments
        return {"empty": seg.first_user, "open": "\n\n", "closed": seg.next_user}[self._state]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _new_cache(self) -> CompressedCache:
        # keep enough recent queries for any method a staged session may be forked into
        window = max(self._method.query_window, STAGING_QUERY_WINDOW)
        cache = CompressedCache(self.shape.layers, self.shape, query_window=window)
        cache.devices = self.layer_devices
        return cache

    @property
    def logical_length(self) -> int:
        """Tokens the model has seen in this session."""
        return self.cache.logical_length() if self.cache is not None else 0

    def process_memory(self) -> ProcessMemory:
        """The whole process's measured peak and current memory (RSS on CPU, CUDA allocated on GPU)."""
        return process_memory(self.device)

    def memory(self) -> MemoryReport:
        """Stored KV bytes, the uncompressed equivalent and the token count now."""
        if self.cache is None:
            return MemoryReport(0, 0, 0)
        return MemoryReport(self.cache.nbytes(), self.cache.full_nbytes(), self.cache.logical_length())

    # --- documents --------------------------------------------------------------------------------
    def ingest(self, text: str | list[str], *, name: str | None = None,
               progress: Callable[[int, int], None] | None = None, compress: bool = True) -> IngestStats:
        """Add one document (or several, joined) to the conversation and compress the cache.

        The first ingest goes layer by layer (each layer compressed when complete) or, where that
        cannot apply, in token chunks into a full-precision staging cache compressed once at the end
        (`ingest_mode_for`); later ones go through the compressed cache and fold into coefficients with
        the existing bases. A document too short for the ratio is kept uncompressed
        (`uncompressed_reason`). With `compress=False` the first ingest stays staged, so `fork` can
        compress copies of it with several methods (the benchmark prefills each document once).
        """
        texts = [text] if isinstance(text, str) else list(text)
        body = "\n\n".join(t.strip("\n") for t in texts)
        head_ids = self._encode(self._turn_prefix())
        doc_ids = self._encode(body)
        doc_tokens = len(doc_ids)
        room = self.context_length - self.logical_length - len(head_ids) - ANSWER_HEADROOM
        if len(doc_ids) > room:
            if self.truncate is None:
                total = self.logical_length + len(head_ids) + len(doc_ids) + ANSWER_HEADROOM
                raise ContextTooLongError(total, self.context_length)
            if room <= 0:
                raise ContextTooLongError(self.logical_length + ANSWER_HEADROOM, self.context_length)
            doc_ids = truncate_ids(doc_ids, room, self.truncate)
        dropped = doc_tokens - len(doc_ids)
        ids = head_ids + doc_ids
        stats = self._ingest_ids(ids, progress, compress)
        if dropped:
            stats = replace(stats, dropped_tokens=dropped)
        self.last_ingest = stats
        self.document_tokens += len(doc_ids)
        self.documents.append(name or f"document {len(self.documents) + 1}")
        self._state = "open"
        self._doc_checkpoint = (self.logical_length, self._state)
        return stats

    def ingest_mode_for(self, compress: bool = True) -> tuple[str, str]:
        """(mode, reason) the next ingest will use: "layerwise" where this session asks for it and it
        applies, else "chunked" with the reason."""
        if self.ingest_mode == "chunked":
            return "chunked", "asked for"
        if decoder_parts(self.model) is None:
            return "chunked", "the model's architecture is not a plain decoder stack layer-wise knows"
        if self.cache is None and not compress:
            return "chunked", "the staged cache is kept whole for fork"
        if self.cache is None and not getattr(self._method, "layerwise", False):
            return "chunked", f"method {self.method} needs every layer before it compresses any"
        return "layerwise", ""

    def _ingest_ids(self, ids: list[int], progress: Callable[[int, int], None] | None,
                    compress: bool = True) -> IngestStats:
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        mode = self.ingest_mode_for(compress)[0]
        if self.device.type == "cpu":
            bound_heap_growth()
        fresh = self.cache is None
        if fresh:
            self.cache = self._new_cache()
            self._staged_ids = list(ids)  # methods that re-read the prompt (kvzip) need its ids
        start = self.logical_length
        if not fresh:
            self.cache.begin_append()
        t0 = time.perf_counter()
        spilled = False
        try:
            with torch.inference_mode():
                if mode == "layerwise":
                    spilled = self._layerwise(tensor, start, fresh, progress)
                else:
                    prefill(self.model, self.cache, tensor, start, self.chunk_size, progress)
        except BaseException:
            # an interrupted or failed ingest (Ctrl-C, out of memory, a ratio a layer-wise ingest finds
            # unreachable after its first layer) leaves the session as it was before it
            if fresh:
                self.cache = None
            else:
                self.cache.truncate(start)
            raise
        t1 = time.perf_counter()
        if mode == "chunked" and fresh and compress:
            try:
                self._compress(fallback=True)
            except S4RError:
                self.cache = None
                raise
        elif not fresh:
            with torch.inference_mode():  # the collected text joins tensors made in inference mode
                settle_cache(self.cache)
        self.cache.prepare_decode()  # the fused step's views, built now rather than at the first question
        t2 = time.perf_counter()
        # the freed staging buffers go back to the OS instead of staying in the process's heap
        release_freed_memory(self.device)
        return IngestStats(len(ids), t2 - t0, t1 - t0, t2 - t1, mode, peak_memory_bytes(self.device),
                           hidden_spilled=spilled)

    def _run_method(self) -> None:
        """Compress the staged cache with this session's method; what it chose goes to `compress_info`."""
        ctx = CompressContext(rope=self.rope, ratio=self.ratio_requested, model=self.model,
                              tokenizer=self.tokenizer, ids=self._staged_ids)
        with torch.inference_mode():
            self.compress_info = self._method.compress(self.cache, ctx)

    def _layerwise(self, ids: torch.Tensor, start: int, fresh: bool,
                   progress: Callable[[int, int], None] | None) -> bool:
        """Layer-wise prefill (see `s4r.hf.layerwise.ingest_layerwise`); a fresh cache is compressed with the
        method's own per-layer build as its layers complete. Returns whether the hidden states waited
        in a temporary file between layers (`hidden_spill`)."""
        def compress() -> None:
            self._compress(fallback=True)

        embed = self.model.get_input_embeddings().weight
        spill = spill_wanted(self.hidden_spill, ids.shape[0], embed.shape[1], embed.dtype, self.device)
        ingest_layerwise(self.model, self.cache, ids, start, min(self.chunk_size, LAYERWISE_BLOCK),
                         compress=compress if fresh else None, progress=progress,
                         # host heap only: emptying the CUDA cache per layer would only cost time
                         after_layer=release_freed_memory, spill=spill)
        return spill

    def _compress(self, *, fallback: bool = False) -> None:
        """Compress the staged cache. With `fallback`, a ratio that cannot pay for itself at this length
        (a short document) keeps the cache uncompressed instead: method `full`, and
        `uncompressed_reason` says why. Without it (benchmark forks) the BudgetError propagates."""
        try:
            self._run_method()
        except BudgetError:
            if not fallback:
                raise
            tokens = self.logical_length
            best = method_max_ratio(self._method, self.shape, tokens)
            self.uncompressed_reason = (f"{tokens:,} tokens are too few for {self.method} to reach ratio "
                                        f"{self.ratio_requested:g} (at most ×{best:.2f} at this length)")
            self.method, self._method = "full", FullMethod()
            self._run_method()
            self.compress_info["note"] = self.uncompressed_reason

    def fork(self, *, method: str, ratio: float, config_overrides: dict[str, Any] | None = None) -> Session:
        """A new session over a copy of this one's staged (uncompressed) documents, compressed with
        `method`. Its `compress_seconds` tells how long the compression alone took."""
        if self.cache is None or not self.cache.is_staged():
            raise S4RError("fork needs a session whose documents were ingested with compress=False")
        other = Session(self.loaded, method=method, ratio=ratio, system=self.system, truncate=self.truncate,
                        config_overrides=config_overrides, chunk_size=self.chunk_size)
        other.cache = self.cache.copy_staged()
        other._staged_ids = self._staged_ids
        other.document_tokens, other.documents = self.document_tokens, list(self.documents)
        other._state, other._doc_checkpoint = self._state, self._doc_checkpoint
        t0 = time.perf_counter()
        other._compress()
        other.compress_seconds = time.perf_counter() - t0
        return other

    def clear(self) -> None:
        """Forget the conversation after the documents; keep the documents."""
        if self.cache is None or self._doc_checkpoint is None:
            self.cache, self._state = None, "empty"
            return
        self.cache.truncate(self._doc_checkpoint[0])
        self._state = self._doc_checkpoint[1]

    # --- questions --------------------------------------------------------------------------------
    def ask(self, question: str, *, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
            seed: int | None = None, on_token: Callable[[str], None] | None = None,
            prime: str = "", repeat_penalty: float = 1.0, repeat_last_n: int = 64,
            loop_guard: bool = False) -> tuple[str, TurnStats]:
        """Answer `question` about the documents; streams text pieces through `on_token`.

        Ctrl-C stops the answer: the partial answer comes back with `interrupted=True` and the session
        stays usable. `prime` starts the answer with given text (part of the prompt, not of the answer).
        `repeat_penalty` (> 1) penalizes the last `repeat_last_n` tokens; `loop_guard` stops an answer
        that repeats a block of itself. The defaults are plain decoding; `TurnStats.stop_reason` says
        why the answer ended.
        """
        ids = self._encode(self._turn_prefix() + question.strip() + self.segments.to_assistant + prime)
        if self.logical_length + len(ids) + 1 > self.context_length:
            raise ContextTooLongError(self.logical_length + len(ids), self.context_length)
        room = self.context_length - self.logical_length - len(ids)
        stop_reason = "context" if room < max_new_tokens else "max_new_tokens"
        max_new_tokens = min(max_new_tokens, room)
        generator = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        fresh = self.cache is None
        if fresh:  # no document: the question itself is the prompt that gets compressed (when it can be)
            self.cache = self._new_cache()
            self._staged_ids = list(ids)
        start_len, start_state = self.logical_length, self._state
        generated: list[int] = []
        emitted = ""
        interrupted = False
        t0 = time.perf_counter()
        t_first = t_end = None
        try:
            with torch.inference_mode():
                tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
                logits = prefill(self.model, self.cache, tensor, start_len, self.chunk_size)
                if fresh:
                    self._compress(fallback=True)
                self._state = "closed"
                for _ in range(max_new_tokens):
                    recent = (ids[-repeat_last_n:] + generated)[-repeat_last_n:] if repeat_last_n > 0 else []
                    logits = apply_repetition_penalty(logits.float(), recent, repeat_penalty)
                    # every rank continues rank 0's token (identical sampling whatever the logits' rounding)
                    token = agree_token(sample_token(logits, temperature, top_p, generator))
                    if t_first is None:
                        t_first = time.perf_counter()
                    if token in self._stop_ids:
                        stop_reason = "end"
                        break
                    generated.append(token)
                    text = self.tokenizer.decode(generated, skip_special_tokens=True)
                    if not text.endswith("\ufffd") and len(text) > len(emitted):
                        if on_token is not None:
                            on_token(text[len(emitted):])
                        emitted = text
                    tok = torch.tensor([[token]], dtype=torch.long, device=self.device)
                    logits = forward_tokens(self.model, self.cache, tok, self.cache.logical_length())
                    if loop_guard and loops(generated):
                        stop_reason = "loop"
                        break
        except KeyboardInterrupt:
            interrupted, stop_reason = True, "interrupted"
            if t_first is None:
                # stopped while reading the question: as if it was never asked
                self.cache.truncate(start_len)
                self._state = start_state
                if fresh:
                    self.cache = None
            else:
                self.cache.truncate(self.cache.consistent_length())
        t_end = time.perf_counter()
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        if on_token is not None and len(text) > len(emitted) and text.startswith(emitted):
            on_token(text[len(emitted):])
        stats = timed_turn(len(ids), len(generated), t0, t_first, t_end,
                           peak_mem_bytes=peak_memory_bytes(self.device), memory=self.memory(),
                           interrupted=interrupted, stop_reason=stop_reason)
        return text, stats

    # --- persistence (s4r.runtime.session_files) ----------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Save the compressed cache and what is needed to continue the conversation (under several
        ranks, each rank its own part: `s4r.distributed.rank_files`)."""
        save_session(self, rank_path(path))

    @classmethod
    def load(cls, path: str | Path, loaded, **kwargs: Any) -> Session:
        """A session continuing from a saved cache; refuses caches of another model or settings.

        Method, ratio and settings default to the saved ones; any given explicitly must match them.
        """
        path = load_path(path)  # this rank's part where several ranks saved it
        meta = saved_meta(path)
        session = cls(loaded, **session_kwargs(meta, kwargs))
        restore_session(session, path, meta)
        return session
