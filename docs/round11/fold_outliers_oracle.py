"""Round 11 diagnosis: does the folded chat turn cost document 2's chat margin?

    python docs/round11/fold_outliers_oracle.py 0.5 8

An oracle that ignores the ratio: text folded into coefficients after compression (the chat turn) keeps
the given share of its tokens exact as outliers (the default keeps 1%, which rounds to none for a turn).
Prints document 2's plain and chat margins (`research.two_documents`) with the default's settings on the
tuning book's pairs of seed 100.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

import s4r.layers.lowrank as lowrank
from research.tuning import answer_fit
from research.two_documents import chat_fit
from s4r.bench.tasks import make_samples
from s4r.core.subspace import relative_residual
from s4r.layers.full import to_groups
from s4r.models.loading import load_model
from s4r.runtime.session import Session


def main() -> None:
    share, pairs = float(sys.argv[1]), int(sys.argv[2])

    def many_outliers(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        count = min(math.ceil(share * k.shape[1]), k.shape[1])
        groups = self.basis_k.shape[0]
        worst = (relative_residual(to_groups(k, groups).float(), self.basis_k.float())
                 + relative_residual(to_groups(v, groups).float(), self.basis_v.float()))
        return torch.topk(worst, count).indices.sort().values

    lowrank.LowRankLayer._new_outliers = many_outliers
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")

    def count(text: str) -> int:
        return len(loaded.tokenizer.encode(text, add_special_tokens=False))

    firsts = make_samples("niah_single_book", 2048, pairs, 100, count, book="pride-and-prejudice")
    seconds = make_samples("niah_single_book", 2048, pairs, 101, count, book="pride-and-prejudice")
    t0, rows = time.time(), []
    for k, (doc1, doc2) in enumerate(zip(firsts, seconds, strict=True)):
        staged = Session(loaded, method="full")
        staged.ingest(doc1.context, compress=False)
        fork = staged.fork(method="s4r", ratio=5.0)
        fork.ingest(doc2.context)
        rows.append((answer_fit(fork, doc2).margin, chat_fit(fork, doc1, doc2).margin))
        plain, chat = rows[-1]
        print(f"[{time.time() - t0:.0f}s] pair {k + 1} plain {plain:+.2f} chat {chat:+.2f}", flush=True)
    print("chat mean", statistics.mean(r[1] for r in rows))


if __name__ == "__main__":
    main()
