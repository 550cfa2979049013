"""One generated benchmark item (see :mod:`s4r.bench.tasks`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One generated benchmark item.

    ``context`` is the long document (to prefill, and compress), ``question`` is asked after it,
    and ``answer_prefix`` (possibly empty) primes the model's answer. ``metric`` names the RULER
    scoring: ``"all"`` (string_match_all) or ``"part"`` (string_match_part). ``depth`` is where the
    queried needle sits in the document (0 = start, 1 = end) for needle tasks, else ``None``.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    metric: str
    depth: float | None
    answer_prefix: str
