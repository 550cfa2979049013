"""The `s4r bench` harness: accuracy, perplexity gap, speed and memory of every KV-cache method.

Pure library code (no terminal output): progress and warnings go through :class:`BenchHooks`, results
come back as a :class:`BenchResult` of plain records that :mod:`s4r.bench.report` turns into JSON, tables
and plots.

Every document is prefilled once into an uncompressed staged session and forked into each method and
ratio (`Session.fork`): identical prefills for every method, the prefill cost paid once.

Phases:

accuracy
    RULER-style tasks (:mod:`s4r.bench.tasks`) at each context length: per sample one prefill, then per
    (method, ratio) a fork, the question with the sample's answer prefix, greedy decoding, `score`.
context (perplexity, speed, memory)
    per length one book passage, forked into every method at every ratio; its continuation is fed to
    all forks token by token in one interleaved loop (teacher forcing). That loop gives both the mean
    NLL of the continuation (perplexity gap) and the decode time per token (speed), so decode speeds
    of all methods are measured side by side under the same machine load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from s4r.bench.config import FULL_RATIO, LENGTH_MARGIN, BenchConfig
from s4r.bench.perplexity import NLLMeter, context_and_continuation, token_nll
from s4r.bench.records import (
    AccuracyRecord,
    BenchHooks,
    BenchResult,
    ContextRecord,
    Issue,
    LengthInfo,
    length_label,
)
from s4r.bench.scoring import score
from s4r.bench.speed import check_lengths_fit, model_bytes, synchronize, teacher_force
from s4r.bench.tasks import answer_budget, make_samples
from s4r.core.budget import KVShape
from s4r.errors import BudgetError, S4RError
from s4r.methods import make_method
from s4r.runtime.chat_format import chat_segments
from s4r.runtime.memory import peak_memory_bytes
from s4r.runtime.session import ANSWER_HEADROOM, Session

__all__ = ["BenchRunner", "run_bench"]


def _combo_label(method: str, ratio: float) -> str:
    return method if method == "full" else f"{method} ×{ratio:g}"


class BenchRunner:
    """Runs a benchmark of one loaded model. `loaded` is an s4r.models.loading.LoadedModel or look-alike."""

    def __init__(self, loaded: Any, config: BenchConfig, hooks: BenchHooks | None = None, *,
                 random_weights: bool = False) -> None:
        config.validate()
        self.loaded = loaded
        self.config = config
        self.hooks = hooks or BenchHooks()
        self.random_weights = random_weights
        self.device = torch.device(loaded.device)
        tok = loaded.tokenizer
        self.count_tokens: Callable[[str], int] = lambda s: len(tok.encode(s, add_special_tokens=False))
        model = loaded.model
        dtype = loaded.dtype if isinstance(loaded.dtype, torch.dtype) else next(model.parameters()).dtype
        self.result = BenchResult(config=config, model={
            "name": str(loaded.name), "source": str(getattr(loaded, "source", "")),
            "device": str(self.device), "dtype": str(dtype).removeprefix("torch."),
            "quant": str(getattr(loaded, "quant", "none")), "context_length": int(loaded.context_length),
            "random_weights": random_weights, "parameters": sum(p.numel() for p in model.parameters()),
            "weights_bytes": model_bytes(model)})
        self._issue_index: dict[tuple, Issue] = {}
        self._clamped: set[int] = set()

    # --- helpers ----------------------------------------------------------------------------------
    def _issue(self, kind: str, phase: str, method: str, ratio: float | None, length: int | None,
               message: str) -> None:
        """Record a skip or failure once per key (later repeats only count), warning on the first.

        The message is not part of the key: it often names the exact token count, which varies by sample.
        """
        key = (kind, phase, method, ratio, length)
        if key in self._issue_index:
            self._issue_index[key].count += 1
            return
        issue = Issue(kind, phase, method, ratio, length, message)
        self._issue_index[key] = issue
        self.result.issues.append(issue)
        where = _combo_label(method, ratio or FULL_RATIO) + (f" at {length_label(length)}" if length else "")
        self.hooks.warn(f"{phase}: {where} {'skipped' if kind == 'skipped' else 'failed'}: {message}")

    def _attempt(self, phase: str, method: str, ratio: float, length: int | None,
                 fn: Callable[[], Any]) -> Any:
        """Run `fn`; an unreachable budget is a skip, any other exception an error; None when either."""
        try:
            return fn()
        except KeyboardInterrupt:
            raise
        except BudgetError as exc:
            self._issue("skipped", phase, method, ratio, length, str(exc))
        except Exception as exc:  # noqa: BLE001 - one method's bug must not lose the other methods' data
            self._issue("error", phase, method, ratio, length, f"{type(exc).__name__}: {exc}")
        return None

    def max_document_tokens(self) -> int:
        """The longest document that leaves room for the question and answer in the model's context."""
        head = self.count_tokens(chat_segments(self.loaded.tokenizer).first_user)
        return int(self.loaded.context_length) - ANSWER_HEADROOM - head - LENGTH_MARGIN

    def fit_length(self, length: int) -> int:
        """`length` itself, or the model's largest usable length when it does not fit (warned once)."""
        limit = self.max_document_tokens()
        if length <= limit:
            return length
        if length not in self._clamped:
            self._clamped.add(length)
            self.hooks.warn(f"{length:,} tokens do not fit the model's {self.loaded.context_length:,}-token "
                            f"context with room for the question; using {limit:,} for "
                            f"'{length_label(length)}'")
        return limit

    def _overrides(self, method: str) -> dict[str, Any] | None:
        return self.config.overrides.get(method) or None

    def _combos(self) -> list[tuple[str, float]]:
        """(method, ratio) pairs to run: `full` once (ratio 1), every other method at every ratio."""
        combos: list[tuple[str, float]] = [("full", FULL_RATIO)]
        for method in self.result.methods:
            if method != "full":
                ratios = self.config.method_ratios.get(method) or self.config.ratios
                combos += [(method, float(r)) for r in ratios]
        return combos

    def _staged(self, text: str) -> tuple[Session, float]:
        """An uncompressed session of `text` and the seconds of its prefill (tokenization left out; on a
        GPU the kernels still queued are waited for and added, not billed to the first compression)."""
        staged = Session(self.loaded, method="full", chunk_size=self.config.chunk_size)
        synchronize(self.device)
        stats = staged.ingest(text, compress=False)
        returned = time.perf_counter()
        synchronize(self.device)
        return staged, stats.prefill_seconds + (time.perf_counter() - returned)

    def _fork(self, staged: Session, method: str, ratio: float) -> Session:
        return staged.fork(method=method, ratio=ratio, config_overrides=self._overrides(method))

    # --- setup ------------------------------------------------------------------------------------
    def _select_methods(self) -> None:
        """Keep the methods this library can build (a warning for the others); `full` always first."""
        names = ["full"] + [m for m in dict.fromkeys(self.config.methods) if m != "full"]
        ratio = float(self.config.ratios[0])
        kept = []
        for name in names:
            try:
                make_method(name, ratio, self._overrides(name))
            except (ValueError, S4RError) as exc:
                self._issue("skipped", "setup", name, None, None, f"not available: {exc}")
                continue
            kept.append(name)
        self.result.methods = kept

    def _calibrate(self) -> None:
        """One-time calibration of methods that need one (offline bases); not part of any ingest time."""
        for name in list(self.result.methods):
            method = make_method(name, float(self.config.ratios[0]), self._overrides(name))
            calibrate = getattr(method, "calibrate", None)
            if calibrate is None:
                continue
            self.hooks.advance(f"calibrating {name}", units=0)
            t0 = time.perf_counter()
            try:
                calibration = calibrate(self.loaded)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - the other methods can still run
                self._issue("error", "setup", name, None, None,
                            f"calibration failed: {type(exc).__name__}: {exc}")
                self.result.methods.remove(name)
                continue
            self.result.calibrations.append({"method": name, "seconds": time.perf_counter() - t0,
                                             "tokens": int(getattr(calibration, "tokens", 0))})
            self.hooks.note(f"calibrated {name} in {time.perf_counter() - t0:.1f} s")

    def _check_memory(self) -> None:
        """Refuse context lengths that cannot fit before spending any time on the others."""
        lengths = [self.fit_length(n) for n in self.config.context_lengths()]
        if not lengths:
            return
        ratios = [r for m, r in self._combos() if m != "full"]
        param = next(self.loaded.model.parameters())
        shape = KVShape.from_config(self.loaded.model.config, param.element_size())
        check_lengths_fit(shape, lengths, ratios, device=self.device, chunk_size=self.config.chunk_size)

    # --- accuracy ---------------------------------------------------------------------------------
    def run_accuracy(self) -> None:
        """Every task x length x sample: one prefill, then each (method, ratio) answers the question."""
        cfg = self.config
        combos = self._combos()
        self.hooks.phase("accuracy", len(cfg.lengths) * len(cfg.tasks) * cfg.samples * (len(combos) + 1))
        for length in cfg.lengths:
            tokens = self.fit_length(length)
            drawn = {task: make_samples(task, tokens, cfg.samples, cfg.seed, self.count_tokens, book=cfg.book)
                     for task in cfg.tasks}
            # sample-major: a run stopped early (Ctrl-C writes what it measured) keeps every task at ~equal n
            for k in range(cfg.samples):
                for task in cfg.tasks:
                    sample = drawn[task][k]
                    where = f"{task} {length_label(length)} #{k + 1}"
                    self.hooks.advance(f"{where}: prefill", units=0)
                    prefilled = self._attempt("accuracy", "full", FULL_RATIO, length,
                                              lambda s=sample: self._staged(s.context))
                    self.hooks.advance(f"{where}: prefill")
                    if prefilled is None:
                        self.hooks.advance(where, units=len(combos))
                        continue
                    staged, prefill_s = prefilled
                    scores = []
                    for method, ratio in combos:
                        self.hooks.advance(f"{where}: {_combo_label(method, ratio)}", units=0)
                        rec = self._attempt("accuracy", method, ratio, length,
                                            lambda m=method, r=ratio, s=sample, st=staged, i=k, n=length:
                                            self._answer(st, s, i, m, r, n))
                        self.hooks.advance(f"{where}: {_combo_label(method, ratio)}")
                        if rec is not None:
                            rec.prefill_seconds = prefill_s
                            self.result.accuracy.append(rec)
                            scores.append(f"{_combo_label(method, ratio)} {rec.score:.0f}")
                    del staged, prefilled
                    self.hooks.note(f"accuracy {where}: " + ", ".join(scores))

    def _answer(self, staged: Session, sample: Any, index: int, method: str, ratio: float,
                length: int) -> AccuracyRecord:
        fork = self._fork(staged, method, ratio)
        mem = fork.memory()
        budget = answer_budget(sample, self.count_tokens, self.config.max_new_tokens)
        t0 = time.perf_counter()
        answer, _ = fork.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
        return AccuracyRecord(
            task=sample.task, length=length, tokens=staged.document_tokens, sample=index, depth=sample.depth,
            method=method, ratio=ratio, score=float(score(sample, answer)), answer=answer,
            achieved_ratio=mem.ratio, stored_bytes=mem.stored_bytes, full_bytes=mem.full_bytes,
            compress_seconds=fork.compress_seconds, max_new_tokens=budget,
            answer_seconds=time.perf_counter() - t0)

    # --- context: perplexity, speed, memory --------------------------------------------------------
    def run_contexts(self) -> None:
        """Per length: one staged book passage, every fork alive at once, one interleaved decode loop."""
        cfg = self.config
        lengths = cfg.context_lengths()
        ppl_lengths = set(cfg.ppl_lengths())
        combos = self._combos()
        plans = []
        for length in lengths:
            ppl = length in ppl_lengths
            feed = cfg.continuation_tokens if ppl else 0
            if cfg.speed and length in cfg.lengths:
                feed = max(feed, cfg.warmup_steps + cfg.decode_steps)
            plans.append((length, ppl, cfg.speed and length in cfg.lengths, feed))
        # units per length: the prefill, each fork, each token fed (the continuation plus its first token)
        self.hooks.phase("context", sum(1 + len(combos) + feed + 1 for *_, feed in plans))
        for length, ppl, speed, feed in plans:
            self._run_length(length, combos, ppl, speed, feed)

    def _run_length(self, length: int, combos: list[tuple[str, float]], ppl: bool, speed: bool,
                    feed: int) -> None:
        cuda = self.device.type == "cuda"
        tokens = self.fit_length(length)
        # one more token than scored: the first continuation token is only read, never predicted
        context, continuation, natural = context_and_continuation(tokens, feed + 1, self.count_tokens)
        if ppl and not natural:
            self.hooks.warn(f"the book is too short for a natural {length_label(length)} perplexity text; "
                            "the repeated book is used (perplexity there is not meaningful)")
        ids = self.loaded.tokenizer.encode(continuation, add_special_tokens=False)[: feed + 1]
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.hooks.advance(f"{length_label(length)}: prefill", units=0)
        staged_or_none = self._attempt("context", "full", FULL_RATIO, length, lambda: self._staged(context))
        self.hooks.advance(f"{length_label(length)}: prefill")
        if staged_or_none is None:
            self.hooks.advance(units=len(combos) + feed + 1)
            return
        staged, prefill_s = staged_or_none
        sessions: list[Session] = []
        records: list[ContextRecord] = []
        # compressed forks first and the full copy last, so the staged cache can go right after
        for method, ratio in [c for c in combos if c[0] != "full"] + [("full", FULL_RATIO)]:
            self.hooks.advance(f"{length_label(length)}: compress {_combo_label(method, ratio)}", units=0)
            before = torch.cuda.memory_allocated(self.device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            synchronize(self.device)
            fork = self._attempt("context", method, ratio, length,
                                 lambda m=method, r=ratio, st=staged: self._fork(st, m, r))
            synchronize(self.device)
            self.hooks.advance(f"{length_label(length)}: compress {_combo_label(method, ratio)}")
            if fork is None:
                continue
            mem = fork.memory()
            # full leads the records (as in every table), though it is forked last
            at = 0 if method == "full" else len(sessions)
            sessions.insert(at, fork)
            records.insert(at, ContextRecord(
                length=length, tokens=staged.document_tokens, method=method, ratio=ratio,
                prefill_seconds=prefill_s, compress_seconds=fork.compress_seconds,
                stored_bytes=mem.stored_bytes, full_bytes=mem.full_bytes, achieved_ratio=mem.ratio,
                compress_peak_bytes=(torch.cuda.max_memory_allocated(self.device) - before) if cuda else None,
                info=_jsonable(fork.compress_info)))
        doc_tokens = staged.document_tokens
        del staged

        meters = [NLLMeter() for _ in sessions]
        failed: dict[int, str] = {}

        def on_logits(j: int, i: int, logits: torch.Tensor) -> None:
            if ppl and i + 1 < len(ids):
                meters[j].add(token_nll(logits, ids[i + 1]))

        def on_step(i: int) -> None:
            self.hooks.advance(f"{length_label(length)}: decode {i + 1}/{len(ids)}")

        timings = teacher_force(sessions, ids, warmup=self.config.warmup_steps, on_logits=on_logits,
                                on_step=on_step, failed=failed)
        self.hooks.advance(units=max(0, feed + 1 - len(ids)))
        for j, (rec, timing) in enumerate(zip(records, timings, strict=True)):
            if j in failed:
                self._issue("error", "context", rec.method, rec.ratio, length, failed[j])
                continue
            if ppl:
                rec.nll, rec.scored_tokens = meters[j].mean, meters[j].count
            if speed:
                rec.decode = timing
            self.result.contexts.append(rec)
        cuda_peak = int(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        rss = peak_memory_bytes(torch.device("cpu"))
        self.result.lengths.append(LengthInfo(length, doc_tokens, natural, prefill_s, len(ids), ppl, speed,
                                              rss, cuda_peak))
        self.hooks.note(f"context {length_label(length)}: prefill {prefill_s:.1f} s, {len(sessions)} forks, "
                        f"{len(ids)} tokens decoded")

    # --- everything -------------------------------------------------------------------------------
    def run(self) -> BenchResult:
        """Run the configured phases; the result is also kept in `self.result` as it grows (so an
        interrupted run still has what it measured)."""
        cfg = self.config
        res = self.result
        res.started = time.time()
        t0 = time.perf_counter()
        torch.manual_seed(cfg.seed)
        if self.random_weights and (cfg.accuracy or cfg.perplexity):
            self.hooks.warn("random weights: accuracy and perplexity are meaningless; measuring speed and "
                            "memory only")
            self.config = cfg = replace(cfg, accuracy=False, perplexity=False, speed=True)
            res.config = cfg
        try:
            self._select_methods()
            self._check_memory()
            self.hooks.phase("setup", 1)
            self._calibrate()
            self.hooks.advance("ready")
            if cfg.accuracy:
                self.run_accuracy()
            if cfg.context_lengths():
                self.run_contexts()
        except KeyboardInterrupt:
            res.interrupted = True
            raise
        finally:
            res.wall_seconds = time.perf_counter() - t0
            res.peak_rss_bytes = peak_memory_bytes(torch.device("cpu"))
            if self.device.type == "cuda":
                res.cuda_peak_bytes = max([x.cuda_peak_bytes or 0 for x in res.lengths] or [0])
        return res


def _jsonable(value: Any) -> Any:
    """`compress_info` as plain JSON values (tensors and tuples become lists)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def run_bench(loaded: Any, config: BenchConfig | None = None, hooks: BenchHooks | None = None, *,
              random_weights: bool = False) -> BenchResult:
    """Run a benchmark of `loaded` (see BenchRunner) and return what it measured."""
    return BenchRunner(loaded, config or BenchConfig(), hooks, random_weights=random_weights).run()
