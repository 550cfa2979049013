"""Seconds to compress one layer (`compress_layer`: sample, bases, every token's coefficients) of the default
model's shape at given lengths, from random keys and values of a low-rank structure, and how much of it the
rotary table kept across a document's layers and blocks saves (`--per-call-tables`: each block computes the
table of every position again).

    python -m research.compress_speed --lengths 2048,8192,32768 --per-call-tables
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from s4r.config import S4RConfig
from s4r.core import compress
from s4r.core.budget import KVShape, solve_ranks
from s4r.core.rope import model_rope_fn, rope_rows


def layer_inputs(tokens: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 keys (rank 12 plus noise) and values [heads, tokens, dim]."""
    g = torch.Generator().manual_seed(tokens)
    keys = torch.randn(heads, tokens, 12, generator=g) @ torch.randn(heads, 12, dim, generator=g)
    keys = keys + 0.1 * torch.randn(heads, tokens, dim, generator=g)
    return keys.bfloat16(), torch.randn(heads, tokens, dim, generator=g).bfloat16()


def seconds(tokens: int, rope, cfg: S4RConfig, shape, repeats: int, per_call: bool) -> float:
    """Median seconds of `compress_layer` over `repeats` calls after one more (which builds the rotary
    table the model's later layers read)."""
    keys, values = layer_inputs(tokens, shape.kv_heads, shape.head_dim)
    plan = solve_ranks(shape, cfg, tokens)
    compress.rope_rows = (lambda r, s, e: r(torch.arange(s, e))) if per_call else rope_rows
    times = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            compress.compress_layer(keys, values, None, cfg, plan.rank_k, plan.rank_v, rope)
            times.append(time.perf_counter() - start)
    finally:
        compress.rope_rows = rope_rows
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--per-call-tables", action="store_true", help="also time tables computed per call")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from s4r.models.loading import load_model

    loaded = load_model("smollm2-135m", dtype="bf16")
    shape = KVShape.from_config(loaded.model.config, 2)  # bf16
    rope, cfg = model_rope_fn(loaded.model), S4RConfig(ratio=args.ratio)
    print("| tokens | kept table: s a layer | tables per call: s a layer | saved |")
    print("|---|---|---|---|")
    for tokens in (int(x) for x in args.lengths.split(",")):
        kept = seconds(tokens, rope, cfg, shape, args.repeats, per_call=False)
        if args.per_call_tables:
            each = seconds(tokens, rope, cfg, shape, args.repeats, per_call=True)
            print(f"| {tokens:,} | {kept:.3f} | {each:.3f} | {each / kept:.2f}x |")
        else:
            print(f"| {tokens:,} | {kept:.3f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
