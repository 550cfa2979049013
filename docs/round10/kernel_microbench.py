"""Round 10: one decode step's exact attention over 30 layers of SmolLM2's shape (3 KV heads x 64, 9 query
heads folded per KV head), SDPA against two matrix products around an fp32 softmax
(`s4r.hf.attention.matmul_attention`), by dtype and key count, one thread. Keys and values are views of
larger buffers, as a cache's are.

    python docs/round10/kernel_microbench.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from s4r.hf.attention import matmul_attention


def best_of(fn, repeats: int = 5, inner: int = 4) -> float:
    """Fastest mean of `inner` calls over `repeats` tries, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * min(times)


def main() -> None:
    torch.set_num_threads(1)
    print("| dtype | keys | SDPA, 30 layers (ms) | two products (ms) | speed-up |")
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for n in (64, 256, 1024, 2048, 4096, 7600, 16384, 32768):
            cap = n + 256  # spare capacity: the keys are a view, as in a growing cache
            keys = [torch.randn(1, 3, cap, 64, dtype=dtype)[:, :, :n] for _ in range(30)]
            values = [torch.randn(1, 3, cap, 64, dtype=dtype)[:, :, :n] for _ in range(30)]
            query = torch.randn(1, 3, 3, 64, dtype=dtype)

            def sdpa(query=query, keys=keys, values=values):
                for k, v in zip(keys, values, strict=True):
                    F.scaled_dot_product_attention(query, k, v, scale=0.125)

            def products(query=query, keys=keys, values=values):
                for k, v in zip(keys, values, strict=True):
                    matmul_attention(query, k, v, 0.125)

            a, b = best_of(sdpa), best_of(products)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {n:,} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
