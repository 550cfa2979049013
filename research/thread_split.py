"""The fused step's kernels split over threads against the same kernels in one part, interleaved with the
full cache in one decode run (`s4r.bench.decode_speed.measure`): two s4r forks of one prefill, the second
held to one part (`s4r.kernels.jit.parts`).

    python -m research.thread_split --threads 2 --lengths 7600 --steps 48
    python -m research.thread_split --threads 2 --lengths 32768 --prefill 7600 --steps 24
    python -m research.thread_split --threads 2 --lengths 7600 --split-scored 1   # every scoring split
"""

from __future__ import annotations

import argparse
import sys

import torch

import s4r.bench.decode_speed as decode_speed
import s4r.bench.speed as speed
from s4r.bench.config import parse_lengths
from s4r.kernels import jit, s4r_step

ONE_PART = "one part"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.thread_split",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="7600")
    parser.add_argument("--prefill", type=int, default=7600, help="longer lengths tile this prefill")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--book", default="romeo-and-juliet")
    parser.add_argument("--split-scored", type=int, default=s4r_step.SPLIT_SCORED,
                        help="stored tokens from which scoring splits")
    parser.add_argument("--split-selected", type=int, default=s4r_step.SPLIT_SELECTED,
                        help="selected tokens from which their rebuild and value rows split")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    s4r_step.SPLIT_SCORED, s4r_step.SPLIT_SELECTED = args.split_scored, args.split_selected
    from s4r.models.loading import load_model

    split_parts, make_forks, forward = jit.parts, decode_speed.make_forks, speed.forward_tokens
    held: set[int] = set()  # the caches of the forks held to one part
    current = {"one": False}

    def forks(*a, **k):
        made = make_forks(*a, **k)
        made[-1].name = f"{made[-1].name} {ONE_PART}"
        held.add(id(made[-1].cache))
        return made

    def step(model, cache, *a, **k):
        current["one"] = id(cache) in held
        return forward(model, cache, *a, **k)

    jit.parts = lambda: 1 if current["one"] else split_parts()
    decode_speed.make_forks, speed.forward_tokens = forks, step
    try:
        loaded = load_model("smollm2-135m", dtype="bf16")
        print(f"threads {args.threads}, parts {split_parts()}")
        decode_speed.measure(loaded, parse_lengths(args.lengths.split(",")), [("s4r", args.ratio)] * 2,
                             args.steps, args.warmup, prefill_tokens=args.prefill, reference_rows=False,
                             floor=False, book=args.book)
    finally:
        jit.parts, decode_speed.make_forks, speed.forward_tokens = split_parts, make_forks, forward
    return 0


if __name__ == "__main__":
    sys.exit(main())
