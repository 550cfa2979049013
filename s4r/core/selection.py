"""Pure tensor functions of S4R's decode: which stored tokens to reconstruct (or attend in latent space).

Two ways to score the stored tokens:
- relevance (`query`, `max`, `mean`): every query row's own attention probabilities over the stored
  tokens (one softmax per query and query head, in latent space), aggregated over the heads of a KV
  group, and for `max`/`mean` over recent queries with a decay. A token one query attends to sharply
  keeps a high score.
- `summed`: the older, cheaper proxy: the window queries averaged into one query, the query heads of a
  KV group summed, one latent dot product per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from s4r.core.latent import latent_logits


def latent_scores(coef_t: torch.Tensor, scale_k: torch.Tensor | None, q_lat: torch.Tensor,
                  kv_heads: int) -> torch.Tensor:
    """`summed` scoring: relevance logits [kv_heads, N] of every stored token from one query per head.

    coef_t: [G, r, N] key coefficients, token axis last (G = kv_heads for per-head bases, 1 for a layer
    basis); scale_k: int8 scales [G, N] or None; q_lat: [q_heads, r] query coefficients (each head
    projected on its KV head's basis block). The query heads sharing a KV head are summed first (the
    logit of their sum is the sum of their logits), so the cost is one [N, r] pass per KV head.
    """
    rank = q_lat.shape[-1]
    q = q_lat.reshape(kv_heads, -1, rank).sum(dim=1, keepdim=True)  # [H, 1, r]
    return latent_logits(q, coef_t, scale_k, 1.0)[:, 0]


def decay_factor(half_life: float) -> float:
    """Per-query decay of the relevance aggregate: a query's weight halves every `half_life` queries."""
    return 0.5 ** (1.0 / max(half_life, 1e-6))


def update_relevance(previous: torch.Tensor | None, probs: torch.Tensor, decay: float,
                     mode: str = "max") -> torch.Tensor:
    """Aggregate per-query attention probabilities into per-KV-head relevance [H, N] (fp32).

    probs: [H, n_rep, q, N], the attention probabilities of q new queries (in order) for each query
    head of each KV group. `mode` "query": the largest probability any head of the group gave the
    token in this step's queries (no memory); "max": the same over recent queries too, each older
    query's probability decayed by `decay` per query since; "mean": an exponential moving average of
    the group-mean probability. `previous` [H, N'] is the relevance so far (N' <= N; tokens added since
    count 0). Decay is multiplicative, so a model-dtype (bf16) store never stalls it.
    """
    heads, _, q, n = probs.shape
    if mode == "query":
        return probs.amax(dim=(1, 2))
    if mode not in ("max", "mean"):
        raise ValueError(f"unknown relevance aggregation '{mode}' (query, max or mean)")
    per_query = probs.amax(dim=1) if mode == "max" else probs.mean(dim=1)  # [H, q, N]
    if q > 1:  # older queries of the chunk count less (a single query needs no weights)
        weights = decay ** torch.arange(q - 1, -1, -1, device=probs.device, dtype=torch.float32)
        per_query = per_query * weights.view(1, q, 1)
    new = per_query.amax(dim=1) if mode == "max" else per_query.sum(dim=1) * (1.0 - decay)
    if previous is None:
        return new
    old = previous.float() * decay**q
    width = old.shape[-1]
    if mode == "max":
        new[:, :width] = torch.maximum(new[:, :width], old)
    else:
        new[:, :width] += old
    return new


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


def select_tokens(scores: torch.Tensor, k: int, forced_tail: int,
                  ranked: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [H, k'] of tokens to reconstruct: the last `forced_tail` ones plus the top-k of the rest.
    `ranked` ([H, >= k] candidates in descending score, `ranked_candidates`) saves the top-k search."""
    heads, n = scores.shape
    forced_tail = min(forced_tail, n)
    candidates = n - forced_tail
    k = min(k, candidates)
    parts = []
    if k > 0:
        if ranked is not None and ranked.shape[-1] >= k:
            parts.append(ranked[:, :k])
        else:
            parts.append(torch.topk(scores[:, :candidates], k, dim=-1, sorted=False).indices)
    if forced_tail > 0:
        tail = torch.arange(candidates, n, device=scores.device)
        parts.append(tail.unsqueeze(0).expand(heads, -1))
    if not parts:
        return torch.empty(heads, 0, dtype=torch.long, device=scores.device)
    return torch.cat(parts, dim=-1)


def ranked_candidates(scores: torch.Tensor, k_max: int, forced_tail: int) -> torch.Tensor:
    """The top `k_max` tokens [G, k_max'] of [G, N] `scores`, best first, outside the last `forced_tail`
    (kept anyway): what `mass_budget` counts over and `select_tokens` then takes a prefix of."""
    candidates = scores.shape[-1] - min(forced_tail, scores.shape[-1])
    return torch.topk(scores[:, :candidates], min(k_max, candidates), dim=-1, sorted=True).indices


def mass_budget(scores: torch.Tensor, probs: torch.Tensor, k_min: int, k_max: int, forced_tail: int,
                drop: float, ranked: torch.Tensor | None = None) -> int:
    """How many stored tokens to rebuild so that no query row drops more than `drop` of its attention.

    scores: [G, N] selection scores (the top of them is what `select_tokens` keeps; -inf for tokens
    attended exactly anyway); probs: [G, R, N] the rows' estimated attention probabilities on the stored
    tokens (normalized over everything the row attends). The last `forced_tail` tokens are kept anyway.
    `ranked`: `ranked_candidates(scores, k_max, forced_tail)` when the caller has it.
    Returns the smallest top-k count, clamped to [k_min, k_max], after which every row's probability on
    the tokens left out is at most `drop`: flat attention (many tokens matter a little) gets more tokens,
    a few sharp peaks keep the fixed count. (The count is a host int: on a GPU this waits for the step's
    scores, once per layer.)
    """
    n = scores.shape[-1]
    candidates = n - min(forced_tail, n)
    k_max = min(k_max, candidates)
    if k_max <= k_min:
        return k_max
    s = scores[:, :candidates]
    p = probs[..., :candidates].float()
    # the mass that could be left out (exact tokens, scored -inf, never are), as one product: a masked copy
    # of p and a full sort cost ten times more on a CPU, and this runs in every layer of every step
    total = torch.matmul(p, torch.isfinite(s).to(p.dtype).unsqueeze(-1))  # [G, R, 1]
    top = ranked_candidates(scores, k_max, forced_tail) if ranked is None else ranked[:, :k_max]
    kept = torch.gather(p, 2, top.unsqueeze(1).expand(-1, p.shape[1], -1)).cumsum_(dim=-1)
    need = ((total - kept) > drop).sum(dim=-1) + 1  # left out is non-increasing: the first count that fits
    return int(min(max(int(need.max()), k_min), k_max))
