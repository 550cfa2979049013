"""The fused decode kernels against the eager step on a real model: teacher-forced next-token NLL over
a held-out text and greedy continuations, both caches forked from one prefill.

    python -m research.fused_answers --tokens 3000 --steps 48 --ratio 5 --methods s4r,s4r-fast
"""

from __future__ import annotations

import argparse
import sys

import torch

from s4r.bench.decode_speed import staged_cache
from s4r.core.rope import model_rope_fn
from s4r.hf.generation import forward_tokens
from s4r.methods import CompressContext, make_method


def forks(model, staged, method: str, ratio: float):
    rope = model_rope_fn(model)
    out = []
    for kernels in ("fused", "eager"):
        cache = staged.copy_staged()
        make_method(method, ratio, {"kernels": kernels}).compress(cache, CompressContext(rope, ratio))
        out.append(cache)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--greedy", type=int, default=24)
    parser.add_argument("--ratio", type=float, default=5.0)
    parser.add_argument("--methods", default="s4r,s4r-fast")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from s4r.bench.intervals import difference_interval
    from s4r.books import load_book
    from s4r.models.loading import load_model

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(load_book("romeo-and-juliet"), add_special_tokens=False)[: args.tokens + args.steps + 1]
    with torch.inference_mode():
        staged = staged_cache(model, ids[: args.tokens])
        for method in args.methods.split(","):
            fused, eager = forks(model, staged, method, args.ratio)
            gaps = []
            for i in range(args.steps):
                pos = args.tokens + i
                step = torch.tensor([[ids[pos]]])
                logp = [torch.log_softmax(forward_tokens(model, c, step, pos).float(), -1)
                        for c in (fused, eager)]
                nll = [-lp[ids[pos + 1]].item() for lp in logp]
                gaps.append(nll[0] - nll[1])
            ci = difference_interval(gaps)
            print(f"{method}@{args.ratio:g}: {len(gaps)} teacher-forced tokens, NLL fused - eager: mean "
                  f"{ci.mean:+.5f} [{ci.low:+.5f}, {ci.high:+.5f}] (95%), largest |gap| "
                  f"{max(abs(g) for g in gaps):.5f}", flush=True)
            for c in (fused, eager):
                c.truncate(args.tokens)
            texts = []
            for c in (fused, eager):
                pos, last, out = args.tokens, ids[args.tokens], []
                for _ in range(args.greedy):
                    last = int(forward_tokens(model, c, torch.tensor([[last]]), pos).argmax())
                    out.append(last)
                    pos += 1
                texts.append(out)
            same = sum(a == b for a, b in zip(*texts, strict=True))
            print(f"  greedy {args.greedy} tokens: {same} identical; fused: {tok.decode(texts[0])!r}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
