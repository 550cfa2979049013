"""`QuantLayer`: one layer of an integer-quantized KV cache (KIVI-style), with a full-precision residual.

Keys are quantized per channel in groups of `key_group` consecutive tokens, values per token in groups
of `value_group` channels; the most recent tokens (fewer than a key group, plus up to `reserve` new
ones) stay in the model's dtype until a whole group can be quantized. Attention dequantizes everything
and is otherwise exact.
"""

from __future__ import annotations

from typing import Any

import torch

from s4r.core.quantize import Quantized, dequantize_groups, quantize_groups
from s4r.hf.attention import causal_attention, handoff
from s4r.layers.full import CacheLayer, tensor_bytes


def _cat(a: Quantized | None, b: Quantized) -> Quantized:
    if a is None:
        return b
    return Quantized(torch.cat([a.packed, b.packed], dim=1), torch.cat([a.scale, b.scale], dim=1),
                     torch.cat([a.zero, b.zero], dim=1), b.bits)


class QuantLayer(CacheLayer):
    """Quantized keys/values of the oldest tokens (a multiple of `key_group`), then full-precision ones."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, *, bits: int, key_group: int,
                 value_group: int, reserve: int) -> None:
        """keys/values: [H, T, d] post-RoPE tokens of the prompt (positions 0..T-1)."""
        super().__init__()
        self.bits, self.key_group, self.value_group = bits, key_group, value_group
        self.reserve = max(reserve, key_group)
        self.dtype = keys.dtype
        self.q_k: Quantized | None = None
        self.q_v: Quantized | None = None
        self.quantized = 0
        self.res_k, self.res_v = keys[:, :0].clone(), values[:, :0].clone()
        self._append(keys, values)
        # the prompt itself is quantized down to less than a group, whatever the reserve
        self._fold(self.res_k.shape[1] // key_group * key_group)

    # --- storage ----------------------------------------------------------------------------------
    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.res_k = torch.cat([self.res_k, keys], dim=1)
        self.res_v = torch.cat([self.res_v, values], dim=1)
        self.logical += keys.shape[1]

    def _fold(self, n: int) -> None:
        """Quantize the oldest `n` residual tokens (a multiple of `key_group`)."""
        if n <= 0:
            return
        k, v = self.res_k[:, :n], self.res_v[:, :n]
        self.q_k = _cat(self.q_k, quantize_groups(k, self.bits, self.key_group, dim=-2))
        self.q_v = _cat(self.q_v, quantize_groups(v, self.bits, self.value_group, dim=-1))
        self.quantized += n
        self.res_k, self.res_v = self.res_k[:, n:].clone(), self.res_v[:, n:].clone()

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[H, quantized, d] keys and values as attention sees them."""
        if self.q_k is None:
            return self.res_k[:, :0], self.res_v[:, :0]
        return (dequantize_groups(self.q_k, self.key_group, -2, self.dtype),
                dequantize_groups(self.q_v, self.value_group, -1, self.dtype))

    # --- cache protocol ---------------------------------------------------------------------------
    def stored_length(self) -> int:
        return self.quantized + self.res_k.shape[1]

    def nbytes(self) -> int:
        quantized = 0 if self.q_k is None else self.q_k.nbytes() + self.q_v.nbytes()
        return quantized + tensor_bytes(self.res_k, self.res_v)

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("a compressed s4r cache holds one sequence (batch size 1)")
        self.fold_buffer(incoming=key_states.shape[-2])
        self._append(key_states[0], value_states[0])
        keys = self.res_k.unsqueeze(0)
        handoff(self, keys)  # the attention function gets no handle on the cache: name this layer to it
        return keys, self.res_v.unsqueeze(0)

    def fold_buffer(self, incoming: int = 0) -> None:
        """Quantize the whole key groups of the residual that leave less than `reserve` tokens for it
        (counting `incoming` tokens about to be appended)."""
        excess = self.res_k.shape[1] + incoming - self.reserve
        if excess > 0:
            g = self.key_group
            self._fold(min(-(-excess // g) * g, self.res_k.shape[1] // g * g))

    def attend(self, query, key, value, scaling):
        old_k, old_v = self.dequantized()
        keys = torch.cat([old_k, self.res_k], dim=1).unsqueeze(0)
        values = torch.cat([old_v, self.res_v], dim=1).unsqueeze(0)
        out = causal_attention(query, keys, values, scaling)
        # a question longer than the reserve would hold the cache over its ratio until the next step
        self.fold_buffer()
        return out

    def truncate(self, logical: int) -> None:
        logical = max(0, min(self.logical, logical))
        if logical < self.quantized:
            # a key group cannot be cut: its kept tokens go back to the residual, dequantized
            start = logical // self.key_group * self.key_group
            old_k, old_v = self.dequantized()
            self.res_k, self.res_v = old_k[:, start:logical].clone(), old_v[:, start:logical].clone()
            self.q_k = self.q_v = None
            self.quantized = 0
            if start:
                self._requantize(old_k[:, :start], old_v[:, :start])
            self.logical = logical
            return
        # a copy: a view would keep the forgotten tokens' storage alive
        self.res_k = self.res_k[:, : logical - self.quantized].clone()
        self.res_v = self.res_v[:, : logical - self.quantized].clone()
        self.logical = logical

    def _requantize(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # re-quantizing already quantized values is exact up to rounding: min/max are grid points
        self.q_k = quantize_groups(keys, self.bits, self.key_group, dim=-2)
        self.q_v = quantize_groups(values, self.bits, self.value_group, dim=-1)
        self.quantized = keys.shape[1]

    # --- persistence --------------------------------------------------------------------------------
    kind = "quant"
    _PARTS = ("packed", "scale", "zero")

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {"res_k": self.res_k, "res_v": self.res_v}
        for name, q in (("k", self.q_k), ("v", self.q_v)):
            if q is not None:
                tensors.update({f"{name}.{part}": getattr(q, part) for part in self._PARTS})
        return tensors

    def meta_state(self) -> dict[str, Any]:
        return {"bits": self.bits, "key_group": self.key_group, "value_group": self.value_group,
                "reserve": self.reserve, "quantized": self.quantized, "logical": self.logical}

    @classmethod
    def from_state(cls, state, meta, *, rope=None) -> QuantLayer:
        res_k, res_v = state["res_k"], state["res_v"]
        layer = cls(res_k[:, :0], res_v[:, :0], bits=meta["bits"], key_group=meta["key_group"],
                    value_group=meta["value_group"], reserve=meta["reserve"])
        layer.res_k, layer.res_v = res_k, res_v
        if "k.packed" in state:
            layer.q_k, layer.q_v = (Quantized(*(state[f"{name}.{part}"] for part in cls._PARTS), meta["bits"])
                                    for name in ("k", "v"))
        layer.quantized, layer.logical = meta["quantized"], meta["logical"]
        return layer
