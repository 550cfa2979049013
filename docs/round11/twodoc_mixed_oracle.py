"""Round 11 diagnosis: which document's storage loses document 2's chat margin?

    python docs/round11/twodoc_mixed_oracle.py pride-and-prejudice 100 8 \
        '{"d2lossless": [{}, {"rank_k": 192, "rank_v": 192, "coef_dtype": "model", "outlier_fraction": 0.0}]}'

Each arm gives S4R overrides for document 1 (the fork's settings) and for document 2's segment (patched
into `s4r.layers.segments.new_segment`); an empty dict for document 2 means the solver's ranks.
Per pair it prints
document 2's plain and chat margins (`research.two_documents`) for the full cache and each arm; at the end
the mean chat-margin gap to the full cache. Ran with the round-10 segment budget (each segment 1/ratio of
its own tokens).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import s4r.layers.segments as segments
from research.tuning import answer_fit
from research.two_documents import chat_fit
from s4r.bench.tasks import make_samples
from s4r.models.loading import load_model
from s4r.runtime.session import Session

SOLVED = {"rank_k": None, "rank_v": None, "coef_dtype": "int8"}


def main() -> None:
    book, seed, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    arms: dict[str, list[dict]] = json.loads(sys.argv[4])
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")

    def count(text: str) -> int:
        return len(loaded.tokenizer.encode(text, add_special_tokens=False))

    firsts = make_samples("niah_single_book", 2048, pairs, seed, count, book=book)
    seconds = make_samples("niah_single_book", 2048, pairs, seed + 1, count, book=book)
    original = segments.new_segment
    second: dict = {}

    def patched(keys, values, cfg, shape, rope, start=0, *rest):
        return original(keys, values, cfg.with_overrides(second), shape, rope, start, *rest)

    segments.new_segment = patched
    margins: dict[str, list[tuple[float, float]]] = {name: [] for name in ["full", *arms]}
    t0 = time.time()
    for k, (doc1, doc2) in enumerate(zip(firsts, seconds, strict=True)):
        staged = Session(loaded, method="full")
        staged.ingest(doc1.context, compress=False)
        for name in margins:
            if name == "full":
                fork = staged.fork(method="full", ratio=1.0)
            else:
                first_overrides, second_overrides = arms[name]
                second.clear()
                second.update(second_overrides if "rank_k" in second_overrides
                              else {**SOLVED, "outlier_fraction": 0.01, **second_overrides})
                fork = staged.fork(method="s4r", ratio=5.0, config_overrides=first_overrides)
            fork.ingest(doc2.context)
            margins[name].append((answer_fit(fork, doc2).margin, chat_fit(fork, doc1, doc2).margin))
        print(f"[{time.time() - t0:.0f}s] pair {k + 1} "
              + " | ".join(f"{a} {m[-1][0]:+.2f}/{m[-1][1]:+.2f}" for a, m in margins.items()), flush=True)
    for name, rows in margins.items():
        gaps = [row[1] - ref[1] for row, ref in zip(rows, margins["full"], strict=True)]
        spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        print(f"{name:14s} plain {statistics.mean(r[0] for r in rows):+.2f} "
              f"chat {statistics.mean(r[1] for r in rows):+.2f} "
              f"chat gap {statistics.mean(gaps):+.2f} sd {spread:.2f}")


if __name__ == "__main__":
    main()
