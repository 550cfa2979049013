"""Layers spread over devices by accelerate's ``device_map``: where each decoder layer runs, so its cache
layer (staging buffers, bases, coefficients, loaded tensors) is kept on the same device."""

from __future__ import annotations

from typing import Any

import torch


def decoder_layers(model: Any) -> list[Any] | None:
    """The model's decoder layers in order (``model.model.layers``), or None where there is no such list."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        inner = getattr(inner, "language_model", None)
        layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else None


def module_device(module: Any) -> torch.device | None:
    """Where `module` computes: accelerate's execution device when it placed the module (offloaded
    weights included), else the device of its first parameter."""
    hook = getattr(module, "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    if execution is not None:
        return torch.device(execution if not isinstance(execution, int) else f"cuda:{execution}")
    param = next(module.parameters(), None)
    return param.device if param is not None else None


def layer_devices(model: Any) -> list[torch.device] | None:
    """The device each decoder layer runs on (all the same for a model on one device; several where
    accelerate's device_map spread the layers); None where the model has no plain list of layers."""
    layers = decoder_layers(model)
    if not layers:
        return None
    devices = [module_device(layer) for layer in layers]
    return None if any(d is None for d in devices) else devices


def spread(devices: list[torch.device] | None) -> bool:
    """Whether the layers run on more than one device."""
    return devices is not None and len(set(devices)) > 1
