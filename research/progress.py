"""What the long measuring scripts (`tuning`, `two_documents`, `long_chat`, `rounding_floor`) share: their
common options, the variants a run names, progress lines stamped with the seconds since the run began,
and the run's end (wall time, JSON record)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

__all__ = ["ElapsedLog", "chosen_variants", "measuring_parser"]


def measuring_parser(prog: str, description: str | None, *, length: int, book: str,
                     length_help: str | None = None, book_help: str | None = None) -> argparse.ArgumentParser:
    """The options every measuring script takes: --model, --length, --seed, --book and --json (the record);
    each script adds its own."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=length, help=length_help)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated samples")
    parser.add_argument("--book", default=book, help=book_help)
    parser.add_argument("--json", default=None)
    return parser


def chosen_variants(parser: argparse.ArgumentParser, spec: str,
                    variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The variants named in the comma list `spec`, in its order; an unknown name is a usage error."""
    names = [n for n in spec.split(",") if n]
    if unknown := [n for n in names if n not in variants]:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(variants)}")
    return {n: variants[n] for n in names}


class ElapsedLog:
    """Prints progress lines, each prefixed with the seconds since the log was made (a run's start)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.t0

    def __call__(self, message: str) -> None:
        print(f"[{self.seconds():.0f} s] {message}", flush=True)

    def finish(self, path: str | None, record: Any) -> None:
        """Print the run's wall time; write `record` as JSON to `path` when one was given."""
        print(f"wall {self.seconds():.0f} s")
        if path:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
