"""Benchmark results as JSON, as summary tables (plain data), and as a matplotlib figure.

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
                     "achieved_ratio", "compress_seconds", "max_new_tokens"}],
        "summary": [{"method", "ratio", "length", "score", "ci_low", "ci_high", "samples", "tasks",
                     "compress_seconds"}],                                # mean over tasks per length
        "overall": [{"method", "ratio", "score", "ci_low", "ci_high", "samples", "tasks",
                     "compress_seconds"}],                                # mean over tasks and lengths
        "samples": [{"task", "length", "tokens", "sample", "depth", "method", "ratio", "score", "answer",
                     "achieved_ratio", "stored_bytes", "full_bytes", "compress_seconds", "max_new_tokens"}]},
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
from typing import Any, NamedTuple

import torch

from s4r.bench.intervals import score_interval, stratified_interval
from s4r.bench.records import AccuracyRecord, BenchResult, ContextRecord

__all__ = ["SCHEMA", "Table", "machine_info", "plot", "tables", "to_json", "write_json"]

SCHEMA = "s4r-bench/1"
MIB = 2**20


class Table(NamedTuple):
    """A table as plain strings: what the CLI renders (rich in a terminal, plain text otherwise)."""

    title: str
    columns: list[str]
    rows: list[list[str]]


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


# --- tables -----------------------------------------------------------------------------------------------

def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _ratio_label(method: str, ratio: float) -> str:
    return "-" if method == "full" else f"×{ratio:g}"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}{suffix}"


def speedup_label(times: float | None) -> str:
    """How much faster a method is, given other_time / its_time: "faster by 2.3×", or "slower by 1.1×"
    below 1 (never "faster by 0.9×")."""
    if times is None or (isinstance(times, float) and (math.isnan(times) or times <= 0)):
        return "-"
    if times >= 1:
        return f"faster by {times:.1f}×"
    return f"slower by {1 / times:.1f}×"


def _order(doc: dict[str, Any], rows: Iterable[dict[str, Any]]) -> list[tuple[str, float]]:
    """(method, ratio) pairs present in `rows`, in the order of the run's methods, then by ratio."""
    rank = {m: i for i, m in enumerate(doc.get("methods", []))}
    pairs = {(r["method"], r["ratio"]) for r in rows}
    return sorted(pairs, key=lambda p: (rank.get(p[0], len(rank)), p[1]))


def _ci(row: dict[str, Any] | None, digits: str = ".0f") -> str:
    """'score [low-high]' of a row with an interval (the bare score when it has none)."""
    if row is None or row.get("score") is None:
        return "-"
    if row.get("ci_low") is None or row.get("ci_high") is None:
        return f"{row['score']:{digits}}"
    return f"{row['score']:{digits}} [{row['ci_low']:.0f}-{row['ci_high']:.0f}]"


def _samples_note(rows: Sequence[dict[str, Any]]) -> str:
    counts = sorted({r["samples"] for r in rows})
    return f"n={counts[0]}" if len(counts) == 1 else f"n={counts[0]}-{counts[-1]}"


