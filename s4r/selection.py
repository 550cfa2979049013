"""Pure tensor functions of S4R's decode: latent-space scores, pooling and token selection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def latent_scores(coef_k: torch.Tensor, scale_k: torch.Tensor | None, q_lat: torch.Tensor,
                  kv_heads: int) -> torch.Tensor:
    """Relevance logits [kv_heads, N] of every stored token, computed on coefficients only.

    coef_k: [G, N, r] (G = kv_heads for per-head bases, 1 for a layer basis); scale_k: int8 scales
    [G, N, 1] or None; q_lat: [q_heads, r] query coefficients (each head projected on its KV head's
    basis block). The query heads sharing a KV head are summed first (the logit of their sum is the sum
    of their logits), so the cost is one [N, r] pass per KV head, in bf16 on int8 coefficients.
    """
    groups = coef_k.shape[0]
    rank = q_lat.shape[-1]
    q = q_lat.view(kv_heads, -1, rank).sum(dim=1)  # [H, r]
    dtype = torch.bfloat16 if coef_k.dtype == torch.int8 else coef_k.dtype
    c = coef_k.to(dtype)
    if groups == 1:
        logits = torch.matmul(q.to(dtype), c[0].t())  # [H, N]
        scale = None if scale_k is None else scale_k[0, :, 0]
    else:
        logits = torch.matmul(c, q.to(dtype).unsqueeze(-1)).squeeze(-1)  # [H, N]
        scale = None if scale_k is None else scale_k[..., 0]
    logits = logits.float()
    if scale is not None:
        logits = logits * scale.float()
    return logits


def pool_scores(scores: torch.Tensor, kernel: int, mode: str = "max") -> torch.Tensor:
    """Smooth [H, N] scores along the tokens so neighbours of a relevant token come along.

    Max pooling commutes with any monotone map, so it can run on logits directly; average pooling
    is meant for probabilities (softmax the logits first).
    """
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    x = scores.unsqueeze(1)
    if mode == "max":
        return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2).squeeze(1)
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False).squeeze(1)


def select_tokens(scores: torch.Tensor, k: int, forced_tail: int) -> torch.Tensor:
    """Indices [H, k'] of tokens to reconstruct: the last `forced_tail` ones plus the top-k of the rest."""
    heads, n = scores.shape
    forced_tail = min(forced_tail, n)
    candidates = n - forced_tail
    k = min(k, candidates)
    parts = []
    if k > 0:
        parts.append(torch.topk(scores[:, :candidates], k, dim=-1, sorted=False).indices)
    if forced_tail > 0:
        tail = torch.arange(candidates, n, device=scores.device)
        parts.append(tail.unsqueeze(0).expand(heads, -1))
    if not parts:
        return torch.empty(heads, 0, dtype=torch.long, device=scores.device)
    return torch.cat(parts, dim=-1)
