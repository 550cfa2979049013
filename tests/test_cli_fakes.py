"""Small stand-ins for s4r.models.loading / s4r.runtime.session / s4r.models.profiles, so CLI tests run in
milliseconds.

Used two ways: in-process (``install_fakes(monkeypatch)``) and in a subprocess (``FAKE_LAUNCHER`` puts the
fakes into ``sys.modules`` and then runs the real ``s4r_cli.app.main``). The tests at the bottom check that
the fakes keep the shape of the real library, so CLI tests cannot drift from the contract unnoticed.

Behaviour hooks (all by the text of the model spec or the question):
  model "fail/model" -> ModelLoadError;  model "slow/model" -> sleeps (touches $S4R_FAKE_MARKER first)
  --device cuda      -> DeviceError (no GPU, like this machine)
  a document over 2,000 words -> ContextTooLongError unless truncate is set
  documents under 10 words with a compressing method -> kept uncompressed (method full)
  --ratio above FAKE_MAX_RATIO -> never reachable
  question "BOOM"    -> RuntimeError (a bug);  "OVERFLOW" -> ContextTooLongError;
  "LONG"             -> 10,000 lines of 100 bytes (~1 MB, over any pipe's buffer) unless -n cuts it;
  "LOOP"             -> an answer the loop guard stops;  "INTERRUPT" -> Ctrl-C mid-answer;
  "SLEEP"            -> answers slowly (touches $S4R_FAKE_MARKER), so a real SIGINT can be sent
  a question about the passphrase -> quotes the passphrase found in the documents
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from s4r.errors import CacheFileError, ContextTooLongError, DeviceError, ModelLoadError

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
FAKE_CONTEXT = 2000
FAKE_METHODS = ("s4r", "full")
FAKE_PROFILES = ("smollm2-135m", "tiny-test")
FAKE_MAX_RATIO = 50.0
FAKE_SHORT_WORDS = 10
# Run the real CLI with the fakes installed: python -c FAKE_LAUNCHER ARGS...
FAKE_LAUNCHER = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from tests import test_cli_fakes; "
                 "test_cli_fakes.install(); from s4r_cli.app import main; main()")


@dataclass
class FakeLoaded:
    """Quacks like s4r.models.loading.LoadedModel."""

    name: str = "smollm2-135m"
    model: Any = None
    tokenizer: Any = None
    profile: Any = None
    device: str = "cpu"
    dtype: str = "torch.float32"
    quant: str = "none"
    context_length: int = FAKE_CONTEXT
    source: str = "fake"
    load_seconds: float = 0.01


@dataclass(frozen=True)
class FakeMemoryReport:
    stored_bytes: int
    full_bytes: int
    tokens: int

    @property
    def ratio(self) -> float:
        return self.full_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True)
class FakeIngestStats:
    tokens: int
    seconds: float
    prefill_seconds: float
    compress_seconds: float
    dropped_tokens: int = 0
    mode: str = "layerwise"

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class FakeProcessMemory:
    peak_bytes: int = 300 * 2**20
    current_bytes: int | None = 250 * 2**20
    kind: str = "RSS"


@dataclass(frozen=True)
class FakeTurnStats:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_mem_bytes: int
    memory: FakeMemoryReport
    interrupted: bool = False
    stop_reason: str = "end"


def _touch_marker() -> None:
    marker = os.environ.get("S4R_FAKE_MARKER")
    if marker:
        Path(marker).touch()


class FakeSession:
    """Word-count "tokens"; answers the passphrase question from the documents."""

    def __init__(self, loaded: Any, *, method: str = "s4r", ratio: float = 5.0, system: str | None = None,
                 truncate: str | None = None, config_overrides: dict | None = None,
                 ingest: str = "layerwise", hidden_spill: str = "auto"):
        self.loaded, self.method, self.ratio_requested = loaded, method, float(ratio)
        self.ingest_mode, self.last_ingest = ingest, None
        self.system, self.truncate, self.config_overrides = system, truncate, config_overrides
        self.uncompressed_reason: str | None = None
        self.docs: list[str] = []
        self.turns: list[tuple[str, str]] = []
        self.calls: list[tuple[str, dict]] = []

    @property
    def document_tokens(self) -> int:
        return sum(len(d.split()) for d in self.docs)

    def ingest(self, text: str, *, name: str | None = None, progress: Any = None) -> FakeIngestStats:
        words = text.split()
        total = len(words)
        limit = self.loaded.context_length
        if self.document_tokens + len(words) > limit:
            if self.truncate is None:
                raise ContextTooLongError(self.document_tokens + len(words), limit)
            words = words[: limit - self.document_tokens]
        if not self.docs and len(words) < FAKE_SHORT_WORDS and self.method != "full":
            self.uncompressed_reason = f"{len(words)} tokens are too few for {self.method}"
            self.method = "full"
        for done in range(0, len(words), 100):
            if progress:
                progress(done, len(words))
        if progress:
            progress(len(words), len(words))
        self.docs.append(" ".join(words))
        self.last_ingest = FakeIngestStats(len(words), 0.5, 0.4, 0.1, total - len(words), self.ingest_mode)
        return self.last_ingest

    def process_memory(self) -> FakeProcessMemory:
        return FakeProcessMemory()

    def memory(self) -> FakeMemoryReport:
        tokens = self.document_tokens + sum(len(q.split()) + len(a.split()) for q, a in self.turns)
        # deliberately not exactly the requested ratio: the CLI must report the achieved one
        return FakeMemoryReport(stored_bytes=tokens * 100, full_bytes=tokens * 480, tokens=tokens)

    def _answer(self, question: str) -> str:
        if "passphrase" in question.lower():
            m = re.search(r"passphrase is '([^']+)'", " ".join(self.docs))
            return f"The passphrase is {m.group(1)}." if m else "I do not know."
        return f"You asked: {question}"

    def ask(self, question: str, *, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
            seed: int | None = None, on_token: Any = None, repeat_penalty: float = 1.0,
            repeat_last_n: int = 64, loop_guard: bool = False) -> tuple[str, FakeTurnStats]:
        self.calls.append((question, {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                      "top_p": top_p, "seed": seed, "repeat_penalty": repeat_penalty,
                                      "repeat_last_n": repeat_last_n, "loop_guard": loop_guard}))
        if question == "BOOM":
            raise RuntimeError("fake bug")
        if question == "OVERFLOW":
            raise ContextTooLongError(FAKE_CONTEXT + 1, FAKE_CONTEXT)
        pieces: list[str]
        interrupted = False
        if question == "LONG":
            pieces = ["x" * 99 + "\n"] * 10_000
        elif question == "SLEEP":
            # 60 pieces of 0.5 s: the test's SIGINT lands mid-answer even when a loaded machine delays it
            # by seconds (3 pieces left it 1.5 s)
            pieces = [f"You{i} " for i in range(60)]
        elif question == "LOOP":
            pieces = ["again "] * (8 if loop_guard else 600)
        else:
            pieces = [w + " " for w in self._answer(question).split()]
            pieces[-1] = pieces[-1].rstrip()
        out: list[str] = []
        try:
            for i, piece in enumerate(pieces[:max_new_tokens]):
                if question == "INTERRUPT" and i == 2:
                    raise KeyboardInterrupt
                if on_token:
                    on_token(piece)
                out.append(piece)
                if question == "SLEEP":  # the first piece is out: now a Ctrl-C cuts the answer
                    _touch_marker()
                    time.sleep(0.5)
        except KeyboardInterrupt:
            interrupted = True
        stop = "end"
        if interrupted:
            stop = "interrupted"
        elif question == "LOOP" and loop_guard:
            stop = "loop"
        elif len(pieces) > max_new_tokens:
            stop = "max_new_tokens"
        answer = "".join(out)
        self.turns.append((question, answer))
        stats = FakeTurnStats(prompt_tokens=len(question.split()) + 5, generated_tokens=len(out), ttft_s=0.05,
                              prefill_tok_s=1000.0, decode_tok_s=50.0, peak_mem_bytes=300 * 2**20,
                              memory=self.memory(), interrupted=interrupted, stop_reason=stop)
        return answer, stats

    def clear(self) -> None:
        self.turns = []

    def save(self, path: str | Path) -> None:
        body = {"model": self.loaded.name, "method": self.method, "ratio": self.ratio_requested,
                "docs": self.docs, "turns": self.turns}
        text = json.dumps(body)
        checksum = hashlib.sha256(text.encode()).hexdigest()
        Path(path).write_text(json.dumps({"checksum": checksum, "body": text}))

    @classmethod
    def load(cls, path: str | Path, loaded: Any, **kwargs: Any) -> FakeSession:
        try:
            outer = json.loads(Path(path).read_text())
            body = json.loads(outer["body"])
            ok = hashlib.sha256(outer["body"].encode()).hexdigest() == outer["checksum"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CacheFileError(f"{path} is not a saved s4r cache (corrupt or truncated)") from None
        if not ok:
            raise CacheFileError(f"{path} is corrupt (checksum mismatch)")
        session = cls(loaded, **kwargs)
        if body["model"] != loaded.name or body["method"] != session.method:
            raise CacheFileError(f"saved cache {path} was made with model {body['model']!r}, "
                                 f"this session uses {loaded.name!r}")
        session.docs, session.turns = body["docs"], [tuple(t) for t in body["turns"]]
        return session


def fake_load_model(spec: str = "smollm2-135m", *, device: str = "auto", dtype: str = "auto",
                    quant: str = "none", random_weights: bool = False, progress: Any = None,
                    rope_scaling: float | None = None) -> FakeLoaded:
    fake_resolve_device(device)
    if spec == "fail/model":
        raise ModelLoadError("cannot download fail/model: no network access")
    if spec == "slow/model":
        _touch_marker()
        time.sleep(60)
    if progress:
        progress("reading weights", None)
        progress("reading weights", 0.5)
        progress("ready", 1.0)
    return FakeLoaded(name=spec, context_length=int(FAKE_CONTEXT * (rope_scaling or 1.0)))


def fake_resolve_device(device: str) -> str:
    if device.startswith("cuda"):
        raise DeviceError("--device cuda: no CUDA GPU is available on this machine; use --device cpu")
    return "cpu"


@dataclass
class FakeProfile:
    name: str
    display_name: str = "Fake"
    source: str = "gguf-wheel"
    hf_id: str | None = "org/fake"
    context_length: int = FAKE_CONTEXT
    chat_notes: str = ""
    architecture: dict = field(default_factory=dict)
    s4r: dict = field(default_factory=dict)


def fake_modules() -> dict[str, types.ModuleType]:
    """Module objects to put in sys.modules in place of the library's."""
    loading = types.ModuleType("s4r.models.loading")
    loading.load_model = fake_load_model
    loading.resolve_device = fake_resolve_device
    loading.LoadedModel = FakeLoaded
    session = types.ModuleType("s4r.runtime.session")
    session.Session = FakeSession
    session.METHODS = FAKE_METHODS
    session.MemoryReport, session.IngestStats = FakeMemoryReport, FakeIngestStats
    session.TurnStats = FakeTurnStats
    profiles = types.ModuleType("s4r.models.profiles")
    profiles.list_profiles = lambda: [FakeProfile(n) for n in FAKE_PROFILES]
    profiles.profile_names = lambda: list(FAKE_PROFILES)
    threads = types.ModuleType("s4r.runtime.threads")  # the real one imports torch (seconds per subprocess)
    threads.apply_threads = fake_apply_threads
    limits = types.ModuleType("s4r.runtime.ratio_limits")
    limits.max_ratio = fake_max_ratio
    return {"s4r.models.loading": loading, "s4r.runtime.session": session, "s4r.models.profiles": profiles,
            "s4r.runtime.threads": threads,
            "s4r.runtime.ratio_limits": limits}


