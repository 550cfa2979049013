"""Where the fused S4R step of one layer spends its time: each kernel of `s4r.kernels.s4r_step` timed
inside the step, on real layers of a book prefill, with the step's floor beside.

    python -m research.profile_kernels --tokens 7600 --specs s4r@5,s4r-fast@5,s4r@2.5 --threads 1
    python -m research.profile_kernels --tokens 32768 --prefill 7600 --specs s4r@5   # tiled, timing only
    python -m research.profile_kernels --tokens 4021 --queries 23 --specs s4r@5      # a question's prompt
    python -m research.profile_kernels -m qwen3-0.6b --random-weights --tokens 32768 --prefill 2048

Each kernel is wrapped with a clock (the step's own total is timed unwrapped too); `rest` is the step
less its kernels: the int8 key products (torch), the update and the Python between kernels. A post-RoPE
layer's one-token step shows its three calls (`_before_scoring`, the scoring, `_after_scoring`).
The floor is `s4r.bench.floors.s4r_floor` (bytes a one-query step must read, multiply-adds it must do).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from s4r.bench.decode_speed import book_ids, method_spec, staged_cache, tiled
from s4r.bench.floors import full_floor, s4r_floor
from s4r.config import S4RConfig
from s4r.core.budget import solve_ranks
from s4r.core.compress import compress_layer
from s4r.core.rope import model_rope_fn
from s4r.hf.attention import causal_attention
from s4r.kernels import one_token_step, s4r_step

KERNELS = ("query_rows", "project_queries", "exact_logits", "latent_logits", "vnni_latent_logits",
           "normaliser", "combine_normalisers", "pooled_relevance", "choose_tokens", "decode_rows",
           "decode_rows_int8", "rotated_key_logits", "vnni_key_logits", "latent_key_logits",
           "softmax_exact_values", "weighted_value_rows", "add_value_basis", "query_rotations",
           "window_rows", "exact_logits_product", "mask_later_tokens", "rotate_keys", "key_logits_product",
           "key_pair_logits", "exact_values_product", "value_rows_product", "value_pair_rows",
           "add_value_basis_product", "_before_scoring", "_after_scoring")
# a post-RoPE layer's one-token step runs these three calls instead (`s4r.kernels.one_token_step`)
ONE_TOKEN = ("_before_scoring", "latent_logits", "vnni_latent_logits", "_after_scoring")


def clocked(times: dict[str, float], name: str, fn):
    """`fn` adding its wall time to times[name]."""
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name] += time.perf_counter() - t0
        return out
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.profile_kernels",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=7600)
    parser.add_argument("--specs", default="s4r@5,s4r-fast@5,s4r@2.5",
                        help="method@ratio, each method optionally with settings: s4r+granularity=head@5")
    parser.add_argument("--layers", default="5,15,25")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--queries", type=int, default=1, help="a block of this many queries (a prompt)")
    parser.add_argument("--book", default=None)
    parser.add_argument("--prefill", type=int, default=None,
                        help="prefill this many tokens and tile them up to --tokens (timing only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", help="model dtype: auto, bf16 or fp32")
    parser.add_argument("-m", "--model", default="smollm2-135m", help="a profile name or a model path")
    parser.add_argument("--random-weights", action="store_true",
                        help="the profile's shape with random weights (timing only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from s4r.models.loading import load_model

    loaded = load_model(args.model, dtype=args.dtype, random_weights=args.random_weights)
    rope = model_rope_fn(loaded.model)
    layer_ids = [int(x) for x in args.layers.split(",")]
    with torch.inference_mode():
        ids = book_ids(loaded.tokenizer, args.prefill or args.tokens, args.book)
        staged = staged_cache(loaded.model, ids)
        if args.prefill:
            staged = tiled(staged, args.tokens)
        print("| method | layer | selected | step, ms | " + " | ".join(KERNELS)
              + " | rest | exact attention, ms | floor: KB read, M multiply-adds |")
        print("|---" * (len(KERNELS) + 7) + "|")
        for spec in args.specs.split(","):
            method, ratio = spec.split("@")
            space, overrides = method_spec(method)
            cfg = S4RConfig.fast(float(ratio)) if space == "s4r-fast" else S4RConfig(ratio=float(ratio))
            cfg = cfg.with_overrides(overrides)
            for li in layer_ids:
                staged_layer = staged.layers[li]
                keys, values = staged_layer.keys_view[0], staged_layer.values_view[0]
                queries = staged_layer.queries[0]
                plan = solve_ranks(staged.shape, cfg, keys.shape[1])
                layer = compress_layer(keys, values, queries, cfg, plan.rank_k, plan.rank_v, rope)
                block = args.queries
                query, new = queries[:, -block:].unsqueeze(0), keys[:, -block:].unsqueeze(0).clone()
                scaling = keys.shape[-1] ** -0.5

                def step(layer=layer, query=query, new=new, scaling=scaling, block=block):
                    layer.update(new, new)
                    layer.attend(query, None, None, scaling)
                    layer.truncate(layer.logical - block)

                def timed(fn, repeats=args.repeats):
                    for _ in range(3):
                        fn()
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        fn()
                    return (time.perf_counter() - t0) / repeats
                whole = timed(step)
                all_k, all_v = torch.cat([keys[None], new], 2), torch.cat([values[None], new], 2)
                exact = timed(lambda q=query, k=all_k, v=all_v, s=scaling: causal_attention(q, k, v, s))
                times: dict[str, float] = collections.defaultdict(float)
                originals = [(s4r_step, name) for name in KERNELS if hasattr(s4r_step, name)]
                originals = [(mod, name, getattr(mod, name)) for mod, name in
                             originals + [(one_token_step, name) for name in ONE_TOKEN]]
                for mod, name, fn in originals:
                    setattr(mod, name, clocked(times, name, fn))
                try:
                    times.clear()
                    wrapped = timed(step)
                finally:
                    for mod, name, fn in originals:
                        setattr(mod, name, fn)
                per = {name: 1000 * times[name] / args.repeats for name in KERNELS}
                nbytes, macs = s4r_floor(layer, query.shape[1])
                full_bytes, _ = full_floor(all_k.shape[2], keys.shape[0], keys.shape[2], query.shape[1],
                                           all_k.element_size())
                cells = " | ".join(f"{per[name]:.3f}" if times[name] else "" for name in KERNELS)
                print(f"| {spec} | {li} | {layer.selected.shape[-1]} | {1000 * whole:.3f} | {cells} | "
                      f"{1000 * wrapped - sum(per.values()):.3f} | {1000 * exact:.3f} | "
                      f"{nbytes / 1e3:,.0f}, {macs / 1e6:.1f} (exact: {full_bytes / 1e3:,.0f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
