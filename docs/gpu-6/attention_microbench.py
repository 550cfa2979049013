"""Scratch GPU micro-benchmark: exact decode attention variants, and one S4R layer step, Llama-8B shapes."""
import sys
import torch
import torch.nn.functional as F
from s4r.attention import causal_attention, fold_heads, unfold_heads
from s4r.budget import KVShape, solve_ranks
from s4r.compress import compress_layer
from s4r.config import S4RConfig

dev, dt = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)


def cuda_ms(fn, n=40):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def wall_ms(fn, n=20):  # host-synchronized, includes launch overhead
    import time
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / n


shape = KVShape(32, 8, 32, 128, 2)
sc = 128 ** -0.5
for S in (32768, 65536, 131072):
    cap = S + S // 16
    kb = torch.randn(1, 8, cap, 128, device=dev, dtype=dt)
    vb = torch.randn_like(kb)
    k, v = kb[:, :, :S], vb[:, :, :S]
    kc, vc = k.contiguous(), v.contiguous()
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=dt)
    rows = {
        "gqa view": lambda: F.scaled_dot_product_attention(q, k, v, scale=sc, enable_gqa=True),
        "gqa contiguous": lambda: F.scaled_dot_product_attention(q, kc, vc, scale=sc, enable_gqa=True),
        "folded view": lambda: unfold_heads(F.scaled_dot_product_attention(fold_heads(q, 8), k, v, scale=sc), 32),
        "folded contiguous": lambda: unfold_heads(F.scaled_dot_product_attention(fold_heads(q, 8), kc, vc, scale=sc), 32),
        "repeat_interleave (transformers <5)": lambda: F.scaled_dot_product_attention(
            q, kc.repeat_interleave(4, 1), vc.repeat_interleave(4, 1), scale=sc),
        "causal_attention (s4r full, view)": lambda: causal_attention(q, k, v, sc),
    }
    print(f"S={S}: " + ", ".join(f"{name} {cuda_ms(fn):.3f} ms" for name, fn in rows.items()), flush=True)
    del kb, vb, kc, vc
    # one S4R layer step (update + attend of one token) against the exact attention, wall time
    keys = torch.randn(8, S, 128, device=dev, dtype=dt) * torch.linspace(3, 0.1, 128, device=dev, dtype=dt)
    values = torch.randn(8, S, 128, device=dev, dtype=dt)
    queries = torch.randn(32, 64, 128, device=dev, dtype=dt)
    new = keys[:, -1:].unsqueeze(0).clone()
    allk, allv = torch.cat([keys[None], new], 2), torch.cat([values[None], new], 2)
    out = {"full (causal_attention)": wall_ms(lambda: causal_attention(queries[:, -1:][None], allk, allv, sc))}
    for ratio in (2.5, 5.0):
        cfg = S4RConfig(ratio=ratio)
        plan = solve_ranks(shape, cfg, S)
        layer = compress_layer(keys, values, queries, cfg, plan.rank_k, plan.rank_v, None)
        def step(layer=layer):
            layer.update(new, new)
            layer.attend(queries[:, -1:][None], None, None, sc)
            layer.truncate(layer.logical - 1)
        out[f"s4r {ratio:g} step"] = wall_ms(step)
        out[f"s4r {ratio:g} step (gpu time)"] = cuda_ms(step, 20)
    print(f"  layer S={S}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in out.items()), flush=True)
    del keys, values, allk, allv
    torch.cuda.empty_cache()
