"""The `s4r` attention and mask functions, registered with transformers' attention interfaces.

Every cache layer of s4r hands itself to the attention function through `handoff` in its `update`
(transformers calls `cache.update` right before the attention function of the same layer). The
attention function then asks that layer to attend, so a compressed layer can pick and reconstruct the
tokens it needs from the query. Tensors that did not come from an s4r layer get plain causal attention.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

ATTN_NAME = "s4r"
_active = threading.local()


def handoff(layer, keys: torch.Tensor) -> None:
    """Record that `layer` just returned `keys` from its update (same thread, same forward)."""
    _active.layer = layer
    _active.keys = keys


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     prefix: int | None = None) -> torch.Tensor:
    """SDPA where the last `q` keys are the queries' own tokens (bottom-right causal alignment).

    `prefix` keys before the causal part are visible to every query (defaults to all older keys).
    query [B, Hq, q, d]; key/value [B, H, S, d] with H dividing Hq. Returns [B, Hq, q, d].
    """
    q_len, s_len = query.shape[-2], key.shape[-2]
    mask = None
    if q_len > 1:
        prefix = s_len - q_len if prefix is None else prefix
        q_idx = torch.arange(q_len, device=query.device).unsqueeze(1)
        k_idx = torch.arange(s_len - prefix, device=query.device).unsqueeze(0)
        own = k_idx <= q_idx + (s_len - prefix - q_len)
        mask = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=query.device), own], dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                          enable_gqa=key.shape[1] != query.shape[1])


def s4r_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: delegate to the s4r layer that produced `key`, else causal SDPA."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = getattr(_active, "layer", None)
    if layer is not None and getattr(_active, "keys", None) is key:
        out = layer.attend(query, key, value, scaling)
    else:
        out = causal_attention(query, key, value, scaling)
    _active.layer = _active.keys = None
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
