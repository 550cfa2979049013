"""One accuracy table from several `s4r bench --json` runs of the same settings (a long run split by task
over processes, one per core), with each method's share of the full cache and its paired difference.

    python -m research.merge_runs run-a.json run-b.json [--methods full,s4r@5] [--json merged.json]

Samples are matched by (task, length, sample index): every run prefills each sample once and forks it
into every method, so two methods' scores on one sample are paired, and the difference to the full cache
has a tighter interval than either score.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from s4r.bench.intervals import Interval, difference_interval, score_interval, stratified_interval

Key = tuple[str, float]  # (method, requested ratio)


def parse_methods(spec: str) -> set[Key]:
    """'full,s4r@5,quant@2.5' -> {("full", 1.0), ("s4r", 5.0), ("quant", 2.5)}."""
    out = set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, ratio = item.partition("@")
        out.add((name, float(ratio) if ratio else 1.0))
    return out


def load_samples(paths: Sequence[str], methods: set[Key] | None = None) -> list[dict[str, Any]]:
    """The per-sample accuracy records of every run (a sample seen twice keeps its first record), of
    `methods` only when given (runs with different method lists then share a table)."""
    seen: set[tuple[str, int, int, str, float]] = set()
    out = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for rec in doc.get("accuracy", {}).get("samples", []):
            key = (rec["task"], rec["length"], rec["sample"], rec["method"], rec["ratio"])
            if methods is not None and (rec["method"], float(rec["ratio"])) not in methods:
                continue
            if key not in seen:
                seen.add(key)
                out.append(rec)
    return out


def _paired(a: dict[tuple[str, int, int], float], b: dict[tuple[str, int, int], float]) -> Interval:
    """Mean difference a - b over the samples both have, with a t interval (in points, may be < 0)."""
    return difference_interval([a[k] - b[k] for k in sorted(set(a) & set(b))])


def complete(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the samples every method answered (a run stopped mid-sample has some methods'
    answers only; comparing means over different samples would not be paired)."""
    methods = {(r["method"], float(r["ratio"])) for r in samples}
    seen: dict[tuple[str, int, int], set[Key]] = defaultdict(set)
    for r in samples:
        seen[(r["task"], r["length"], r["sample"])].add((r["method"], float(r["ratio"])))
    return [r for r in samples if seen[(r["task"], r["length"], r["sample"])] == methods]


def summarize(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method: each task's score and interval, the stratified mean over tasks, the share of the full
    cache's mean, the paired difference to it, and the mean achieved ratio (over the samples every
    method answered)."""
    scores: dict[Key, dict[str, dict[tuple[str, int, int], float]]] = defaultdict(lambda: defaultdict(dict))
    ratios: dict[Key, list[float]] = defaultdict(list)
    for rec in complete(samples):
        key = (rec["method"], float(rec["ratio"]))
        scores[key][rec["task"]][(rec["task"], rec["length"], rec["sample"])] = float(rec["score"])
        ratios[key].append(float(rec.get("achieved_ratio") or 1.0))
    full = next((k for k in scores if k[0] == "full"), None)
    full_mean = stratified_interval([list(v.values()) for v in scores[full].values()]).mean if full else None
    rows = []
    for key, tasks in scores.items():
        overall = stratified_interval([list(v.values()) for v in tasks.values()])
        flat = {k: v for task in tasks.values() for k, v in task.items()}
        row: dict[str, Any] = {
            "method": key[0], "ratio": key[1],
            "achieved_ratio": round(sum(ratios[key]) / len(ratios[key]), 2),
            "tasks": {t: score_interval(list(v.values())).to_dict() for t, v in sorted(tasks.items())},
            "mean": overall.to_dict(),
        }
        if full is not None and key != full:
            full_flat = {k: v for task in scores[full].values() for k, v in task.items()}
            diff = _paired(flat, full_flat)
            shares = {t: _share(tasks[t], scores[full].get(t)) for t in sorted(tasks)}
            row["vs_full"] = {"difference": round(diff.mean, 2), "ci_low": round(diff.low, 2),
                              "ci_high": round(diff.high, 2), "samples": diff.n,
                              "share": round(overall.mean / full_mean, 3) if full_mean else None,
                              "task_shares": shares}
        rows.append(row)
    return {"methods": rows}


def _share(task: dict[Any, float], full: dict[Any, float] | None) -> float | None:
    if not full:
        return None
    base = sum(full.values()) / len(full)
    return round((sum(task.values()) / len(task)) / base, 3) if base else None


def markdown(summary: dict[str, Any]) -> str:
    """The summary as one markdown table: a column per task, then the mean, the share and the paired
    difference to the full cache."""
    rows = summary["methods"]
    tasks = sorted({t for r in rows for t in r["tasks"]})

    def cell(d: dict[str, Any]) -> str:
        return f"{d['score']:.0f} [{d['ci_low']:.0f}-{d['ci_high']:.0f}]"

    head = ["method", "achieved", *tasks, "mean [95%] (n)", "share of full", "vs full (paired)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = r["method"] if r["method"] == "full" else f"{r['method']} {r['ratio']:g}"
        vs = r.get("vs_full")
        cells = [name, f"{r['achieved_ratio']:.2f}x", *[cell(r["tasks"][t]) if t in r["tasks"] else "-"
                                                        for t in tasks],
                 f"{cell(r['mean'])} ({r['mean']['samples']})",
                 f"{100 * vs['share']:.0f}%" if vs and vs["share"] is not None else "",
                 f"{vs['difference']:+.1f} [{vs['ci_low']:+.1f}, {vs['ci_high']:+.1f}]" if vs else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.merge_runs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="JSON files written by `s4r bench --json`")
    parser.add_argument("--methods", default=None, help="only these, e.g. full,s4r@5,quant@5")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    try:
        methods = parse_methods(args.methods) if args.methods else None
        samples = load_samples(args.runs, methods)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: cannot read the runs: {exc}", file=sys.stderr)
        return 2
    if not samples:
        print("error: no accuracy samples in these runs", file=sys.stderr)
        return 1
    summary = summarize(samples)
    print(markdown(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": list(args.runs), **summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
