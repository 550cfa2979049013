"""Tuning runs: S4R settings compared by the likelihood of the reference answer, on the tuning book.

Greedy answers score 0 or 100 and need many samples to separate two settings; the negative
log-likelihood of the reference answer (teacher-forced after the question and the answer prefix) is a
continuous figure from one forward per setting, so variants can be told apart with a few samples. Every
sample is prefilled once and forked into every variant (as the bench does). The gap to the full cache
is paired per sample, so its interval leaves the samples' own difficulty out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from s4r.bench.intervals import Interval, mean_interval
from s4r.bench.tasks import TUNING_BOOK, Sample, make_samples
from s4r.session import Session


def answer_nll(session: Session, sample: Sample) -> float:
    """Mean NLL (nats per token) of the sample's reference answer after its question, through the
    session's cache; the cache is truncated back afterwards, so the session can be reused."""
    prompt = session._encode(session._turn_prefix() + sample.question.strip() + session.segments.to_assistant
                             + sample.answer_prefix)
    answer = session._encode(" " + ", ".join(sample.answers) + ".")
    ids = torch.tensor([prompt + answer], dtype=torch.long, device=session.device)
    start = session.logical_length
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
    with torch.inference_mode():
        out = session.model(input_ids=ids, position_ids=positions, cache=session.cache, use_cache=True,
                            logits_to_keep=len(answer) + 1)
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        nll = -logp.gather(1, torch.tensor(answer, device=ids.device).unsqueeze(1)).mean().item()
    session.cache.truncate(start)
    return nll


@dataclass
class VariantResult:
    """Answer NLLs of one variant, sample by sample (the same samples for every variant)."""

    name: str
    overrides: dict[str, Any]
    nll: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    compress_seconds: list[float] = field(default_factory=list)

    def gap(self, full: VariantResult) -> Interval:
        """Mean of the per-sample NLL gaps to the full cache, with a paired t interval (nats, not 0-100)."""
        diffs = [a - b for a, b in zip(self.nll, full.nll, strict=True)]
        n = len(diffs)
        if n < 2:
            return Interval(diffs[0] if diffs else math.nan, math.nan, math.nan, n)
        # mean_interval clips to 0-100; shift into range and back (the gaps are far below 50 nats)
        ci = mean_interval([d + 50.0 for d in diffs])
        return Interval(ci.mean - 50.0, ci.low - 50.0, ci.high - 50.0, n)


def compare_variants(loaded: Any, variants: dict[str, dict[str, Any]], *, tasks: Sequence[str], length: int,
                     samples: int, ratio: float = 5.0, book: str = TUNING_BOOK, seed: int = 0,
                     method: str = "s4r",
                     note: Callable[[str], None] | None = None) -> dict[str, VariantResult]:
    """Answer NLL of the full cache (key "full") and of `method` at `ratio` with each variant's
    overrides, over `samples` samples of each task at `length` tokens of `book`."""
    tok = loaded.tokenizer

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    results = {"full": VariantResult("full", {})}
    results.update({name: VariantResult(name, ov) for name, ov in variants.items()})
    for task in tasks:
        for k, sample in enumerate(make_samples(task, length, samples, seed, count, book=book)):
            staged = Session(loaded, method="full")
            staged.ingest(sample.context, compress=False)
            for name, res in results.items():
                t0 = time.perf_counter()
                fork = (staged.fork(method="full", ratio=1.0) if name == "full" else
                        staged.fork(method=method, ratio=ratio, config_overrides=res.overrides))
                res.compress_seconds.append(time.perf_counter() - t0)
                res.ratio.append(fork.memory().ratio)
                res.nll.append(answer_nll(fork, sample))
            if note is not None:
                note(f"{task} #{k + 1}: " + ", ".join(f"{n} {r.nll[-1]:.3f}" for n, r in results.items()))
    return results