def fake_apply_threads(requested: int | None, device_type: str = "cpu") -> int:
    return requested or 1


def fake_max_ratio(loaded: Any, method: str, overrides: dict | None = None) -> float:
    return float("inf") if method == "full" else FAKE_MAX_RATIO


def install() -> None:
    """For a subprocess: replace the library modules for the rest of this interpreter."""
    sys.modules.update(fake_modules())


def install_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test: replace the library modules until the test ends."""
    for name, module in fake_modules().items():
        monkeypatch.setitem(sys.modules, name, module)


# -- the fakes must keep the real contract's shape -----------------------------------------------------------

def _params(fn: Any) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is not p.VAR_KEYWORD} - {"self"}


def test_fake_session_matches_real_signatures() -> None:
    real = pytest.importorskip("s4r.runtime.session", reason="s4r.runtime.session not written yet")
    for name in ("__init__", "ingest", "ask", "clear", "memory", "save"):
        missing = _params(getattr(FakeSession, name)) - _params(getattr(real.Session, name))
        assert not missing, f"Session.{name} lacks {missing}"
    stats_fields = set(real.TurnStats.__dataclass_fields__)
    assert set(FakeTurnStats.__dataclass_fields__) <= stats_fields
    assert set(FakeIngestStats.__dataclass_fields__) <= set(real.IngestStats.__dataclass_fields__)
    assert set(FakeMemoryReport.__dataclass_fields__) <= set(real.MemoryReport.__dataclass_fields__)
    assert set(FAKE_METHODS) <= set(real.METHODS)


def test_fake_loading_matches_real_signatures() -> None:
    real = pytest.importorskip("s4r.models.loading", reason="s4r.models.loading not written yet")
    assert _params(fake_load_model) <= _params(real.load_model)
    assert _params(fake_resolve_device) <= _params(real.resolve_device)


def test_fake_threads_and_limits_match_real_signatures() -> None:
    import s4r.runtime.ratio_limits
    import s4r.runtime.threads

    assert _params(fake_apply_threads) == _params(s4r.runtime.threads.apply_threads)
    assert _params(fake_max_ratio) == _params(s4r.runtime.ratio_limits.max_ratio)


def test_fake_profiles_match_real() -> None:
    real = pytest.importorskip("s4r.models.profiles")
    fields = set(real.Profile.__dataclass_fields__)
    needed = {"name", "display_name", "source", "hf_id", "context_length", "chat_notes", "architecture"}
    assert needed <= fields
    assert "smollm2-135m" in real.profile_names()
