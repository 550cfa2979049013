"""Per task: how far the exact twin moves from the full cache, beside how far S4R does (same samples).

Usage: python docs/round12/floor_table.py FLOOR.json[,FLOOR.json] BENCH.json[,BENCH.json]
The floor runs (`python -m research.rounding_floor`) and the bench runs (`s4r bench --json`) must draw
the same samples (task, seed, length, book); the full cache's answers are checked to be identical.
"""

import json
import sys
from collections import defaultdict

from s4r.bench.intervals import difference_interval, score_interval


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    floors = [load(p) for p in sys.argv[1].split(",")]
    benches = [load(p) for p in sys.argv[2].split(",")]
    arms = defaultdict(dict)  # task -> arm -> (scores, answers)
    for doc in floors:
        for task, rec in doc["tasks"].items():
            for name, arm in rec["arms"].items():
                arms[task][name] = (arm["scores"], arm["answers"])
    bench = defaultdict(lambda: defaultdict(dict))
    for doc in benches:
        for s in doc["accuracy"]["samples"]:
            label = "full" if s["method"] == "full" else f"{s['method']}@{s['ratio']:g}"
            bench[s["task"]][label][s["sample"]] = (s["score"], s["answer"])
    for task in sorted(arms):
        full_scores, full_answers = arms[task]["full"]
        n = len(full_scores)
        bench_full = [bench[task]["full"][i][1] for i in range(n)]
        same = sum(a == b for a, b in zip(full_answers, bench_full, strict=True))
        print(f"{task} (n={n}; the full cache's answers identical in both runs: {same}/{n})")
        rows = {"full (sdpa)": arms[task]["full (sdpa)"]}
        for label in sorted(bench[task]):
            if label != "full":
                got = bench[task][label]
                rows[label] = ([got[i][0] for i in range(n)], [got[i][1] for i in range(n)])
        s = score_interval(full_scores)
        print(f"  {'full':<12} {s.mean:5.1f} [{s.low:.0f}-{s.high:.0f}]")
        for label, (scores, answers) in rows.items():
            s = score_interval(scores)
            d = difference_interval([a - b for a, b in zip(scores, full_scores, strict=True)])
            changed = sum(a != b for a, b in zip(answers, full_answers, strict=True))
            share = f"{100 * s.mean / score_interval(full_scores).mean:.0f}%" if any(full_scores) else "-"
            print(f"  {label:<12} {s.mean:5.1f} [{s.low:.0f}-{s.high:.0f}]  {share:>5} of full  "
                  f"vs full {d.mean:+5.1f} [{d.low:+.1f}, {d.high:+.1f}]  answers changed {changed}/{n}")


if __name__ == "__main__":
    main()
