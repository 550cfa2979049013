"""A real `s4r serve` app on 127.0.0.1 (a free port, uvicorn in a thread) over a tiny random model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from s4r.serving.document_store import DocumentStore
from s4r.serving.engine import Engine
from s4r.serving.generate import Sampling
from tests.helpers import CharTokenizer, tiny_model

MODEL_ID = "tiny"
START_TIMEOUT_S = 20.0
# a document of about 1,600 tokens for the character-level tokenizer
DOC = "The quick brown fox jumps over the lazy dog near the river bank. " * 24
OTHER_DOC = "A grey heron waited by the mill pond while the miller counted sacks. " * 24


def tiny_loaded() -> SimpleNamespace:
    """The tiny model as `load_model` would hand it over."""
    return SimpleNamespace(model=tiny_model("llama"), tokenizer=CharTokenizer(), name=MODEL_ID, device="cpu",
                           dtype=torch.float32, context_length=4096)


def make_engine(loaded: Any, *, budget: int = 10**8, cache_dir: Path | None = None) -> Engine:
    """An engine holding documents of 100 tokens or more, s4r at ratio 2.5."""
    store = DocumentStore(loaded, budget_bytes=budget, cache_dir=cache_dir,
                          session_kwargs={"method": "s4r", "ratio": 2.5})
    return Engine(loaded, store, max_tokens=6, min_document_tokens=100)


class RunningServer:
    """uvicorn serving `app` on a free loopback port in a thread; `url` is its /v1 base."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.root = f"http://127.0.0.1:{port}"
        self.url = f"{self.root}/v1"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=START_TIMEOUT_S)


@contextmanager
def serving(engine: Engine, **config: Any) -> Iterator[RunningServer]:
    """The app over `engine` running for the `with` block (ServerConfig fields in `config`)."""
    from s4r_cli.server.app import ServerConfig, create_app

    settings = {"model_id": MODEL_ID, "method": "s4r", "ratio": 2.5, "defaults": Sampling(max_tokens=6),
                **config}
    running = RunningServer(create_app(engine, ServerConfig(**settings))).start()
    try:
        yield running
    finally:
        running.stop()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled (or first labelled) sample of `name` in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
