"""The GPU's Triton kernels of an S4R step against the eager path on a real layer shape: the first thing to
run where a GPU is lent (the kernels compile there; the tests check them only through the interpreter).

    python -m research.triton_check                      # CUDA, an 8B model's layer (8 KV heads x 128)
    TRITON_INTERPRET=1 python -m research.triton_check --device cpu --tokens 600 --kv-heads 2 --repeats 1

Random low-rank keys and random values of `--tokens` tokens are compressed at ratio 5 (bf16), a step's
worth of tokens is selected, and each kernel is compared with the eager path (the keys' logits with the
rebuild in the model's dtype, the value rows with the fp64 product of the rows as stored) and timed
against it (medians of `--repeats`, the device synchronized around each call).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def _rotary_holder(heads: int, group: int, d: int, device: torch.device) -> torch.nn.Module:
    """A module holding a Llama-3 shaped rotary embedding, as `model_rope_fn` reads a model's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=d * heads * group, num_attention_heads=heads * group,
                         num_key_value_heads=heads, head_dim=d, rope_theta=500000.0)
    holder = torch.nn.Module()
    holder.rotary_emb = LlamaRotaryEmbedding(config).to(device)
    holder.anchor = torch.nn.Parameter(torch.zeros(1, device=device, dtype=torch.bfloat16))
    return holder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.triton_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--selected", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    from s4r.config import S4RConfig
    from s4r.core.budget import KVShape, solve_ranks
    from s4r.core.compress import compress_layer
    from s4r.core.rope import model_rope_fn
    from s4r.core.subspace import head_blocks
    from s4r.kernels import triton_step

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here (run with --device cpu and TRITON_INTERPRET=1 to check the script)")
        return 2
    heads, d, group, n = args.kv_heads, args.head_dim, args.group, args.tokens
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(heads, d, 32, generator=g)
    keys = torch.randn(heads, n, 32, generator=g) @ basis.transpose(1, 2)
    keys += 0.1 * torch.randn(heads, n, d, generator=g)
    values, queries = torch.randn(heads, n, d, generator=g), torch.randn(heads * group, 32, d, generator=g)
    cfg = S4RConfig(ratio=5.0)
    plan = solve_ranks(KVShape(1, heads, heads * group, d, 2), cfg, n)
    rope = model_rope_fn(_rotary_holder(heads, group, d, device))
    kv = (t.to(device, torch.bfloat16) for t in (keys, values, queries))
    layer = compress_layer(*kv, cfg, plan.rank_k, plan.rank_v, rope)
    k = min(args.selected, layer._n)
    idx = torch.randperm(layer._n, generator=g)[:k].sort().values[None].to(device)
    qf = torch.randn(heads, group, d, generator=g).to(device)
    probs = torch.softmax(torch.randn(heads, group, k, generator=g), -1).to(device)
    print(f"layer: {heads} KV heads x {d}, {n} tokens, key rank {plan.rank_k}, value rank {plan.rank_v}, "
          f"{k} selected")

    def fused_keys():
        return triton_step.key_logits(layer, qf, idx, d**-0.5, head_blocks(layer.basis_k, heads))

    def eager_keys():
        return layer._model_dtype_key_logits(qf, idx, d**-0.5)

    got, want = fused_keys(), eager_keys()
    if got is None:
        print(f"key kernel: did not run ({triton_step._state['failed']!r})")
        return 1
    gap = (got - want).abs().max().item() / want.abs().max().item()
    fused_ms, eager_ms = timed(fused_keys, device, args.repeats), timed(eager_keys, device, args.repeats)
    print(f"key logits: max difference {gap:.2e} of the largest logit; kernel {fused_ms:.3f} ms, eager "
          f"{eager_ms:.3f} ms")
    weigh = triton_step.weighted_rows(layer, idx)
    eager_weigh = layer.gathered_values(idx)

    def eager_values():
        return eager_weigh(probs)

    z, eager = weigh(probs), eager_values()
    if triton_step._state["failed"] is not None:
        print(f"value kernel: did not run ({triton_step._state['failed']!r})")
        return 1
    gap = (z - eager).abs().max().item() / eager.abs().max().item()
    print(f"value rows: max difference {gap:.2e} of the largest; kernel "
          f"{timed(lambda: weigh(probs), device, args.repeats):.3f} ms, eager "
          f"{timed(eager_values, device, args.repeats):.3f} ms (the eager time leaves out its gathers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
