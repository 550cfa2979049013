"""Device and dtype choice: ``auto|cpu|cuda|cuda:N`` and ``auto|bf16|fp16|fp32`` to torch objects."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from s4r.errors import DeviceError
from s4r.validation import DEVICE_RE

__all__ = ["cpu_supports_bf16", "resolve_device", "resolve_dtype"]


@lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX on x86, BF16 on Arm)."""
    # Without native support torch emulates bf16 matmuls, which is several times slower than fp32,
    # so "supported" here means "fast", and only the CPU flags say that reliably.
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(device: str = "auto") -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N`` into a torch device; DeviceError if the GPU asked for is missing."""
    spec = (device or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    match = DEVICE_RE.fullmatch(spec)
    if not match:
        raise DeviceError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device} requested but no CUDA GPU is available")
    if match.group(1) is None:
        return torch.device("cuda")
    index = int(match.group(1))
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {device} requested but only {count} CUDA GPU(s) are available")
    return torch.device("cuda", index)


_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Turn ``auto|bf16|fp16|fp32`` into a torch dtype; auto picks the fastest accurate one for ``device``."""
    spec = (dtype or "auto").strip().lower()
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if spec not in _DTYPES:
        raise DeviceError(f"unknown dtype '{dtype}'; use auto, bf16, fp16 or fp32")
    return _DTYPES[spec]

