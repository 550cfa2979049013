"""Benchmark results as JSON (tables: :mod:`s4r.bench.report_tables`; figure: :mod:`s4r.bench.report_plot`).

The JSON document (`to_json`), schema ``s4r-bench/1``; ratios are the requested ones (``full`` is 1),
lengths the nominal context lengths asked for, ``tokens`` the document tokens actually prefilled::

    {
      "schema": "s4r-bench/1",
      "run": {"command", "date" (UTC ISO 8601), "wall_seconds", "interrupted", "model", "source", "device",
              "dtype", "quant", "context_length", "random_weights", "parameters",
              "versions": {"python", "torch", "transformers", "s4r"},
              "machine": {"hostname", "platform", "cpu", "cpu_count", "torch_threads", "ram_bytes",
                          "gpu", "gpu_memory_bytes"}},
      "config": {"methods", "ratios", "lengths", "perplexity_lengths", "tasks", "samples", "seed", ...},
      "methods": [methods that ran, "full" first],
      "accuracy": {
        "scores":  [{"task", "method", "ratio", "length", "tokens", "score", "ci_low", "ci_high", "samples",
                     "achieved_ratio", "compress_seconds", "prefill_seconds", "answer_seconds",
                     "max_new_tokens"}],
        "summary": [{"method", "ratio", "length", "score", "ci_low", "ci_high", "samples", "tasks",
                     "compress_seconds"}],                                # mean over tasks per length
        "overall": [{"method", "ratio", "score", "ci_low", "ci_high", "samples", "tasks",
                     "compress_seconds"}],                                # mean over tasks and lengths
        "samples": [{"task", "length", "tokens", "sample", "depth", "method", "ratio", "score", "answer",
                     "achieved_ratio", "stored_bytes", "full_bytes", "compress_seconds", "prefill_seconds",
                     "answer_seconds", "max_new_tokens"}]},
      "perplexity": [{"length", "tokens", "method", "ratio", "nll", "ppl", "nll_gap", "ppl_ratio",
                      "scored_tokens", "natural_text", "achieved_ratio"}],   # gap: nll - nll of full
      "speed": [{"length", "tokens", "method", "ratio", "prefill_seconds", "compress_seconds",
                 "ingest_seconds", "ingest_vs_prefill", "decode_tok_s", "decode_ms_median", "decode_steps",
                 "decode_vs_full"}],                     # decode_* null where only perplexity was measured
      "compression": [{"length", "ratio", "s4r_seconds", "svd_seconds", "svd_over_s4r"}],
      "memory": {"peak_rss_bytes", "cuda_peak_bytes",
                 "per_length": [{"length", "tokens", "peak_rss_bytes", "cuda_peak_bytes"}],
                 "kv": [{"length", "tokens", "method", "ratio", "stored_bytes", "stored_mib", "full_bytes",
                         "full_mib", "achieved_ratio", "compress_peak_bytes"}]},
      "calibration": [{"method", "seconds", "tokens"}],
      "issues": [{"kind" ("skipped"|"error"), "phase", "method", "ratio", "length", "message", "count"}]
    }

Accuracy intervals are 95%: Wilson where every score of a cell is 0 or 100, Student t otherwise; means
over tasks weight every task equally, with a stratified normal interval (see s4r.bench.intervals);
`samples` counts the answers behind a figure.

`ingest_seconds` is the prefill plus the method's compression (the prefill is measured once per length
and shared by the forks); `decode_vs_full` and `ingest_vs_prefill` are ratios measured in the same run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from s4r.bench.intervals import score_interval, stratified_interval
from s4r.bench.records import AccuracyRecord, BenchResult, ContextRecord
from s4r.units import MIB

__all__ = ["SCHEMA", "machine_info", "to_json", "write_json"]

SCHEMA = "s4r-bench/1"




# --- run information --------------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Where a run happened: host, CPU, RAM, threads and GPU (None without one)."""
    try:
        import psutil

        ram = int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is a dependency
        ram = None
    dev = torch.device(device)
    gpu = gpu_mem = None
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        gpu, gpu_mem = props.name, int(props.total_memory)
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": _cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "ram_bytes": ram,
            "gpu": gpu, "gpu_memory_bytes": gpu_mem}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        s4r_version = version("s4r")
    except PackageNotFoundError:
        s4r_version = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "s4r": s4r_version}


# --- aggregation ------------------------------------------------------------------------------------------

