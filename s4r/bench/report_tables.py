"""Benchmark results (the JSON document of :func:`s4r.bench.report.to_json`) as summary tables of plain
strings, which the CLI renders."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from s4r.bench.records import length_label

__all__ = ["Table", "speedup_label", "tables"]


class Table(NamedTuple):
    """A table as plain strings: what the CLI renders (rich in a terminal, plain text otherwise)."""

    title: str
    columns: list[str]
    rows: list[list[str]]



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
    heads = [f"{t} {length_label(n)}" if many_lengths else t for t, n in columns]
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
                     ["method", "ratio", *[length_label(n) for n in lengths], "mean", "samples"], rows))
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
        title = f"Context {length_label(length)} ({tokens:,} tokens, prefill {_fmt(prefill, '.1f')} s)"
        out.append(Table(title, columns, rows))
    if doc["compression"]:
        rows = [[length_label(c["length"]), f"×{c['ratio']:g}", _fmt(c["s4r_seconds"], ".3f"),
                 _fmt(c["svd_seconds"], ".3f"), speedup_label(c["svd_over_s4r"])]
                for c in doc["compression"]]
        out.append(Table("Compression step: s4r against full-SVD", ["length", "ratio", "s4r s", "svd s",
                                                                   "s4r against svd"], rows))
    if doc["issues"]:
        rows = [[i["kind"], i["phase"], i["method"], "-" if i["ratio"] is None else f"×{i['ratio']:g}",
                 "-" if i["length"] is None else length_label(i["length"]), str(i["count"]), i["message"]]
                for i in doc["issues"]]
        out.append(Table("Skipped and failed runs", ["kind", "phase", "method", "ratio", "length", "times",
                                                     "reason"], rows))
    return out
