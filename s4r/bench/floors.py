"""Physical floors of one layer's decode step: the bytes it must read and the multiply-adds it must do,
and the machine's read bandwidth, so a kernel's time can be stated as a share of its floor."""

from __future__ import annotations

import time

import torch


def full_floor(tokens: int, kv_heads: int, head_dim: int, q_heads: int, elem: int) -> tuple[int, int]:
    """(bytes, multiply-adds) of exact attention of one query token over `tokens` keys and values."""
    return 2 * tokens * kv_heads * head_dim * elem, 2 * tokens * head_dim * q_heads


def s4r_floor(layer, q_heads: int) -> tuple[int, int]:
    """(bytes, multiply-adds) of an S4R layer's decode step as it last ran: the int8 lead band and key
    scales of every stored token, every band of the selected tokens' keys and values, the exact tokens;
    scoring, the selected keys' rebuild (pre-RoPE) or lower-band logits (post-RoPE), the latent values."""
    n, heads, d = layer.stored_coefs, layer.heads, layer.head_dim
    k = 0 if layer.selected is None else layer.selected.shape[-1]
    lead_k, rank_k, rank_v = layer.plan_k.lead, layer.basis_k.shape[-1], layer.basis_v.shape[-1]
    groups = layer.basis_k.shape[0]
    elem = layer.sink_k.element_size()
    per_token_k = groups * (lead_k + layer.plan_k.tail_bytes + 2 + 2 * layer.plan_k.tail_count)
    per_token_v = groups * (layer.plan_v.lead + layer.plan_v.tail_bytes + 2 + 2 * layer.plan_v.tail_count)
    exact = 2 * layer.exact_length * heads * d * elem
    bytes_read = n * groups * (lead_k + 2) + k * (per_token_k + per_token_v) + exact
    macs = n * lead_k * q_heads + k * rank_v * q_heads + rank_v * d * q_heads
    if layer.cfg.key_space == "pre_rope":
        macs += k * (rank_k * heads * d + q_heads * d)
    else:
        macs += k * (rank_k - lead_k) * q_heads
    return bytes_read, macs


def read_bandwidth(megabytes: int = 64, repeats: int = 5) -> float:
    """Bytes per second one thread reads from memory (the fastest of `repeats` sums of a large buffer)."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best