def _accuracy_tables(doc: dict[str, Any]) -> list[Table]:
    """Accuracy by task (one column per task and length) and the mean by length, every figure with its
    95% interval, plus each method's mean compression seconds (kvzip's extra forward shows there)."""
    acc = doc["accuracy"]
    cells = {(s["method"], s["ratio"], s["task"], s["length"]): s for s in acc["scores"]}
    columns = list(dict.fromkeys((s["task"], s["length"]) for s in acc["scores"]))
    many_lengths = len({n for _, n in columns}) > 1
    overall = {(s["method"], s["ratio"]): s for s in acc["overall"]}
    rows = []
    for method, ratio in _order(doc, acc["scores"]):
        vals = [_ci(cells.get((method, ratio, t, n))) for t, n in columns]
        o = overall.get((method, ratio))
        rows.append([method, _ratio_label(method, ratio), *vals, _ci(o, ".1f"),
                     _fmt(o["compress_seconds"] if o else None, ".2f")])
    heads = [f"{t} {_length_label(n)}" if many_lengths else t for t, n in columns]
    out = [Table(f"Accuracy by task (score 0-100 [95% interval], {_samples_note(acc['scores'])} per cell)",
                 ["method", "ratio", *heads, "mean", "compress s"], rows)]
    lengths = sorted({s["length"] for s in acc["summary"]})
    by_len = {(s["method"], s["ratio"], s["length"]): s for s in acc["summary"]}
    rows = []
    for method, ratio in _order(doc, acc["summary"]):
        o = overall.get((method, ratio)) or {}
        rows.append([method, _ratio_label(method, ratio),
                     *[_ci(by_len.get((method, ratio, n)), ".1f") for n in lengths],
                     _ci(o or None, ".1f"), str(o.get("samples", "-"))])
    out.append(Table("Accuracy by context length (mean over tasks [95% interval])",
                     ["method", "ratio", *[_length_label(n) for n in lengths], "mean", "samples"], rows))
    return out


def tables(doc: dict[str, Any]) -> list[Table]:
    """Summary tables of a JSON document: accuracy by task and by length, then one table per context
    length (memory, ingest, decode speed, perplexity), compression time of s4r against svd, and issues.

    In a context table `ingest` is (prefill + compression) / prefill, `tok/s` the decode speed and
    `vs full` its ratio to full's, measured in the same interleaved loop; the decode and NLL columns
    appear when that length measured them."""
    out: list[Table] = []
    acc = doc["accuracy"]
    if acc["scores"]:
        out += _accuracy_tables(doc)

    speed = {(s["length"], s["method"], s["ratio"]): s for s in doc["speed"]}
    ppl = {(p["length"], p["method"], p["ratio"]): p for p in doc["perplexity"]}
    kv = {(k["length"], k["method"], k["ratio"]): k for k in doc["memory"]["kv"]}
    for length in sorted({s["length"] for s in doc["speed"]}):
        keys = [k for k in speed if k[0] == length]
        tokens = speed[keys[0]]["tokens"]
        columns = ["method", "ratio", "KV MiB", "achieved", "compress s", "ingest"]
        has_speed = any(speed[k]["decode_tok_s"] for k in keys)
        has_ppl = any(k in ppl for k in keys)
        columns += ["tok/s", "vs full"] if has_speed else []
        columns += ["NLL", "ΔNLL"] if has_ppl else []
        rows = []
        for method, ratio in _order(doc, [speed[k] for k in keys]):
            key = (length, method, ratio)
            s, p, m = speed[key], ppl.get(key), kv.get(key)
            row = [method, _ratio_label(method, ratio), _fmt(m["stored_mib"] if m else None, ".1f"),
                   _fmt(m["achieved_ratio"] if m else None, ".2f", "×"), _fmt(s["compress_seconds"], ".2f"),
                   _fmt(s["ingest_vs_prefill"], ".2f", "×")]
            if has_speed:
                row += [_fmt(s["decode_tok_s"], ".1f"), _fmt(s["decode_vs_full"], ".2f", "×")]
            if has_ppl:
                row += [_fmt(p["nll"] if p else None, ".3f"), _fmt(p["nll_gap"] if p else None, "+.3f")]
            rows.append(row)
        prefill = speed[keys[0]]["prefill_seconds"]
        title = f"Context {_length_label(length)} ({tokens:,} tokens, prefill {_fmt(prefill, '.1f')} s)"
        out.append(Table(title, columns, rows))
    if doc["compression"]:
        rows = [[_length_label(c["length"]), f"×{c['ratio']:g}", _fmt(c["s4r_seconds"], ".3f"),
                 _fmt(c["svd_seconds"], ".3f"), speedup_label(c["svd_over_s4r"])]
                for c in doc["compression"]]
        out.append(Table("Compression step: s4r against full-SVD", ["length", "ratio", "s4r s", "svd s",
                                                                   "s4r against svd"], rows))
    if doc["issues"]:
        rows = [[i["kind"], i["phase"], i["method"], "-" if i["ratio"] is None else f"×{i['ratio']:g}",
                 "-" if i["length"] is None else _length_label(i["length"]), str(i["count"]), i["message"]]
                for i in doc["issues"]]
        out.append(Table("Skipped and failed runs", ["kind", "phase", "method", "ratio", "length", "times",
                                                     "reason"], rows))
    return out


