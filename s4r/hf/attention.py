"""The `s4r` attention and mask functions, registered with transformers' attention interfaces.

Every cache layer of s4r hands itself to the attention function through `handoff` in its `update`
(transformers calls `cache.update` right before the attention function of the same layer). The
attention function then asks that layer to attend, so a compressed layer can pick and reconstruct the
tokens it needs from the query. The hand-off exists because transformers gives the attention function
no handle on the cache. When it misses (another attention implementation ran, or a wrapper changed the
keys), plain attention over the keys `update` returned is only exact for a layer that returns all its
keys (`exact_fallback`); for a compressed layer that is just the recent buffer, so it is an error.
Keys no s4r layer handed off (a forward without an s4r cache) get plain causal attention.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from s4r.errors import S4RError
from s4r.kernels.jit import native_bf16

ATTN_NAME = "s4r"
_active = threading.local()
_buffers = threading.local()

# On CPU, queries up to this length fold the query heads of a KV group into the query axis. SDPA with
# `enable_gqa` takes a slow path on CPU for short queries (7x slower for one token in bf16); long
# chunks (prefill) run as fast either way, and folding them would multiply the mask by the group size.
# Not on CUDA: its kernels run one block per head and query block, so folding a decode step's query
# heads into one row block per KV head leaves most of the GPU idle (BENCHMARKS.md, GPU run).
FOLD_MAX_QUERY = 16
# Folded bf16 steps over at least this many keys run as two matrix products per head around an fp32
# softmax (transformers' eager arithmetic) instead of SDPA: oneDNN's bf16 products are about 4x its fp32
# ones on a CPU with AVX512-BF16. Per layer they beat SDPA from about 2k keys and lose below, and a whole
# decode step (with the per-head products' dispatch) gains only from about 3k, hence the threshold.
# fp32 and fp16 gain nothing, so they stay on SDPA.
MATMUL_MIN_KEYS = 3072
# oneDNN builds a bf16 product's kernel per shape (0.4-0.6 ms, more than the product at a few thousand
# keys), and a decode step's key count grows by one: a cache hands over its spare rows up to a multiple
# of this (`room`), attended with the extra keys masked, so one shape serves many steps
KEY_BUCKET = 256
# Longer bf16 query blocks (prefill, a question's prompt) on a CPU with native bf16 products run as two
# bf16 products per KV head around a bf16 softmax (fp32 inside), transformers' eager arithmetic: 1.6-1.8x
# SDPA's CPU kernel there (BENCHMARKS.md, "Prefill attention"). A product's logits are kept under this many
# elements (32 MiB), the block's query positions taken a chunk at a time beyond it.
BLOCK_LOGITS = 1 << 24


def handoff(layer, keys: torch.Tensor) -> None:
    """Record that `layer` just returned `keys` from its update (same thread, same forward)."""
    _active.layer = layer
    _active.keys = keys


def _missed(layer) -> S4RError:
    return S4RError(
        f"s4r attention did not get the keys its {type(layer).__name__} returned (another attention "
        "implementation ran, or a wrapper changed the keys): those keys are only the layer's exact part, "
        "so plain attention over them would silently leave out the compressed document")


def ensure_handoff_taken() -> None:
    """After a forward: raise S4RError if its last layer handed off keys that no s4r attention took (the
    model runs another attention implementation, which for a compressed layer means without its
    document); a layer whose plain attention is exact (`exact_fallback`) is let go."""
    layer = getattr(_active, "layer", None)
    _active.layer = _active.keys = None
    if layer is not None and not getattr(layer, "exact_fallback", False):
        raise _missed(layer)


def drop_handoff() -> None:
    """Forget a pending hand-off (a forward that stopped between a cache update and its attention)."""
    _active.layer = _active.keys = None


def causal_mask(q_len: int, s_len: int, prefix: int | None = None,
                device: torch.device | None = None) -> torch.Tensor | None:
    """Boolean mask [q_len, s_len] (True = visible) where the last `q_len` keys are the queries' own
    tokens (bottom-right causal alignment) and the first `prefix` keys are visible to every query
    (defaults to all keys before the queries' own). None when every key is visible (one query)."""
    if q_len <= 1:
        return None
    prefix = s_len - q_len if prefix is None else prefix
    own = causal_part(q_len, s_len, prefix, device)
    return torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=device), own], dim=1)


def causal_part(q_len: int, s_len: int, prefix: int, device: torch.device | None = None) -> torch.Tensor:
    """`causal_mask`'s columns from `prefix` on [q_len, s_len - prefix]: the keys some query may not see."""
    q_idx = torch.arange(q_len, device=device).unsqueeze(1)
    k_idx = torch.arange(s_len - prefix, device=device).unsqueeze(0)
    return k_idx <= q_idx + (s_len - prefix - q_len)


