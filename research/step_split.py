"""Where a whole one-token decode step's time goes, clocked inside the running step (each layer's weights
streamed through the caches before its attention, unlike `research.profile_kernels`, which replays one
layer's step alone).

    python -m research.step_split --length 7600 --methods full,s4r-fast,s4r --ratio 5 --steps 48

Per layer: the cache's `update`, the registered attention function, and for a post-RoPE one-token layer
(`s4r.kernels.one_token_step`) its three compiled calls. The clocks nest: the attention function holds the
one-token step, which holds the three calls; each difference is Python between them. The cache is a
512-token book prefill tiled to the length (`s4r.bench.decode_speed.tiled`), as in `research.profile_step`.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from research.profile_kernels import clocked
from s4r.bench.config import parse_lengths
from s4r.bench.decode_speed import book_ids, staged_cache, tiled
from s4r.core.rope import model_rope_fn
from s4r.hf import attention as attn_mod
from s4r.hf.generation import forward_tokens
from s4r.kernels import one_token_step
from s4r.methods import CompressContext, make_method

CLOCKED = {"_before_scoring": "before the scoring", "vnni_latent_logits": "scoring",
           "latent_logits": "scoring", "_after_scoring": "after the scoring", "attend_one": "one-token step"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.step_split", description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default="smollm2-135m")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--length", default="7600")
    parser.add_argument("--methods", default="full,s4r-fast,s4r")
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface

    from s4r.models.loading import load_model

    loaded = load_model(args.model, random_weights=args.random_weights)
    model, length = loaded.model, parse_lengths([args.length])[0]
    ids = book_ids(loaded.tokenizer, 512 + args.steps + 8)
    toks = [torch.tensor([[t]]) for t in ids[512:]]
    layers = model.config.num_hidden_layers
    totals: dict[str, float] = collections.defaultdict(float)
    originals = {name: getattr(one_token_step, name) for name in CLOCKED}
    for name, label in CLOCKED.items():
        setattr(one_token_step, name, clocked(totals, label, originals[name]))
    try:
        with torch.inference_mode():
            staged = tiled(staged_cache(model, ids[:512]), length)
            for method in args.methods.split(","):
                cache = staged.copy_staged()
                context = CompressContext(model_rope_fn(model), args.ratio)
                make_method(method, args.ratio).compress(cache, context)
                # registered after the compression, which installs s4r's own attention function
                AttentionInterface.register(attn_mod.ATTN_NAME, clocked(totals, "attention function",
                                                                        attn_mod.s4r_attention))
                cache.update = clocked(totals, "cache update", cache.update)
                for tok in toks[:4]:
                    forward_tokens(model, cache, tok, cache.logical_length())
                totals.clear()
                t0 = time.perf_counter()
                for tok in toks[4 : 4 + args.steps]:
                    forward_tokens(model, cache, tok, cache.logical_length())
                wall = (time.perf_counter() - t0) / args.steps
                name = method if method == "full" else f"{method}@{args.ratio:g}"
                print(f"{name}: step {1e3 * wall:.2f} ms, {length} tokens, {loaded.dtype}, "
                      f"threads {args.threads}")
                for label, seconds in totals.items():
                    print(f"  {label}: {1e6 * seconds / args.steps / layers:.1f} us a layer")
    finally:
        for name, fn in originals.items():
            setattr(one_token_step, name, fn)
        AttentionInterface.register(attn_mod.ATTN_NAME, attn_mod.s4r_attention)
    return 0


if __name__ == "__main__":
    sys.exit(main())
