"""Decode speed of a two-document chat: the round-11 default (extended bases) against own bases and the
round-10 budget, interleaved in one loop beside the full cache (round 11's open question: document 2's
higher ranks cost a step more work).

    python docs/round11/twodoc_decode_speed.py --length 2048 --steps 48 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from s4r.bench.decode_speed import Fork, book_ids
from s4r.bench.speed import teacher_force
from s4r.models.loading import load_model
from s4r.runtime.session import Session

ARMS = {"extend (default)": {}, "own bases": {"segment_bases": "own"},
        "round 10": {"segment_bases": "own", "segment_budget": "segment"},
        # document 2 folded into document 1's bases: one segment of 4k tokens, what segments cost
        "folded (one segment)": {"segment_tokens": 0}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=2048, help="tokens of each document")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    ids = book_ids(tok, 3 * args.length + args.steps + 8)
    doc1, doc2 = tok.decode(ids[: args.length]), tok.decode(ids[args.length : 2 * args.length])
    staged = Session(loaded, method="full")
    staged.ingest(doc1, compress=False)
    forks = []
    for name, overrides in {"full": None, **ARMS}.items():
        fork = (staged.fork(method="full", ratio=1.0) if overrides is None else
                staged.fork(method="s4r", ratio=5.0, config_overrides=overrides))
        fork.ingest(doc2)
        forks.append(Fork(name, loaded.model, next(loaded.model.parameters()).device, fork.cache,
                          fork.memory().ratio))
    timings = teacher_force(forks, ids[2 * args.length : 2 * args.length + args.steps], warmup=8)
    base = statistics.median(timings[0].seconds)
    for fork, timing in zip(forks, timings, strict=True):
        ms = statistics.median(timing.seconds)
        print(f"{fork.name:22s} x{fork.ratio:5.2f}  {1000 * ms:7.1f} ms/token  {base / ms:5.2f}x full")


if __name__ == "__main__":
    main()
