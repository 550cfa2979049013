"""bitsandbytes weights for random-weight models (``--random-weights --quant 4bit``): the memory and speed
of a quantized model of a profile's shape, with no checkpoint to load.

`from_pretrained` quantizes while it loads a checkpoint; a random model has none, so its linear layers are
swapped for bitsandbytes ones here, one at a time (each layer's full-precision weight is freed as soon as
its quantized copy exists, so the peak is the unquantized model, not two of it).
"""

from __future__ import annotations

import torch
from torch import nn

from s4r.errors import DeviceError, first_line

__all__ = ["quantize_linears"]


def _quantized_copy(linear: nn.Linear, quant: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    weight = linear.weight.data
    if quant == "4bit":
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=dtype, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    has_fp16_weights=False, threshold=6.0, device="meta")
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    # bitsandbytes quantizes a parameter when it is moved to its device
    return layer.to(device)


def quantize_linears(model: nn.Module, quant: str, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every `nn.Linear` of `model` except the output head by a bitsandbytes `quant` ("8bit" or
    "4bit" NF4, as `--quant` loads checkpoints) layer on `device`; returns how many were replaced."""
    if quant not in ("8bit", "4bit"):
        raise ValueError(f"quant must be 8bit or 4bit, got {quant!r}")
    try:
        import bitsandbytes  # noqa: F401  (fail early, with one line)
    except Exception as exc:
        raise DeviceError(f"--quant {quant} needs bitsandbytes, which cannot be loaded here: "
                          f"{first_line(exc)}") from exc
    head = model.get_output_embeddings()
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child is not head]
    count = len(targets)
    try:
        while targets:  # popped so that each full-precision weight is freed once replaced
            parent, name, child = targets.pop()
            setattr(parent, name, _quantized_copy(child, quant, dtype, device))
            del child
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise DeviceError(f"--quant {quant} is not available here: {first_line(exc)}") from exc
    return count
