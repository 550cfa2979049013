"""The tensor arithmetic of a lean decode step: what runs between two attention calls, as plain functions
of tensors (no module, no cache), so they can be compiled as they are.

A layer's work outside attention is split at the attention call: `attention_inputs` (norm, one fused q/k/v
product, per-head q/k norms, RoPE) and `layer_output` (output projection, residual, norm, one fused
gate/up product, SiLU, down projection, residual). `between_layers` is one layer's `layer_output` followed
by the next layer's `attention_inputs`, so a step makes one call between two attention calls. The
arithmetic follows transformers' Llama/Qwen3 modules: RMSNorm in fp32, the weight applied in the
activations' dtype; products in the weights' dtype (`linear`), the result back in the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from s4r.kernels.bf16_matvec import MatvecWeight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalized in fp32, back to `x`'s dtype, then times `weight`."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | MatvecWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` with the product in `weight`'s dtype and the result in `x`'s; a
    `MatvecWeight` (bf16) takes one row by its own kernel."""
    if isinstance(weight, MatvecWeight):
        out = weight.product(x).to(x.dtype)
    else:
        out = F.linear(x.to(weight.dtype), weight).to(x.dtype)
    return out if bias is None else out + bias


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary `cos`/`sin` [B, q, head_dim] as `rope` takes them: a head axis added and the
    first half of `sin` negated, so that `x * cos + rotate_half(x) * sin` (transformers' convention) is
    `x * cos + roll(x, half) * sin_signed`, the same products in two operations fewer."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(2), signed.unsqueeze(2)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE of `x` [B, q, heads, head_dim] with `rope_tables`' tables (a product and a sum, not a fused
    multiply-add: the same roundings as transformers' RoPE, so the keys a cache stores are the same)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def attention_inputs(h: torch.Tensor, norm_w: torch.Tensor, eps: float, w_qkv: torch.Tensor | MatvecWeight,
                     b_qkv: torch.Tensor | None, qk_norm: torch.Tensor | None, cos: torch.Tensor,
                     sin_signed: torch.Tensor, q_heads: int, kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys, values [B, heads, q, head_dim] of hidden states `h` [B, q, hidden], as the model's
    attention module hands them to `cache.update` and the attention function (RoPE applied).

    `w_qkv` is the q, k and v projections stacked in that order along the output axis; `qk_norm` the
    per-head RMSNorm weights of the query heads then the key heads [q_heads + kv_heads, head_dim] (Qwen3)
    or None; queries and keys are normed and rotated together. `cos`/`sin_signed` from `rope_tables`."""
    b, q, _ = h.shape
    qkv = linear(rms_norm(h, norm_w, eps), w_qkv, b_qkv)
    nqk = (q_heads + kv_heads) * head_dim
    qk = qkv[..., :nqk].reshape(b, q, q_heads + kv_heads, head_dim)
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, eps)
    qk = rope(qk, cos, sin_signed)
    query = qk[:, :, :q_heads].transpose(1, 2)
    key = qk[:, :, q_heads:].transpose(1, 2)
    value = qkv[..., nqk:].reshape(b, q, kv_heads, head_dim).transpose(1, 2)
    return query, key, value


def layer_output(h: torch.Tensor, attn: torch.Tensor, w_o: torch.Tensor | MatvecWeight,
                 b_o: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                 w_gate_up: torch.Tensor | MatvecWeight, b_gate_up: torch.Tensor | None,
                 w_down: torch.Tensor | MatvecWeight, b_down: torch.Tensor | None) -> torch.Tensor:
    """The layer's output hidden states from its input `h` [B, q, hidden] and the attention function's
    output `attn` [B, q, heads, head_dim]: output projection and residual, then the gated SiLU MLP
    (`w_gate_up`: gate and up projections stacked in that order) and its residual."""
    h = h + linear(attn.reshape(*h.shape[:-1], -1), w_o, b_o)
    x = rms_norm(h, norm_w, eps)
    gate_up = linear(x, w_gate_up, b_gate_up)
    inter = gate_up.shape[-1] // 2
    return h + linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:], w_down, b_down)


def between_layers(h: torch.Tensor, attn: torch.Tensor, out_args: tuple, in_args: tuple,
                   cos: torch.Tensor, sin_signed: torch.Tensor, q_heads: int, kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer_output(h, attn, *out_args)` and the next layer's `attention_inputs` of it, in one call:
    (hidden states, queries, keys, values)."""
    h = layer_output(h, attn, *out_args)
    query, key, value = attention_inputs(h, *in_args, cos, sin_signed, q_heads, kv_heads, head_dim)
    return h, query, key, value


def final_logits(h: torch.Tensor, attn: torch.Tensor, out_args: tuple, norm_w: torch.Tensor, eps: float,
                 lm_head: torch.Tensor | MatvecWeight) -> torch.Tensor:
    """The last layer's `layer_output`, the final norm and the LM head over the last position: logits
    [B, 1, vocab] in the activations' dtype."""
    h = layer_output(h, attn, *out_args)
    return linear(rms_norm(h[:, -1:], norm_w, eps), lm_head)
