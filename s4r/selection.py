"""Pure tensor functions of S4R's decode: latent-space scores, pooling and token selection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def latent_scores(coef_k: torch.Tensor, scale_k: torch.Tensor | None, q_lat: torch.Tensor,
                  kv_heads: int, scaling: float) -> torch.Tensor:
    """Relevance [kv_heads, N] of every stored token, computed on coefficients only.

    coef_k: [G, N, r] (G = kv_heads for per-head bases, 1 for a layer basis); scale_k: int8 scales
    [G, N, 1] or None; q_lat: [q_heads, r] query coefficients (each head projected on its KV head's
    basis block). Each query head's logits are softmaxed over the tokens, then summed over the heads
    that share a KV head, so one large-logit head cannot drown the others.
    """
    groups = coef_k.shape[0]
    q_heads, rank = q_lat.shape
    n_rep = q_heads // kv_heads
    c = coef_k.to(q_lat.dtype)
    if groups == 1:
        logits = torch.matmul(c[0], q_lat.t())  # [N, Hq]
        if scale_k is not None:
            logits = logits * scale_k[0].to(logits.dtype)
        logits = logits.t().reshape(kv_heads, n_rep, -1)
    else:
        q = q_lat.view(kv_heads, n_rep, rank).transpose(1, 2)  # [H, r, n_rep]
        logits = torch.matmul(c, q)  # [H, N, n_rep]
        if scale_k is not None:
            logits = logits * scale_k.to(logits.dtype)
        logits = logits.transpose(1, 2)
    probs = torch.softmax(logits.float() * scaling, dim=-1)
    return probs.sum(dim=1)


def pool_scores(scores: torch.Tensor, kernel: int, mode: str = "avg") -> torch.Tensor:
    """Smooth [H, N] scores along the tokens so neighbours of a relevant token come along."""
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
