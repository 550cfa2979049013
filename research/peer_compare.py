"""s4r against llama.cpp: `decode_speed` JSON files next to `peer_llamacpp` ones, as decode speed ratios.

    python -m research.peer_compare --s4r s4r-r1.json,s4r-r2.json --peer peer-r1.json,peer-r2.json

Pairs the i-th s4r file with the i-th peer file (one round: run one after the other, one process at a
time) and prints, per round and length, every s4r row's tok/s over each llama.cpp KV type's tok/s
(above 1: s4r decodes faster). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Ratio", "compare", "markdown", "rows_by_length"]


@dataclass(frozen=True)
class Ratio:
    """One s4r row against one llama.cpp KV type, at one length, in one round."""

    round: int
    length: int
    s4r: str
    s4r_tok_s: float
    peer_kv: str
    peer_tok_s: float

    @property
    def ratio(self) -> float:
        return self.s4r_tok_s / self.peer_tok_s


def rows_by_length(data: dict, key: str) -> dict[int, dict[str, float]]:
    """{length: {name: tok/s}} from a bench JSON's `rows` (`key` names a row: `method` or `kv`)."""
    out: dict[int, dict[str, float]] = {}
    for row in data["rows"]:
        out.setdefault(int(row["length"]), {})[row[key]] = 1000.0 / float(row["median_ms"])
    return out


def compare(s4r_runs: list[dict], peer_runs: list[dict]) -> list[Ratio]:
    """Every s4r row over every peer row of the same length, round by round (the i-th files pair up)."""
    if len(s4r_runs) != len(peer_runs):
        raise ValueError(f"{len(s4r_runs)} s4r files but {len(peer_runs)} peer files: pair them by round")
    ratios = []
    for i, (ours, peer) in enumerate(zip(s4r_runs, peer_runs, strict=True), start=1):
        peer_rows = rows_by_length(peer, "kv")
        for length, methods in sorted(rows_by_length(ours, "method").items()):
            for kv, peer_tok_s in peer_rows.get(length, {}).items():
                ratios.extend(Ratio(i, length, name, tok_s, kv, peer_tok_s)
                              for name, tok_s in methods.items())
    return ratios


def markdown(ratios: list[Ratio], methods: list[str] | None = None) -> str:
    """One line per round, length and s4r row: its tok/s, then its ratio to each llama.cpp KV type."""
    kvs = list(dict.fromkeys(r.peer_kv for r in ratios))
    head = "| round | length | s4r row | s4r tok/s | " + " | ".join(
        f"llama.cpp {kv} tok/s | s4r / {kv}" for kv in kvs) + " |"
    lines = [head, "|" + "---|" * (4 + 2 * len(kvs))]
    keyed = {(r.round, r.length, r.s4r, r.peer_kv): r for r in ratios}
    for rnd, length, name in dict.fromkeys((r.round, r.length, r.s4r) for r in ratios):
        if methods and name not in methods:
            continue
        cells = []
        for kv in kvs:
            r = keyed.get((rnd, length, name, kv))
            cells += [f"{r.peer_tok_s:.1f}", f"{r.ratio:.2f}x"] if r else ["-", "-"]
        tok_s = next(r.s4r_tok_s for r in ratios if (r.round, r.length, r.s4r) == (rnd, length, name))
        lines.append(f"| {rnd} | {length:,} | {name} | {tok_s:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.peer_compare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--s4r", required=True, help="decode_speed --json files, one per round")
    parser.add_argument("--peer", required=True, help="peer_llamacpp --json files, in the same round order")
    parser.add_argument("--methods", default=None, help="only these s4r rows (e.g. 'full,s4r 5')")
    args = parser.parse_args(argv)
    try:
        load = [[json.loads(Path(p).read_text()) for p in arg.split(",")] for arg in (args.s4r, args.peer)]
        ratios = compare(*load)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(ratios, args.methods.split(",") if args.methods else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
