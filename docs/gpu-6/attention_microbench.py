"""GPU micro-benchmark (run on the lent H200, `bash docs/gpu-6/run2.sh`): exact decode attention variants
and one S4R layer step, Llama-3.1-8B shapes (32 query heads over 8 KV heads, head_dim 128), bf16."""

import time

import torch
import torch.nn.functional as F

from s4r.config import S4RConfig
from s4r.core.budget import KVShape, solve_ranks
from s4r.core.compress import compress_layer
from s4r.hf.attention import causal_attention, fold_heads, unfold_heads

DEV, DT = torch.device("cuda"), torch.bfloat16
SCALE = 128**-0.5


def cuda_ms(fn, n=40):
    """GPU time per call (CUDA events), after five warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def wall_ms(fn, n=20):
    """Host-synchronized time per call (launch overhead included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / n


def exact_variants(q, k, v):
    """The exact attention of one query token, five ways; k/v are views of a larger (capacity) store."""
    kc, vc = k.contiguous(), v.contiguous()

    def folded(keys, values):
        return unfold_heads(F.scaled_dot_product_attention(fold_heads(q, 8), keys, values, scale=SCALE), 32)

    return {
        "gqa view": lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True),
        "gqa contiguous": lambda: F.scaled_dot_product_attention(q, kc, vc, scale=SCALE, enable_gqa=True),
        "folded view": lambda: folded(k, v),
        "folded contiguous": lambda: folded(kc, vc),
        "repeat_interleave (transformers <5)": lambda: F.scaled_dot_product_attention(
            q, kc.repeat_interleave(4, 1), vc.repeat_interleave(4, 1), scale=SCALE),
        "causal_attention (s4r full, view)": lambda: causal_attention(q, k, v, SCALE),
    }


def layer_steps(length):
    """One S4R layer's decode step (update + attend of one token) against exact attention."""
    shape = KVShape(32, 8, 32, 128, 2)
    spread = torch.linspace(3, 0.1, 128, device=DEV, dtype=DT)  # decaying key energy, as real keys have
    keys = torch.randn(8, length, 128, device=DEV, dtype=DT) * spread
    values = torch.randn(8, length, 128, device=DEV, dtype=DT)
    queries = torch.randn(32, 64, 128, device=DEV, dtype=DT)
    query = queries[:, -1:][None]
    new = keys[:, -1:].unsqueeze(0).clone()
    all_k, all_v = torch.cat([keys[None], new], 2), torch.cat([values[None], new], 2)
    out = {"full (causal_attention)": wall_ms(lambda: causal_attention(query, all_k, all_v, SCALE))}
    for ratio in (2.5, 5.0):
        cfg = S4RConfig.fast(ratio)  # the default when this ran (post-RoPE keys: no rotary needed)
        plan = solve_ranks(shape, cfg, length)
        layer = compress_layer(keys, values, queries, cfg, plan.rank_k, plan.rank_v, None)

        def step(layer=layer):
            layer.update(new, new)
            layer.attend(query, None, None, SCALE)
            layer.truncate(layer.logical - 1)

        out[f"s4r {ratio:g} step"] = wall_ms(step)
        out[f"s4r {ratio:g} step (gpu time)"] = cuda_ms(step, 20)
    return out


def main():
    torch.manual_seed(0)
    for length in (32768, 65536, 131072):
        store_k = torch.randn(1, 8, length + length // 16, 128, device=DEV, dtype=DT)
        store_v = torch.randn_like(store_k)
        q = torch.randn(1, 32, 1, 128, device=DEV, dtype=DT)
        rows = exact_variants(q, store_k[:, :, :length], store_v[:, :, :length])
        print(f"S={length}: " + ", ".join(f"{n} {cuda_ms(fn):.3f} ms" for n, fn in rows.items()), flush=True)
        del store_k, store_v, rows
        steps = layer_steps(length)
        print(f"  layer S={length}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in steps.items()), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
