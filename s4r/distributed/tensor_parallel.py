"""Tensor parallelism by attention head through transformers' own plan (``tp_plan="auto"``).

Each rank holds its slice of every sharded projection: ``k_proj``/``v_proj`` column-wise, so a rank's
attention sees only its KV heads, and ``o_proj`` row-wise, whose all-reduce puts the heads back together.
The compressed cache follows from that: each rank's cache layers are given its own heads' keys and values,
so it compresses, scores and rebuilds those alone, with bases (per head, or per layer over the rank's
heads) of its own. Nothing here moves data between ranks; the model's sharded layers do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from s4r.core.budget import KVShape
from s4r.errors import DeviceError


def text_config(config: Any) -> Any:
    """The text part of a (possibly multimodal) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_counts(config: Any) -> tuple[int, int]:
    """(KV heads, query heads) of a model config."""
    cfg = text_config(config)
    q_heads = int(cfg.num_attention_heads)
    return int(getattr(cfg, "num_key_value_heads", None) or q_heads), q_heads


def divisors(n: int) -> list[int]:
    """The rank counts that split `n` heads evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_ranks(config: Any, ranks: int, name: str = "the model") -> None:
    """Refuse a rank count that does not split the KV heads (and query heads) evenly, in one line."""
    kv_heads, q_heads = head_counts(config)
    if kv_heads % ranks or q_heads % ranks:
        choices = ", ".join(str(d) for d in divisors(kv_heads) if q_heads % d == 0)
        raise DeviceError(f"{ranks} ranks do not divide the {kv_heads} KV heads of {name}: tensor "
                          f"parallelism gives each rank whole KV heads; run with {choices} ranks")


def distributed_config(ranks: int) -> Any:
    """transformers' `DistributedConfig` for the model's own tensor-parallel plan over `ranks` ranks."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_plan="auto", tp_size=ranks)


def shard_built(model: Any, ranks: int) -> Any:
    """Apply the tensor-parallel plan to a model already built whole on every rank (random weights: every
    rank built the same seeded weights, and each keeps its own slice of them)."""
    cfg, _, mesh = type(model).prepare_distribute_model(distributed_config(ranks))
    return type(model).maybe_distribute_model(model, cfg, mesh)


def tensor_parallel_size(model: Any) -> int:
    """Ranks the model's heads are split over (1 when not tensor parallel)."""
    return int(getattr(model, "_tp_size", 1) or 1) if getattr(model, "_device_mesh", None) is not None else 1


def _local_rows(linear: Any) -> int:
    weight = linear.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return int(local.shape[0])


def rank_kv_shape(shape: KVShape, model: Any) -> KVShape:
    """The KV shape this rank's cache holds: the heads of its slice of ``k_proj`` and ``q_proj``
    (the whole shape when the model is not split)."""
    if tensor_parallel_size(model) == 1:
        return shape
    attn = _first_attention(model)
    if attn is None or not hasattr(attn, "k_proj") or not hasattr(attn, "q_proj"):
        return replace(shape, kv_heads=shape.kv_heads // tensor_parallel_size(model),
                       q_heads=shape.q_heads // tensor_parallel_size(model))
    return replace(shape, kv_heads=_local_rows(attn.k_proj) // shape.head_dim,
                   q_heads=_local_rows(attn.q_proj) // shape.head_dim)


def _first_attention(model: Any) -> Any:
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            return module
    return None
