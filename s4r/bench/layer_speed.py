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
from dataclasses import replace

import torch
import torch.nn.functional as F

from s4r.bench.config import parse_lengths
from s4r.bench.decode_speed import book_ids, staged_cache
from s4r.bench.floors import full_floor, read_bandwidth, s4r_floor
from s4r.config import S4RConfig
from s4r.core.budget import KVShape, solve_ranks
from s4r.core.compress import compress_layer
from s4r.core.rope import RopeFn, model_rope_fn
from s4r.hf.attention import causal_attention
from s4r.layers.full import FullLayer


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


def layer_times(keys, values, queries, shape: KVShape, ratios, repeats: int, rope: RopeFn | None = None,
                floors: dict[str, tuple[int, int]] | None = None) -> dict[str, float]:
    """Milliseconds per token of each kernel on one layer's [H, T, d] keys/values and [Hq, W, d] queries;
    `floors` gets each kernel's (bytes read, multiply-adds). `s4r R` is the default step (fused where
    the kernels apply), `s4r R eager` its eager reference."""
    floors = {} if floors is None else floors
    scaling = keys.shape[-1] ** -0.5
    query = queries[:, -1:].unsqueeze(0)
    new = keys[:, -1:].unsqueeze(0).clone()
    all_k, all_v = torch.cat([keys[None], new], 2), torch.cat([values[None], new], 2)
    out = {"transformers": best_ms(lambda: plain_sdpa(query, all_k, all_v, scaling), max(3, repeats // 6)),
           "full": best_ms(lambda: causal_attention(query, all_k, all_v, scaling), repeats)}
    floors["full"] = full_floor(all_k.shape[2], keys.shape[0], keys.shape[2], query.shape[1],
                                all_k.element_size())
    for ratio in ratios:
        cfg = S4RConfig(ratio=ratio)
        plan = solve_ranks(shape, cfg, keys.shape[1])
        layer = compress_layer(keys, values, queries, cfg, plan.rank_k, plan.rank_v, rope)

        def step(layer=layer):
            layer.update(new, new)
            layer.attend(query, None, None, scaling)
            layer.truncate(layer.logical - 1)  # the same context every call

        eager = compress_layer(keys, values, queries, replace(cfg, kernels="eager"), plan.rank_k, plan.rank_v,
                               rope)
        out[f"s4r {ratio:g} eager"] = best_ms(lambda eager=eager: step(eager), repeats)

        def scoring(layer=layer):
            layer.update(new, new)
            qf, exact_logits, q_len = layer.exact_step(query, scaling)
            latent = layer.latent_step(qf, exact_logits, q_len, scaling)
            layer.choose_tokens(layer.step_scores(latent), latent.probs, layer.selection_bounds())
            layer.truncate(layer.logical - 1)

        out[f"s4r {ratio:g}"] = best_ms(step, repeats)
        step(layer)
        floors[f"s4r {ratio:g}"] = s4r_floor(layer, query.shape[1])
        out[f"s4r {ratio:g} scoring"] = best_ms(scoring, repeats)
    return out


def model_step_ms(model, repeats: int) -> float:
    """Milliseconds of a decode step of `model` over a 16-token exact cache: the step's cost besides
    attention over a long context (projections, MLPs, the head, every layer's dispatch)."""
    from s4r.hf.generation import forward_tokens

    cache = staged_cache(model, list(range(16)))
    cache.compress(lambda i, layer: FullLayer.from_staged(layer))
    tok = torch.tensor([[1]], device=next(model.parameters()).device)

    def step() -> None:
        forward_tokens(model, cache, tok, cache.logical_length())
        cache.truncate(16)

    return best_ms(step, repeats)


def speed_ceiling(model_ms: float, layers: int, full_ms: float, part_ms: float) -> float:
    """The decode speed against the exact cache of a step whose every layer costs `part_ms` instead of the
    exact attention's `full_ms`, the rest of the step (`model_ms`) unchanged."""
    return (model_ms + layers * full_ms) / (model_ms + layers * part_ms)


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
    from s4r.models.loading import load_model

    loaded = load_model(args.model)
    model = loaded.model
    with torch.inference_mode():
        staged = staged_cache(model, book_ids(loaded.tokenizer, min(args.prefill, max(lengths))))
        shape = staged.shape
        model_ms = model_step_ms(model, args.repeats)
        print(f"model step besides attention (16-token cache): {model_ms:.1f} ms; {shape.layers} layers")
        layer_ids = [i for i in layer_ids if i < len(staged.layers)] or [0]
        names = ["transformers", "full"] + [f"s4r {r:g}{part}" for r in ratios
                                            for part in ("", " eager", " scoring")]
        bandwidth = read_bandwidth()
        print(f"one thread reads {bandwidth / 1e9:.1f} GB/s (a 64 MiB buffer summed)")
        floor_rows = []
        methods = [f"s4r {r:g}" for r in ratios]
        print("| tokens | " + " | ".join(f"{x}, ms" for x in names) + " | "
              + " | ".join(f"{m}: step vs full (ceiling if only scoring)" for m in methods)
              + " | any cache, attention free |")
        print("|---" * (2 + len(names) + len(methods)) + "|")
        for n in lengths:
            sums = dict.fromkeys(names, 0.0)
            floors: dict[str, tuple[int, int]] = {}
            for i in layer_ids:
                layer = staged.layers[i]
                reps = n // layer.logical + 1
                keys = layer.keys_view[0].repeat(1, reps, 1)[:, :n]
                values = layer.values_view[0].repeat(1, reps, 1)[:, :n]
                times = layer_times(keys, values, layer.queries[0], shape, ratios, args.repeats,
                                    model_rope_fn(model), floors)
                for name, ms in times.items():
                    sums[name] += ms / len(layer_ids)
            # a whole step from one layer's kernels: the model's other work plus every layer's attention
            cells = [f"{sums[x]:.2f}" for x in names] + [
                f"{speed_ceiling(model_ms, shape.layers, sums['full'], sums[m]):.2f}x "
                f"({speed_ceiling(model_ms, shape.layers, sums['full'], sums[m + ' scoring']):.2f}x)"
                for m in methods] + [f"{speed_ceiling(model_ms, shape.layers, sums['full'], 0.0):.2f}x"]
            print(f"| {n:,} | " + " | ".join(cells) + " |", flush=True)
            for name, (nbytes, macs) in floors.items():
                floor_ms = 1000 * nbytes / bandwidth
                floor_rows.append(f"| {n:,} | {name} | {nbytes / 1e3:,.0f} | {macs / 1e6:.2f} | "
                                  f"{floor_ms:.3f} | {sums[name]:.3f} | {floor_ms / sums[name]:.0%} |")
        print("\n| tokens | kernel | KB read | M multiply-adds | floor at the read bandwidth, ms "
              "| measured, ms | share of floor |\n|---|---|---|---|---|---|---|")
        print("\n".join(floor_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
