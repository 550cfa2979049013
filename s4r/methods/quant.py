"""`quant`: integer KV quantization (KIVI-style), what llama.cpp / ollama users turn on (q8_0, q4_0).

The bit width follows from the ratio: the widest of 8, 4 and 2 bits (and, for it, the smallest key
group of 32, 64 or 128 tokens) whose bytes - codes, every scale and zero point, and the full-precision
residual with a full reserve of new tokens counted as in S4R's solver - stay within 1/ratio of the full
cache. At ratio 2.5 that is int4, at ratio 5 int2 (llama.cpp's q4_0 is about 3.6x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from s4r.core.budget import KVShape
from s4r.core.quantize import PACKABLE_BITS, quant_bytes_per_token
from s4r.errors import BudgetError
from s4r.hf.cache import CompressedCache
from s4r.layers.full import staged_tensors
from s4r.layers.quant import QuantLayer
from s4r.methods.base import CompressContext, OwnSettings

KEY_GROUPS: tuple[int, ...] = (32, 64, 128)


@dataclass(frozen=True)
class QuantPlan:
    """Bit width and groups chosen for a ratio, and the bytes they imply at the planning length."""

    bits: int
    key_group: int
    value_group: int
    planned_bytes: float
    full_bytes: int


def value_groups_for(head_dim: int) -> list[int]:
    """Values are grouped along channels: the groups of KEY_GROUPS that divide the head dim, and the
    whole head."""
    return sorted({g for g in KEY_GROUPS if g <= head_dim and head_dim % g == 0} | {head_dim})


def quant_layer_bytes(shape: KVShape, tokens: int, bits: int, key_group: int, value_group: int,
                      reserve: int) -> float:
    """Bytes of one quantized layer of `tokens` tokens with a full reserve of new full-precision ones."""
    quantized = tokens // key_group * key_group
    per_token = quant_bytes_per_token(shape.kv_heads, shape.head_dim, bits, key_group, value_group)
    residual = tokens - quantized + max(reserve, key_group)
    return quantized * per_token + residual * shape.full_bytes_per_token()


def plan_quant(shape: KVShape, tokens: int, ratio: float, reserve: int) -> QuantPlan:
    """The widest packable bit width within 1/ratio of the full cache; for it, the key and value groups
    that use the budget best (smaller groups: finer scales, more bytes)."""
    full = shape.full_bytes(tokens)
    for bits in PACKABLE_BITS:
        if bits >= 8 * shape.dtype_bytes:
            continue  # not smaller than the model's own dtype
        fits = []
        for key_group in KEY_GROUPS:
            for value_group in value_groups_for(shape.head_dim):
                used = quant_layer_bytes(shape, tokens, bits, key_group, value_group, reserve) * shape.layers
                if used <= full / ratio:
                    fits.append(QuantPlan(bits, key_group, value_group, used, full))
        if fits:
            return max(fits, key=lambda p: (p.planned_bytes, -p.key_group))
    raise BudgetError(f"ratio {ratio:g} is not reachable for {tokens} tokens by {min(PACKABLE_BITS)}-bit "
                      "quantization (use a lower --ratio or a longer document)")


@dataclass
class QuantMethod(OwnSettings):
    """Quantize every layer with the plan's bit width; `reserve` new tokens stay in full precision (the
    `buffer_tokens` override sets it, as for S4R's buffer)."""

    ALIASES: ClassVar[dict[str, str]] = {"buffer_tokens": "reserve"}

    name: str = "quant"
    # each layer is quantized alone, so a layer-wise ingest can compress it as soon as it is complete
    layerwise: ClassVar[bool] = True
    query_window: int = 0
    reserve: int = 64
    ratio: float | None = None

    def max_ratio(self, shape: KVShape, tokens: int) -> float:
        """The best ratio for a `tokens`-long prompt: the narrowest width and largest groups."""
        bits, key_group = min(PACKABLE_BITS), max(KEY_GROUPS)
        used = quant_layer_bytes(shape, tokens, bits, key_group, max(value_groups_for(shape.head_dim)),
                                 self.reserve)
        return shape.full_bytes_per_token() * tokens / used

    def compress(self, cache: CompressedCache, ctx: CompressContext) -> dict:
        plan = plan_quant(cache.shape, cache.logical_length(), self.ratio or ctx.ratio, self.reserve)

        def build(i: int, layer) -> QuantLayer:
            keys, values, _ = staged_tensors(layer)
            return QuantLayer(keys, values, bits=plan.bits, key_group=plan.key_group,
                              value_group=plan.value_group, reserve=self.reserve)

        cache.compress(build)
        return {"bits": plan.bits, "key_group": plan.key_group, "value_group": plan.value_group,
                "reserve": self.reserve}

