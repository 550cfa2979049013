"""Needles answered by one model split over several ranks, against the same model in one process.

    OMP_NUM_THREADS=1 python -m research.tensor_parallel_needles --out one.jsonl
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 3 -m research.tensor_parallel_needles --out tp3.jsonl
    python -m research.tensor_parallel_needles --compare one.jsonl tp3.jsonl

Each sample is one held-out single-needle document (Romeo and Juliet haystack), ingested into S4R at the
given ratio and asked its question greedily with the bench's answer prefix and budget. Under torchrun
the model is split by KV head (`s4r.distributed`), each rank compresses its own heads, and rank 0 writes
one JSON line per sample: the answer, its score, and the stored bytes of every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from s4r.bench.scoring import score
from s4r.bench.tasks import answer_budget, needle_sample
from s4r.distributed import world
from s4r.models.loading import load_model
from s4r.runtime.session import Session


def run(args: argparse.Namespace) -> None:
    """Answer `args.samples` needles and write one line per sample (rank 0)."""
    me = world.start("cpu")
    loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, tensor_parallel=me.size)
    tok = loaded.tokenizer

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    out = open(args.out, "w") if me.is_main else None  # noqa: SIM115 - closed below
    for i in range(args.samples):
        depth = (i + 0.5) / args.samples
        sample = needle_sample(args.length, depth, args.seed + i, count, haystack=args.book)
        t0 = time.perf_counter()
        session = Session(loaded, method="s4r", ratio=args.ratio)
        session.ingest(sample.context)
        budget = answer_budget(sample, count, 32)
        answer, stats = session.ask(sample.question, prime=sample.answer_prefix, max_new_tokens=budget)
        per_rank = world.gather(stats.memory.stored_bytes)
        full = world.gather(stats.memory.full_bytes)
        record = {"sample": i, "depth": depth, "answer": answer, "answers": sample.answers,
                  "score": score(sample, answer), "ranks": me.size, "method": session.method,
                  "kv_bytes_per_rank": per_rank, "kv_bytes": sum(per_rank), "kv_full_bytes": sum(full),
                  "ratio_achieved": sum(full) / sum(per_rank), "seconds": time.perf_counter() - t0}
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"{i}: {record['score']:.0f} {answer!r} bytes/rank {per_rank}", file=sys.stderr, flush=True)
    if out is not None:
        out.close()
    world.stop()


def compare(one: Path, other: Path) -> None:
    """Print how many samples the two runs answered the same, and each run's score."""
    a = [json.loads(line) for line in one.read_text().splitlines()]
    b = [json.loads(line) for line in other.read_text().splitlines()]
    n = min(len(a), len(b))
    same = sum(x["answer"].strip() == y["answer"].strip() for x, y in zip(a[:n], b[:n], strict=True))
    print(f"samples {n}; same answer {same}/{n}; score {sum(x['score'] for x in a[:n]):.0f} vs "
          f"{sum(y['score'] for y in b[:n]):.0f}; bytes {a[0]['kv_bytes']} ({a[0]['ranks']} rank(s)) vs "
          f"{b[0]['kv_bytes']} per rank {b[0]['kv_bytes_per_rank']}")


def main() -> None:
    """Command line: run, or --compare two runs' files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--book", default="romeo-and-juliet")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="needles.jsonl")
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