def additive_causal_mask(q_len: int, s_len: int, prefix: int | None, dtype: torch.dtype,
                         device: torch.device | None = None) -> torch.Tensor | None:
    """`causal_mask` as the additive mask SDPA makes of a boolean one (0 visible, -inf hidden), so the
    same attention; built directly, a long prefill block holds one [q_len, s_len] mask instead of the
    boolean mask, its parts and SDPA's converted copy (31 -> 19 MiB for 256 queries on 32k keys, bf16)."""
    if q_len <= 1:
        return None
    prefix = s_len - q_len if prefix is None else prefix
    mask = torch.zeros((q_len, s_len), dtype=dtype, device=device)
    # the queries' own tokens: query i sees own token c <= i (a q_len x q_len triangle, not a full copy)
    own = torch.full((q_len, min(q_len, s_len)), float("-inf"), dtype=dtype, device=device)
    mask[:, s_len - own.shape[1] :] = own.triu_(1 + own.shape[1] - q_len)
    mask[:, :prefix] = 0
    return mask


def fold_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, q, d] -> [B, H, (Hq/H)*q, d]: the query heads sharing a KV head as extra query rows
    (row j*q + i is head j of the group at query position i)."""
    b, hq, q, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * q, d)


def unfold_heads(out: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Inverse of `fold_heads`: [B, H, (Hq/H)*q, d] -> [B, Hq, q, d]."""
    b, _, rows, d = out.shape
    return out.reshape(b, q_heads, rows * out.shape[1] // q_heads, d)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     prefix: int | None = None, sdpa_only: bool = False,
                     room: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Exact SDPA where the last `q` keys are the queries' own tokens (bottom-right causal alignment).

    `prefix` keys before the causal part are visible to every query (defaults to all older keys).
    query [B, Hq, q, d]; key/value [B, H, S, d] with H dividing Hq. Returns [B, Hq, q, d].
    On CPU, short queries of grouped heads run folded (see FOLD_MAX_QUERY): one [group*q, S] problem
    per KV head, the same arithmetic as `enable_gqa` without its slow path; in bf16 over many keys as
    two matrix products (`matmul_attention`, see MATMUL_MIN_KEYS); longer bf16 blocks where bf16 products are
    native through `block_attention` (see BLOCK_LOGITS); SDPA alone with `sdpa_only` (the full cache
    through SDPA, a reference row of the speed table). `room`: key and value views that extend `key` and
    `value` with finite rows (a cache's spare capacity up to a KEY_BUCKET boundary); the products then
    run over them with the extra keys masked, the same attention.
    """
    q_heads, q_len, s_len = query.shape[1], query.shape[-2], key.shape[-2]
    kv_heads = key.shape[1]
    if q_len > FOLD_MAX_QUERY and bf16_products(query) and not sdpa_only:
        return block_attention(query, key, value, scaling, prefix)
    if kv_heads == q_heads or q_len > FOLD_MAX_QUERY or query.device.type != "cpu":
        mask = additive_causal_mask(q_len, s_len, prefix, query.dtype, query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                              enable_gqa=kv_heads != q_heads)
    mask = causal_mask(q_len, s_len, prefix, query.device)
    if mask is not None:
        mask = mask.repeat(q_heads // kv_heads, 1)  # row j*q + i is query position i
    folded = fold_heads(query, kv_heads)
    if query.dtype == torch.bfloat16 and s_len >= MATMUL_MIN_KEYS and not sdpa_only:
        if room is not None:
            key, value = room
        out = matmul_attention(folded, key, value, scaling, mask, valid=s_len)
    else:
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return unfold_heads(out, q_heads)


def bf16_products(query: torch.Tensor) -> bool:
    """Whether `query` is bf16 on a CPU whose bf16 matrix products are native (`jit.native_bf16`)."""
    return query.dtype == torch.bfloat16 and query.device.type == "cpu" and native_bf16()


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                    prefix: int | None = None) -> torch.Tensor:
    """`causal_attention` of a long bf16 query block as transformers' eager attention computes it, per KV
    head: the group's query rows (scaled) times the keys in bf16, the block's own keys masked causally, a
    softmax in fp32 rounded to bf16, times the values. query [B, Hq, q, d]; key/value [B, H, S, d]."""
    b, q_heads, q_len, d = query.shape
    kv_heads, s_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    prefix = s_len - q_len if prefix is None else prefix
    hidden = ~causal_part(q_len, s_len, prefix, query.device)  # [q, S - prefix]
    scaled = (query.float() * scaling).to(query.dtype)
    out = torch.empty_like(query)
    step = max(1, BLOCK_LOGITS // (group * max(s_len, 1)))
    logits, probs = _logit_buffers(group * min(step, q_len) * s_len, query.dtype)
    for i in range(b):
        for h in range(kv_heads):
            heads = slice(h * group, (h + 1) * group)
            keys_t, values = key[i, h].T, value[i, h]
            for p0 in range(0, q_len, step):
                p1 = min(q_len, p0 + step)
                rows = group * (p1 - p0)
                lg, pr = logits[: rows * s_len].view(rows, s_len), probs[: rows * s_len].view(rows, s_len)
                torch.matmul(scaled[i, heads, p0:p1].reshape(rows, d), keys_t, out=lg)
                lg.view(group, p1 - p0, s_len)[..., prefix:].masked_fill_(hidden[p0:p1], float("-inf"))
                torch.ops.aten._softmax.out(lg, -1, False, out=pr)
                out[i, heads, p0:p1] = torch.matmul(pr, values).view(group, p1 - p0, d)
    return out


def _logit_buffers(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat buffers of at least `size` elements, kept per thread: fresh ones of many MiB cost a page
    fault per 4 KiB at their first write, as much again as the products that fill them."""
    kept = getattr(_buffers, "logits", None)
    if kept is None or kept[0].numel() < size or kept[0].dtype != dtype:
        with torch.inference_mode(False):  # written with `out=` outside inference mode too
            kept = _buffers.logits = (torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype))
    return kept


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     mask: torch.Tensor | None = None, valid: int | None = None) -> torch.Tensor:
    """Exact attention as transformers' eager path computes it: logits in the inputs' dtype (fp32
    accumulation), softmax in fp32, probabilities back in the inputs' dtype times the values.
    query [B, H, M, d], key/value [B, H, S, d] (one KV head per query row block), mask [M, valid]
    boolean (True = visible) or None; keys from `valid` on (default S) are padding, masked out (their
    values must be finite). Returns [B, H, M, d].

    One 2-D product per head: a cache's keys are a view of a larger buffer, and a batched product over
    such a view copies it first (slower than SDPA at 7.6k keys; per head: 1.6x faster)."""
    b, h, m, _ = query.shape
    logits = query.new_empty(b, h, m, key.shape[-2])
    for i in range(b):
        for j in range(h):
            torch.matmul(query[i, j], key[i, j].T, out=logits[i, j])
    logits = logits.float().mul_(scaling)
    valid = key.shape[-2] if valid is None else valid
    if mask is not None:
        logits[..., :valid].masked_fill_(~mask, float("-inf"))
    logits[..., valid:] = float("-inf")
    probs = torch.softmax(logits, dim=-1).to(value.dtype)
    out = query.new_empty(b, h, m, value.shape[-1])
    for i in range(b):
        for j in range(h):
            torch.matmul(probs[i, j], value[i, j], out=out[i, j])
    return out


