"""Shared test helpers: tiny random models and the shared books folder."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BOOKS = REPO.parent / "shared" / "data" / "books"

_ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random GQA causal LM (4 query heads over 2 KV heads), seeded, in eval mode."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in _ARCH[arch])
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=8192,
                    initializer_range=0.1)
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**settings)).to(dtype).eval()
    return model
