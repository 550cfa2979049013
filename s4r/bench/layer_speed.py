"""One layer's decode attention in isolation, against context length: where S4R's step beats SDPA.

    python -m s4r.bench.layer_speed --lengths 2k,4k,7600,16k,32k --threads 1

Real keys, values and queries of a book prefill (SmolLM2 by default; `--prefill` tokens, tiled past
that for longer lengths), three layers averaged, each kernel timed alone (best of `--repeats`, which
filters out a busy machine's preemptions). Rows: transformers' sdpa path (K/V repeated per query
head), s4r's exact `full` attention (grouped heads folded), and an S4R layer's whole step (`update` +
`attend` of one token) at each ratio, with ranks from the budget solver.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from s4r.attention import causal_attention
from s4r.budget import KVShape, solve_ranks
from s4r.compress import compress_layer
from s4r.config import S4RConfig
from s4r.rope import RopeFn, model_rope_fn

from .config import parse_lengths
from .decode_speed import book_ids, staged_cache


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` calls after three warm-up calls, in milliseconds."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def plain_sdpa(query, key, value, scaling):
    """transformers' sdpa path for one query token: K/V repeated per query head."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(query, key, value, scale=scaling)


def layer_times(keys, values, queries, shape: KVShape, ratios, repeats: int,
                rope: RopeFn | None = None) -> dict[str, float]:
    """Milliseconds per token of each kernel on one layer's [H, T, d] keys/values and [Hq, W, d] queries."""
    scaling = keys.shape[-1] ** -0.5
    query = queries[:, -1:].unsqueeze(0)
    new = keys[:, -1:].unsqueeze(0).clone()
    all_k, all_v = torch.cat([keys[None], new], 2), torch.cat([values[None], new], 2)
    out = {"transformers": best_ms(lambda: plain_sdpa(query, all_k, all_v, scaling), max(3, repeats // 6)),
           "full": best_ms(lambda: causal_attention(query, all_k, all_v, scaling), repeats)}
    for ratio in ratios:
        cfg = S4RConfig(ratio=ratio)
        plan = solve_ranks(shape, cfg, keys.shape[1])
        layer = compress_layer(keys, values, queries, cfg, plan.rank_k, plan.rank_v, rope)

        def step(layer=layer):
            layer.update(new, new)
            layer.attend(query, None, None, scaling)
            layer.truncate(layer.logical - 1)  # the same context every call

        out[f"s4r {ratio:g}"] = best_ms(step, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s4r.bench.layer_speed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default="smollm2-135m")
    parser.add_argument("--lengths", default="2k,4k,7600,16k,32k")
    parser.add_argument("--ratios", default="2.5,5")
    parser.add_argument("--prefill", type=int, default=7600, help="tokens actually prefilled")
    parser.add_argument("--layers", default="5,15,25")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        lengths = list(parse_lengths(args.lengths.split(",")))
        ratios = [float(x) for x in args.ratios.split(",")]
        layer_ids = [int(x) for x in args.layers.split(",")]
    except ValueError:
        print("error: --lengths like 2k,8k, --ratios like 2.5,5, --layers like 5,15", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from s4r.loading import load_model

    loaded = load_model(args.model)
    model = loaded.model
    with torch.inference_mode():
        staged = staged_cache(model, book_ids(loaded.tokenizer, min(args.prefill, max(lengths))))
        shape = staged.shape
        layer_ids = [i for i in layer_ids if i < len(staged.layers)] or [0]
        names = ["transformers", "full"] + [f"s4r {r:g}" for r in ratios]
        print("| tokens | " + " | ".join(names) + " | " + " | ".join(f"full / {n}" for n in names[2:]) + " |")
        print("|---" * (1 + len(names) + len(names) - 2) + "|")
        for n in lengths:
            sums = dict.fromkeys(names, 0.0)
            for i in layer_ids:
                layer = staged.layers[i]
                reps = n // layer.logical + 1
                keys = layer.keys_view[0].repeat(1, reps, 1)[:, :n]
                values = layer.values_view[0].repeat(1, reps, 1)[:, :n]
                times = layer_times(keys, values, layer.queries[0], shape, ratios, args.repeats,
                                    model_rope_fn(model))
                for name, ms in times.items():
                    sums[name] += ms / len(layer_ids)
            cells = [f"{sums[x]:.2f}" for x in names] + [f"{sums['full'] / sums[x]:.2f}x" for x in names[2:]]
            print(f"| {n:,} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