class _Plain:
    """Marks keys handed off by a plain transformers cache (see `handoff_plain`)."""

    exact_fallback = True  # a plain cache returns all its keys


PLAIN = _Plain()


def handoff_plain(keys: torch.Tensor) -> None:
    """Record that a plain transformers cache returned `keys`: its layer runs transformers' own sdpa
    attention (K/V repeated per query head), the speed benchmark's reference row."""
    handoff(PLAIN, keys)


def s4r_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: delegate to the s4r layer that produced `key`, else causal SDPA."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = getattr(_active, "layer", None)
    if layer is PLAIN and getattr(_active, "keys", None) is key:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _active.layer = _active.keys = None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    handed = getattr(_active, "keys", None) is key
    _active.layer = _active.keys = None
    if layer is not None and handed:
        out = layer.attend(query, key, value, scaling)
    elif layer is None or getattr(layer, "exact_fallback", False):
        out = causal_attention(query, key, value, scaling)
    else:
        raise _missed(layer)
    return out.transpose(1, 2).contiguous(), None


def s4r_mask(*args, **kwargs):
    """Mask function for the `s4r` implementation: no dense mask is built.

    A compressed layer's stored length differs from its logical length and its attended set changes
    every step, so the attention function builds the (bottom-right causal) structure it needs itself.
    """
    return None


def install(model) -> None:
    """Register the s4r attention/mask functions and switch `model` to them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, s4r_attention)
    AttentionMaskInterface.register(ATTN_NAME, s4r_mask)
    if getattr(model.config, "_attn_implementation", None) == ATTN_NAME:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:  # pragma: no cover - older 5.x
        model.config._attn_implementation = ATTN_NAME
