"""A long bf16 query block's attention through `block_attention` (two bf16 products per KV head around a
softmax) against SDPA's CPU kernel: one layer's block alone, then whole documents read into each cache,
the two interleaved in one process.

    python -m research.prefill_attention --tokens 4000 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from s4r.hf import attention


def _timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_rows(shapes: list[tuple[int, int]], heads: tuple[int, int, int], repeats: int) -> list[str]:
    """One layer's attention of q queries over S keys (SmolLM2's 9/3 heads of 64): ms both ways."""
    q_heads, kv_heads, d = heads
    g = torch.Generator().manual_seed(0)
    lines = ["| queries | keys | SDPA ms | block ms | SDPA / block |", "|---|---|---|---|---|"]
    for q_len, s_len in shapes:
        query = torch.randn(1, q_heads, q_len, d, generator=g).bfloat16()
        key, value = (torch.randn(1, kv_heads, s_len, d, generator=g).bfloat16() for _ in range(2))
        args = (query, key, value, d**-0.5)
        sdpa = _timed(lambda a=args: attention.causal_attention(*a, sdpa_only=True), repeats)
        block = _timed(lambda a=args: attention.block_attention(*a), repeats)
        lines.append(f"| {q_len} | {s_len:,} | {sdpa * 1e3:.1f} | {block * 1e3:.1f} | {sdpa / block:.2f}x |")
    return lines


def ingest_rows(tokens: int, methods: list[str], repeats: int) -> list[str]:
    """Seconds to read `tokens` of the held-out book into each cache, SDPA or `block_attention` for its
    blocks (the latter only where bf16 products are native), interleaved."""
    from s4r.bench.chat_speed import documents
    from s4r.models.loading import load_model
    from s4r.runtime.session import Session

    loaded = load_model("smollm2-135m", dtype="bf16")
    text = documents(loaded.tokenizer, tokens, 0, "romeo-and-juliet")[0]
    native = attention.native_bf16
    times: dict[tuple[str, str], list[float]] = {}
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                for method in methods:
                    for path, flag in (("SDPA", False), ("block", True)):
                        attention.native_bf16 = (lambda f=flag: f and native())
                        session = Session(loaded, method=method, ratio=5.0)
                        start = time.perf_counter()
                        session.ingest(text, name="document")
                        times.setdefault((method, path), []).append(time.perf_counter() - start)
    finally:
        attention.native_bf16 = native
    lines = ["| cache | SDPA s | block s | SDPA / block |", "|---|---|---|---|"]
    for method in methods:
        sdpa, block = (statistics.median(times[(method, p)]) for p in ("SDPA", "block"))
        lines.append(f"| {method} | {sdpa:.1f} | {block:.1f} | {sdpa / block:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="full,s4r")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not attention.native_bf16():
        print("this CPU has no native bf16 products: blocks stay on SDPA", file=sys.stderr)
        return 2
    shapes = [(23, 4096), (256, 2048), (256, 4096), (256, 8192)]
    print("\n".join(block_rows(shapes, (9, 3, 64), 7)))
    print()
    print("\n".join(ingest_rows(args.tokens, args.methods.split(","), args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