def _mean(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(vals) if vals else math.nan


def _num(x: float | None, digits: int = 4) -> float | None:
    """A float fit for JSON (NaN and infinities are not JSON: they become null)."""
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _accuracy_scores(records: Sequence[AccuracyRecord]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[AccuracyRecord]] = defaultdict(list)
    for r in records:
        groups[(r.task, r.method, r.ratio, r.length)].append(r)
    rows = []
    for (t, m, ratio, n), rs in groups.items():
        ci = score_interval([r.score for r in rs])
        rows.append({"task": t, "method": m, "ratio": ratio, "length": n,
                     "tokens": round(_mean(r.tokens for r in rs)), "score": _num(ci.mean, 2),
                     "ci_low": _num(ci.low, 2), "ci_high": _num(ci.high, 2), "samples": len(rs),
                     "achieved_ratio": _num(_mean(r.achieved_ratio for r in rs), 3),
                     "compress_seconds": _num(_mean(r.compress_seconds for r in rs), 3),
                     "prefill_seconds": _num(_mean(r.prefill_seconds for r in rs), 3),
                     "answer_seconds": _num(_mean(r.answer_seconds for r in rs), 3),
                     "max_new_tokens": max((r.max_new_tokens for r in rs), default=None)})
    return rows


def _accuracy_summary(records: Sequence[AccuracyRecord], by_length: bool) -> list[dict[str, Any]]:
    """Mean over tasks (each task weighted equally), per length or over all lengths, with a stratified
    95% interval and the total sample count."""
    cells: dict[tuple, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    seconds: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        key = (r.method, r.ratio, r.length) if by_length else (r.method, r.ratio)
        cells[key][(r.task, r.length)].append(r.score)
        seconds[key].append(r.compress_seconds)
    out = []
    for key, by_cell in cells.items():
        row: dict[str, Any] = {"method": key[0], "ratio": key[1]}
        if by_length:
            row["length"] = key[2]
        ci = stratified_interval(list(by_cell.values()))
        row.update({"score": _num(ci.mean, 2), "ci_low": _num(ci.low, 2), "ci_high": _num(ci.high, 2),
                    "samples": ci.n, "tasks": len({task for task, _ in by_cell}),
                    "compress_seconds": _num(_mean(seconds[key]), 3)})
        out.append(row)
    return out


def _full_of(contexts: Sequence[ContextRecord]) -> dict[int, ContextRecord]:
    return {c.length: c for c in contexts if c.method == "full"}


def _perplexity(contexts: Sequence[ContextRecord], natural: dict[int, bool]) -> list[dict[str, Any]]:
    full = _full_of(contexts)
    rows = []
    for c in contexts:
        if c.nll is None:
            continue
        ref = full.get(c.length)
        gap = c.nll - ref.nll if ref is not None and ref.nll is not None else None
        rows.append({"length": c.length, "tokens": c.tokens, "method": c.method, "ratio": c.ratio,
                     "nll": _num(c.nll), "ppl": _num(math.exp(c.nll), 3), "nll_gap": _num(gap),
                     "ppl_ratio": _num(math.exp(gap), 4) if gap is not None else None,
                     "scored_tokens": c.scored_tokens, "natural_text": natural.get(c.length, True),
                     "achieved_ratio": _num(c.achieved_ratio, 3)})
    return rows


def _speed(contexts: Sequence[ContextRecord]) -> list[dict[str, Any]]:
    full = _full_of(contexts)
    rows = []
    for c in contexts:
        ingest = c.prefill_seconds + c.compress_seconds
        ref = full.get(c.length)
        tok_s = c.decode.tok_s if c.decode is not None and c.decode.steps else None
        ref_ok = ref is not None and ref.decode is not None and ref.decode.steps
        ref_tok_s = ref.decode.tok_s if ref_ok else None
        rows.append({"length": c.length, "tokens": c.tokens, "method": c.method, "ratio": c.ratio,
                     "prefill_seconds": _num(c.prefill_seconds), "compress_seconds": _num(c.compress_seconds),
                     "ingest_seconds": _num(ingest),
                     "ingest_vs_prefill": _num(ingest / c.prefill_seconds) if c.prefill_seconds > 0 else None,
                     "decode_tok_s": _num(tok_s, 3),
                     "decode_ms_median": _num(c.decode.median_ms, 3) if tok_s else None,
                     "decode_steps": c.decode.steps if c.decode is not None else 0,
                     "decode_vs_full": _num(tok_s / ref_tok_s) if tok_s and ref_tok_s else None})
    return rows


def _compression(contexts: Sequence[ContextRecord]) -> list[dict[str, Any]]:
    by_key = {(c.length, c.method, c.ratio): c for c in contexts}
    rows = []
    for (length, method, ratio), c in sorted(by_key.items()):
        svd = by_key.get((length, "svd", ratio))
        if method != "s4r" or svd is None:
            continue
        rows.append({"length": length, "ratio": ratio, "s4r_seconds": _num(c.compress_seconds),
                     "svd_seconds": _num(svd.compress_seconds),
                     "svd_over_s4r": _num(svd.compress_seconds / c.compress_seconds)
                     if c.compress_seconds > 0 else None})
    return rows


def _kv_rows(result: BenchResult) -> list[dict[str, Any]]:
    if result.contexts:
        return [{"length": c.length, "tokens": c.tokens, "method": c.method, "ratio": c.ratio,
                 "stored_bytes": c.stored_bytes, "stored_mib": _num(c.stored_bytes / MIB, 3),
                 "full_bytes": c.full_bytes, "full_mib": _num(c.full_bytes / MIB, 3),
                 "achieved_ratio": _num(c.achieved_ratio, 3), "compress_peak_bytes": c.compress_peak_bytes}
                for c in result.contexts]
    # accuracy-only runs: the mean over samples of what each fork stored after compression
    groups: dict[tuple, list[AccuracyRecord]] = defaultdict(list)
    for r in result.accuracy:
        groups[(r.length, r.method, r.ratio)].append(r)
    rows = []
    for (length, method, ratio), rs in groups.items():
        stored, full = round(_mean(r.stored_bytes for r in rs)), round(_mean(r.full_bytes for r in rs))
        rows.append({"length": length, "tokens": round(_mean(r.tokens for r in rs)), "method": method,
                     "ratio": ratio, "stored_bytes": stored, "stored_mib": _num(stored / MIB, 3),
                     "full_bytes": full, "full_mib": _num(full / MIB, 3),
                     "achieved_ratio": _num(_mean(r.achieved_ratio for r in rs), 3),
                     "compress_peak_bytes": None})
    return rows


def to_json(result: BenchResult, command: str = "") -> dict[str, Any]:
    """The documented JSON document of a run (see the module docstring)."""
    scores = _accuracy_scores(result.accuracy)
    natural = {x.length: x.natural_text for x in result.lengths}
    model = result.model
    started = datetime.fromtimestamp(result.started or 0, timezone.utc)
    run = {"command": command, "date": started.isoformat(timespec="seconds"),
           "wall_seconds": _num(result.wall_seconds, 2), "interrupted": result.interrupted,
           "model": model.get("name"), "source": model.get("source"), "device": model.get("device"),
           "dtype": model.get("dtype"), "quant": model.get("quant"),
           "context_length": model.get("context_length"),
           "random_weights": model.get("random_weights"), "parameters": model.get("parameters"),
           "versions": _versions(), "machine": machine_info(model.get("device", "cpu"))}
    return {
        "schema": SCHEMA,
        "run": run,
        "config": result.config.to_dict(),
        "methods": list(result.methods),
        "accuracy": {
            "scores": scores,
            "summary": _accuracy_summary(result.accuracy, by_length=True),
            "overall": _accuracy_summary(result.accuracy, by_length=False),
            "samples": [{"task": r.task, "length": r.length, "tokens": r.tokens, "sample": r.sample,
                         "depth": r.depth, "method": r.method, "ratio": r.ratio, "score": r.score,
                         "answer": r.answer, "achieved_ratio": _num(r.achieved_ratio, 3),
                         "stored_bytes": r.stored_bytes, "full_bytes": r.full_bytes,
                         "compress_seconds": _num(r.compress_seconds),
                         "prefill_seconds": _num(r.prefill_seconds), "answer_seconds": _num(r.answer_seconds),
                         "max_new_tokens": r.max_new_tokens} for r in result.accuracy],
        },
        "perplexity": _perplexity(result.contexts, natural),
        "speed": _speed(result.contexts),
        "compression": _compression(result.contexts),
        "memory": {
            "peak_rss_bytes": result.peak_rss_bytes, "cuda_peak_bytes": result.cuda_peak_bytes,
            "per_length": [{"length": x.length, "tokens": x.tokens, "peak_rss_bytes": x.peak_rss_bytes,
                            "cuda_peak_bytes": x.cuda_peak_bytes} for x in result.lengths],
            "kv": _kv_rows(result),
        },
        "calibration": [{**c, "seconds": _num(c.get("seconds"))} for c in result.calibrations],
        "issues": [{"kind": i.kind, "phase": i.phase, "method": i.method, "ratio": i.ratio,
                    "length": i.length, "message": i.message, "count": i.count} for i in result.issues],
    }


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    """Write the JSON document (indented, UTF-8), creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
