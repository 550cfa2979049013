"""The model's one worker thread and the hand-off of a request's events to the event loop.

Requests run one at a time on a single thread (the engine's lock serves the same purpose for library
callers); the event loop only waits, so /health and /metrics answer while the model works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

from starlette.requests import Request

# how often a waiting request asks whether its client is still there
DISCONNECT_POLL_S = 0.25


class RequestRun:
    """One request on the worker: its events ("prefilled", "text", "done", "error") arrive in `events`;
    `cancel` stops it at the next token (or before it starts)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancel = threading.Event()

    def emit(self, kind: str, value: Any = None) -> None:
        """Queue an event from the worker thread."""
        with suppress(RuntimeError):  # the event loop has closed (the server stopped): nobody waits for it
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    async def next_event(self, request: Request) -> tuple[str, Any]:
        """The next event; ("disconnected", None) when the client left first (the run is cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel.set()
                    return "disconnected", None


class ModelWorker:
    """A single thread running requests in order, with a bound on how many may wait."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.pending = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s4r-model")
        self._runs: set[RequestRun] = set()
        self._chore_queued = False

    def full(self) -> bool:
        """Whether the queue (running and waiting requests) is at its bound."""
        return self.pending >= self.max_queue

    def start(self, work: Callable[[RequestRun], None]) -> RequestRun:
        """Queue `work(run)` on the worker; the pending count drops when it has finished."""
        loop = asyncio.get_running_loop()
        run = RequestRun(loop)
        self.pending += 1
        self._runs.add(run)

        def call() -> None:
            try:
                work(run)
            except BaseException as exc:  # noqa: BLE001 - handed to the request, which answers with it
                run.emit("error", exc)

        future = loop.run_in_executor(self._executor, call)
        future.add_done_callback(lambda _: self._finished(run))
        return run

    def _finished(self, run: RequestRun) -> None:
        self.pending -= 1
        self._runs.discard(run)

    def chore(self, work: Callable[[], object]) -> None:
        """Run `work` on the worker thread between requests, unless an earlier chore still waits there
        (nothing once the worker is shut down)."""
        if self._chore_queued:
            return
        self._chore_queued = True

        def call() -> None:
            self._chore_queued = False
            work()

        try:
            self._executor.submit(call)
        except RuntimeError:  # shut down
            self._chore_queued = False

    def shutdown(self) -> None:
        """Stop taking work; a request still running stops at its next token."""
        for run in list(self._runs):
            run.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        """Wait until the worker thread has finished what it was doing (after `shutdown`)."""
        self._executor.shutdown(wait=True)
