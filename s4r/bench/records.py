"""What a benchmark run measured, as plain records (:mod:`s4r.bench.report` turns them into JSON and
tables), and the hooks a run reports its progress through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from s4r.bench.config import BenchConfig
from s4r.bench.speed import DecodeTiming

__all__ = ["AccuracyRecord", "BenchHooks", "BenchResult", "ContextRecord", "Issue", "LengthInfo",
           "length_label"]


class BenchHooks:
    """Where a run reports progress. The default does nothing; the CLI draws bars from it.

    A phase announces its number of units; each `advance` completes some of them.
    """

    def phase(self, name: str, total: int) -> None:
        """A new phase (`accuracy`, `context`, `setup`) with `total` units of work."""

    def advance(self, detail: str = "", units: int = 1) -> None:
        """`units` more units done; `detail` says what is running now."""

    def note(self, message: str) -> None:
        """A milestone worth a line in a log (a finished sample, a finished length)."""

    def warn(self, message: str) -> None:
        """Something was skipped or failed; the run goes on."""


@dataclass
class Issue:
    """A run that was skipped (ratio not reachable) or failed (an error), counted per key."""

    kind: str  # "skipped" | "error"
    phase: str
    method: str
    ratio: float | None
    length: int | None
    message: str
    count: int = 1


@dataclass
class AccuracyRecord:
    """One (sample, method, ratio) answer and its score in [0, 100]."""

    task: str
    length: int  # nominal context length asked for
    tokens: int  # document tokens actually prefilled
    sample: int
    depth: float | None
    method: str
    ratio: float
    score: float
    answer: str
    achieved_ratio: float
    stored_bytes: int
    full_bytes: int
    compress_seconds: float
    max_new_tokens: int | None = None
    prefill_seconds: float | None = None  # the sample's one prefill, shared by every method
    answer_seconds: float | None = None  # question and answer on the compressed fork


@dataclass
class ContextRecord:
    """One (length, method, ratio) fork of the context phase: memory, timing and perplexity."""

    length: int
    tokens: int
    method: str
    ratio: float
    prefill_seconds: float
    compress_seconds: float
    stored_bytes: int
    full_bytes: int
    achieved_ratio: float
    nll: float | None = None
    scored_tokens: int = 0
    decode: DecodeTiming | None = None
    compress_peak_bytes: int | None = None  # extra CUDA memory while compressing (GPU only)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class LengthInfo:
    """What one context length of the context phase used."""

    length: int
    tokens: int
    natural_text: bool  # consecutive book text (False: the book repeated, timing only)
    prefill_seconds: float
    continuation_tokens: int
    perplexity: bool
    speed: bool
    peak_rss_bytes: int
    cuda_peak_bytes: int | None


@dataclass
class BenchResult:
    """Everything a run measured, as plain records (see s4r.bench.report for the JSON)."""

    config: BenchConfig
    model: dict[str, Any]
    methods: list[str] = field(default_factory=list)
    accuracy: list[AccuracyRecord] = field(default_factory=list)
    contexts: list[ContextRecord] = field(default_factory=list)
    lengths: list[LengthInfo] = field(default_factory=list)
    calibrations: list[dict[str, Any]] = field(default_factory=list)
    issues: list[Issue] = field(default_factory=list)
    started: float = 0.0
    wall_seconds: float = 0.0
    peak_rss_bytes: int = 0
    cuda_peak_bytes: int | None = None
    interrupted: bool = False

    def errors(self) -> list[Issue]:
        """The failures (not the skips of unreachable ratios)."""
        return [i for i in self.issues if i.kind == "error"]


def length_label(n: int) -> str:
    """A context length as tables and logs show it: 8k for 8192, 3,000 for 3000."""
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"
