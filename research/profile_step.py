"""Where one decode step's time goes: torch.profiler over a few steps of one fork at one length.

    python -m research.profile_step --length 4k --method full --threads 1
    python -m research.profile_step --length 4k --method s4r --ratio 5 --lean

The staged cache is a short prefill tiled to the length (`s4r.bench.decode_speed.tiled`: a step costs the
same whatever the tokens say). Prints the operator table sorted by self CPU time and the share of the
step spent inside the attention function.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from s4r.bench.config import parse_lengths
from s4r.bench.decode_speed import book_ids, staged_cache, tiled
from s4r.core.rope import model_rope_fn
from s4r.hf import attention as attn_mod
from s4r.hf.generation import forward_tokens
from s4r.hf.lean import set_decode_step
from s4r.methods import CompressContext, make_method


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.profile_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default="smollm2-135m")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--length", default="4k")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--method", default="full")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lean", action="store_true", help="profile the lean decode step (S4R_COMPILE=0: "
                        "uncompiled)")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from s4r.models.loading import load_model

    loaded = load_model(args.model, random_weights=args.random_weights)
    model = loaded.model
    length = parse_lengths([args.length])[0]
    ids = book_ids(loaded.tokenizer, args.prefill + 2 * args.steps + 4)
    with torch.inference_mode():
        staged = tiled(staged_cache(model, ids[: args.prefill]), length)
        cache = staged.copy_staged()
        context = CompressContext(model_rope_fn(model), args.ratio)
        make_method(args.method, args.ratio).compress(cache, context)
    set_decode_step(model, "lean" if args.lean else "reference")

    def step(c, tok, pos):
        return forward_tokens(model, c, tok, pos)

    # time inside the attention function (the part this profile is not about)
    inside = [0.0]
    original = attn_mod.s4r_attention

    def timed_attention(*a, **k):
        t0 = time.perf_counter()
        out = original(*a, **k)
        inside[0] += time.perf_counter() - t0
        return out

    from transformers import AttentionInterface

    AttentionInterface.register(attn_mod.ATTN_NAME, timed_attention)
    toks = [torch.tensor([[t]]) for t in ids[args.prefill :]]
    with torch.inference_mode():
        for tok in toks[:4]:
            step(cache, tok, cache.logical_length())
        inside[0] = 0.0
        t0 = time.perf_counter()
        for tok in toks[4 : 4 + args.steps]:
            step(cache, tok, cache.logical_length())
        wall = (time.perf_counter() - t0) / args.steps
        attn = inside[0] / args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for tok in toks[4 + args.steps : 4 + 2 * args.steps]:
                step(cache, tok, cache.logical_length())
    AttentionInterface.register(attn_mod.ATTN_NAME, original)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(f"step {1000 * wall:.1f} ms (unprofiled), attention function {1000 * attn:.1f} ms, "
          f"outside attention {1000 * (wall - attn):.1f} ms; {args.length} {args.method}"
          f"{'' if args.method == 'full' else f'@{args.ratio:g}'}, {loaded.dtype}, threads {args.threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
