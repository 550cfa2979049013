"""Shared test helpers: tiny random models and a character-level stand-in tokenizer (books: s4r.books)."""

from __future__ import annotations

from typing import Any

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# Small but with real GQA (4 query heads share 2 kv heads) so cache code sees the grouped layout.
_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False, "sliding_window": None},
    # transformers' MistralConfig defaults to a 4096 sliding window; the models we target have none.
    "mistral": {"sliding_window": None},
}


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A tiny seeded random causal LM of ``arch`` (llama, qwen2, qwen3, mistral) in eval mode.

    ``overrides`` replace config values (e.g. ``num_hidden_layers=3``); ``seed`` (default 0) and
    ``attn_implementation`` are taken out and used for building. The global RNG state is left untouched.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _PER_ARCH:
        raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(ARCHS)}")
    seed = int(overrides.pop("seed", 0))
    build_kwargs: dict[str, Any] = {"dtype": dtype}
    if "attn_implementation" in overrides:
        build_kwargs["attn_implementation"] = overrides.pop("attn_implementation")
    config = AutoConfig.for_model(arch, **{**_BASE, **_PER_ARCH[arch], **overrides})
    # fork_rng keeps callers' random streams unchanged, so tests stay independent of build order.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **build_kwargs)
    return model.eval()


class CharTokenizer:
    """A character-level stand-in tokenizer for the tiny models' 128-token vocabulary."""

    eos_token_id = 2
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 125 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i % 95) for i in ids)


def failing_kernel(monkeypatch: Any, module: Any, name: str) -> list[int]:
    """Replace the kernel `module.name` by one that raises as a kernel that cannot compile would, with the
    fused kernels' failure state reset (and its one log line taken as said); the returned list gets an
    entry per call."""
    from s4r.kernels import jit

    monkeypatch.setitem(jit._state, "failed", False)
    monkeypatch.setitem(jit._state, "warned", True)
    calls: list[int] = []

    def broken(*args: Any) -> None:
        calls.append(1)
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(module, name, broken)
    return calls


def counted_kernel(monkeypatch: Any, module: Any, name: str) -> list[int]:
    """Wrap the kernel `module.name` so that the returned list gets an entry per call."""
    calls: list[int] = []
    kernel = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or kernel(*a))
    return calls