# --- plot -------------------------------------------------------------------------------------------------

_MARKERS = "os^vDP*Xph<>"
# the methods this project is about go on top; baselines with near-identical points hid the s4r line
_ON_TOP = ("s4r", "s4r-paper")


def plot_styles(methods: Iterable[str]) -> dict[str, dict[str, Any]]:
    """matplotlib keyword arguments per method: a marker each, and s4r drawn last, thicker, on top."""
    styles: dict[str, dict[str, Any]] = {}
    for i, method in enumerate(methods):
        top = method in _ON_TOP
        zorder = 10 - _ON_TOP.index(method) if top else 2
        styles[method] = {"marker": _MARKERS[i % len(_MARKERS)], "markersize": 7 if top else 5,
                          "linewidth": 2.4 if top else 1.2, "zorder": zorder, "alpha": 1.0 if top else 0.8}
    return styles

def plot(doc: dict[str, Any], path: str | Path) -> None:
    """Save a figure: accuracy against ratio per method, and decode tokens/s against context length.

    Needs matplotlib (the `plot` extra); panels without data are left out.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    import matplotlib.pyplot as plt

    methods = list(doc.get("methods", []))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    colors["full"] = "black"
    styles = plot_styles(methods)
    panels = [p for p, has in (("accuracy", bool(doc["accuracy"]["overall"])),
                               ("speed", any(s["decode_tok_s"] for s in doc["speed"]))) if has]
    if not panels:
        raise ValueError("nothing to plot: the run measured neither accuracy nor decode speed")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "accuracy":
            overall = doc["accuracy"]["overall"]
            for method in methods:
                pts = sorted((s["ratio"], s["score"]) for s in overall if s["method"] == method
                             and s["score"] is not None)
                if not pts:
                    continue
                if method == "full":
                    ax.axhline(pts[0][1], color=colors[method], linestyle="--", label="full (uncompressed)")
                else:
                    ax.plot(*zip(*pts, strict=True), color=colors[method], label=method, **styles[method])
            ratios = sorted({s["ratio"] for s in overall if s["method"] != "full"})
            if ratios:
                ax.set_xticks(ratios, [f"×{r:g}" for r in ratios])
            ax.set_ylim(-2, 102)
            ax.set_xlabel("compression ratio")
            ax.set_ylabel("accuracy (mean score over tasks and lengths)")
            ax.set_title("Accuracy against compression")
        else:
            dashes = ["-", "--", ":", "-."]
            ratios = sorted({s["ratio"] for s in doc["speed"] if s["method"] != "full"})
            for method in methods:
                for ratio in ([1.0] if method == "full" else ratios):
                    pts = sorted((s["length"], s["decode_tok_s"]) for s in doc["speed"]
                                 if s["method"] == method and s["ratio"] == ratio and s["decode_tok_s"])
                    if not pts:
                        continue
                    style = "-" if method == "full" else dashes[ratios.index(ratio) % len(dashes)]
                    label = "full" if method == "full" else f"{method} ×{ratio:g}"
                    ax.plot(*zip(*pts, strict=True), linestyle=style, color=colors[method], label=label,
                            **styles[method])
            lengths = sorted({s["length"] for s in doc["speed"]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [_length_label(n) for n in lengths])
            ax.minorticks_off()
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("decode tokens/s")
            ax.set_title("Decode speed against context length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    run = doc.get("run", {})
    fig.suptitle(f"s4r bench · {run.get('model')} · {run.get('device')} {run.get('dtype')}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
