"""What the fused kernels read of an S4R layer: whether they can read its storage at all, the dtype its keys
are rebuilt in, and its lower bands as the kernels take them (numpy views and arrays)."""

from __future__ import annotations

import numpy as np
import torch

from s4r.kernels import jit
from s4r.kernels.jit import as_numpy


def storage_fusable(layer) -> bool:
    """Whether these kernels can read `layer`'s storage (the decode step and a block's rebuild ask it
    first): a CPU, int8 coefficients, bf16 or fp32 tensors, static rotary frequencies for pre-RoPE keys,
    the kernels not turned off."""
    cfg = layer.cfg
    if cfg.kernels == "eager" or layer.basis_k.device.type != "cpu" or layer._sk is None:
        return False
    if layer.dtype not in (torch.bfloat16, torch.float32):
        return False
    if cfg.key_space == "pre_rope" and not hasattr(layer.rope, "rotary"):
        return False
    return jit.available()


def rebuild_work_dtype(layer) -> torch.dtype:
    """The dtype stored keys are rebuilt in: the eager step's (`rebuild_dtype`) where the CPU has bf16
    products, fp32 where bf16 ones are emulated (tens of times slower there: BENCHMARKS.md, decode speed)."""
    return layer.rebuild_dtype if jit.native_bf16() else torch.float32


def band_arrays(layer, keys: bool) -> tuple[np.ndarray, np.ndarray]:
    """(bits, widths) of the layer's lower key or value bands as the kernels take them, kept while the
    plan is the same."""
    plan = layer.plan_k if keys else layer.plan_v
    name = "_fused_bands_k" if keys else "_fused_bands_v"
    memo = getattr(layer, name, None)
    if memo is None or memo[0] is not plan:
        bits = np.array([b for b, _ in plan.tails], dtype=np.int64)
        widths = np.array([w for _, w in plan.tails], dtype=np.int64)
        memo = (plan, bits, widths)
        setattr(layer, name, memo)
    return memo[1], memo[2]


def tail_arrays(layer, keys: bool) -> tuple[np.ndarray, np.ndarray]:
    """The layer's lower-band codes and steps of its keys (or values) as numpy views; empty arrays
    where it stores no lower bands."""
    codes, steps = (layer._tk, layer._tsk) if keys else (layer._tv, layer._tsv)
    if codes is None:
        groups = layer.basis_k.shape[0]
        return np.zeros((groups, 1, 0), np.uint8), np.zeros((groups, 1, 0), np.float32)
    return as_numpy(codes), as_numpy(steps)
