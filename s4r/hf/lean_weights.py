"""The weights of a lean decode step: each layer's q/k/v and gate/up projections stacked into one matrix,
in the dtype a one-token product reads fastest, and which models the lean step can run at all."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from s4r.kernels.bf16_matvec import matvec_weights

# Decoder families whose layers are transformers' Llama layout: RMSNorm (fp32 statistics, weight times
# the normalized input), q/k/v/o projections with RoPE, optional per-head q/k RMSNorm (Qwen3), and a gated
# SiLU MLP. Other families fall back to the model's own forward.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


@dataclass
class LayerWeights:
    """One decoder layer's tensors in the order `lean_ops` takes them."""

    norm_in: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    qk_norm: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    norm_post: torch.Tensor
    w_gate_up: torch.Tensor
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None

    def input_args(self, eps: float) -> tuple:
        """The arguments of `lean_ops.attention_inputs` after `h` and before `cos`."""
        return (self.norm_in, eps, self.w_qkv, self.b_qkv, self.qk_norm)

    def with_matvec(self) -> LayerWeights:
        """The same layer with its matrices as `bf16_matvec.MatvecWeight`s where that product runs."""
        w_qkv, w_o, w_gate_up, w_down = matvec_weights([self.w_qkv, self.w_o, self.w_gate_up, self.w_down])
        return replace(self, w_qkv=w_qkv, w_o=w_o, w_gate_up=w_gate_up, w_down=w_down)

    def output_args(self, eps: float) -> tuple:
        """The arguments of `lean_ops.layer_output` after `h` and `attn`."""
        return (self.w_o, self.b_o, self.norm_post, eps, self.w_gate_up, self.b_gate_up, self.w_down,
                self.b_down)


def unsupported_reason(model) -> str | None:
    """Why the lean step cannot run `model` (None when it can): its family, activation or layout."""
    config = model.config
    if getattr(config, "model_type", None) not in FAMILIES:
        return f"model type '{getattr(config, 'model_type', None)}' is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation '{config.hidden_act}' is not silu"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
        return "no model.layers / rotary_emb / norm"
    if len({p.device for p in model.parameters()}) > 1:
        return "weights on more than one device"
    if any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in model.parameters()):
        return "weights sharded over ranks (tensor parallel)"

    def plain(module, names) -> bool:  # exactly nn.Linear: quantized linears subclass it
        return all(type(getattr(module, n, None)) is torch.nn.Linear
                   and getattr(module, n).weight.dtype.is_floating_point for n in names)

    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not plain(attn, ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer without plain q/k/v/o projections (quantized weights?)"
        if not plain(mlp, ("gate_proj", "up_proj", "down_proj")):
            return "a layer without a plain gated MLP"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, inner.norm]
        norms += [m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None]
        if any(type(n).__name__ not in RMS_NORMS for n in norms):
            return "a norm that is not the Llama-style RMSNorm"
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            return "a query norm without a key norm (or the reverse)"
        if len({float(n.variance_epsilon) for n in norms}) != 1:
            return "norms with different epsilons"
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return "no plain LM head"
    return None


# A one-token product reads each weight once: from memory it is bound by the bytes, and bf16 halves them
# (576x1536 on an AVX2 CPU, one thread, weights out of cache: 0.31 ms bf16 against 0.62 ms fp32; the
# 49,152x576 LM head 13.4 ms against 27.7 ms). Weights that stay in the caches are read faster in fp32
# (the same product in cache: 0.12 ms fp32, 0.22 ms bf16), so small models keep their dtype.
BF16_MIN_BYTES = 64 * 2**20


def decode_weight_dtype(model_dtype: torch.dtype, device: torch.device, weight_bytes: int) -> torch.dtype:
    """The dtype of the lean step's matrices: on a CPU, bf16 copies of an fp32 model's matrices when they
    weigh at least BF16_MIN_BYTES in fp32; otherwise the model's own dtype."""
    if device.type == "cpu" and model_dtype == torch.float32 and weight_bytes >= BF16_MIN_BYTES:
        return torch.bfloat16
    return model_dtype


def matrix_bytes(model) -> int:
    """Bytes of the matrices a decode step reads: every decoder layer's linears and the LM head."""
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    tensors = [m.weight for m in linears] + [model.get_output_embeddings().weight]
    return sum(t.numel() * t.element_size() for t in tensors)


def _stack(linears: list[torch.nn.Linear], dtype: torch.dtype, share: bool) -> tuple[torch.Tensor,
                                                                                      torch.Tensor | None]:
    """The linears' weights stacked along the output axis in `dtype` (and their biases, in the
    activations' dtype, None when they have none). With `share` (same dtype) the modules' weights are
    re-pointed to row blocks of the stack, so the model's own forward reads the same storage and no
    second copy is kept."""
    weight = torch.cat([m.weight.detach() for m in linears]).to(dtype)
    if share:
        start = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight.data = weight[start : start + rows]
            start += rows
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                      for b, m in zip(biases, linears, strict=True)])
    return weight, bias


def pack_layers(model, dtype: torch.dtype) -> tuple[list[LayerWeights], torch.Tensor]:
    """Every layer's `LayerWeights` and the LM head matrix, products in `dtype`."""
    layers = []
    act_dtype = model.model.embed_tokens.weight.dtype
    share = dtype == act_dtype
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w_qkv, b_qkv = _stack([attn.q_proj, attn.k_proj, attn.v_proj], dtype, share)
        w_o, b_o = _stack([attn.o_proj], dtype, share)
        w_gu, b_gu = _stack([mlp.gate_proj, mlp.up_proj], dtype, share)
        w_down, b_down = _stack([mlp.down_proj], dtype, share)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        qk_norm = None
        if q_norm is not None and k_norm is not None:
            # one weight row per query head, then per key head: the two norms as one over the stacked heads
            heads_q = attn.q_proj.out_features // q_norm.weight.shape[0]
            heads_k = attn.k_proj.out_features // k_norm.weight.shape[0]
            qk_norm = torch.cat([q_norm.weight.detach().expand(heads_q, -1),
                                 k_norm.weight.detach().expand(heads_k, -1)])
        layers.append(LayerWeights(
            norm_in=layer.input_layernorm.weight.detach(), w_qkv=w_qkv, b_qkv=b_qkv,
            qk_norm=qk_norm,
            w_o=w_o, b_o=b_o, norm_post=layer.post_attention_layernorm.weight.detach(),
            w_gate_up=w_gu, b_gate_up=b_gu, w_down=w_down, b_down=b_down))
    head = model.get_output_embeddings().weight.detach()
    return layers, head if head.dtype == dtype else head.to(dtype)
