"""Save and load a cache: safetensors for the tensors, a JSON header, one checksum over both.

Each layer saves itself (`state` / `meta_state` / `from_state`, as mlx-lm's caches do), so a cache of
any method's layers can be written; the file names each layer's kind. The checksum covers the tensors
and the header (settings, lengths, metadata), so a changed byte anywhere is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from s4r.core.rope import RopeFn
from s4r.errors import CacheFileError
from s4r.hf.cache import CompressedCache
from s4r.layers.eviction import EvictedLayer
from s4r.layers.full import CacheLayer, FullLayer, StagingLayer
from s4r.layers.lowrank import LowRankLayer
from s4r.layers.quant import QuantLayer
from s4r.layers.segments import SegmentedLayer

FORMAT = "s4r-cache/2"
# every kind of layer a file may hold, by the name it is saved under
LAYER_KINDS: dict[str, type[CacheLayer]] = {
    cls.kind: cls
    for cls in (FullLayer, StagingLayer, LowRankLayer, SegmentedLayer, EvictedLayer, QuantLayer)}


def _checksum(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> str:
    """SHA-256 of the header (without its checksum) and of every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        t = tensors[name].contiguous()
        digest.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_cache(path: str | Path, cache: CompressedCache, meta: dict[str, Any]) -> None:
    """Write `cache` and `meta` to `path` atomically (a crash never leaves a half-written file)."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        if LAYER_KINDS.get(layer.kind) is not type(layer):
            raise CacheFileError(f"cannot save a cache layer of type {type(layer).__name__}")
        layers.append({"kind": layer.kind, "meta": layer.meta_state(), "logical": layer.get_seq_length()})
        for key, value in layer.state().items():
            tensors[f"{i}.{key}"] = value.detach().to("cpu").contiguous()
    header = {"format": FORMAT, "meta": meta, "layers": layers}
    header["checksum"] = _checksum(tensors, header)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".s4r-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"s4r": json.dumps(header)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_header(path: str | Path) -> dict[str, Any]:
    """The header of a saved cache, without loading its tensors (not verified: `load_cache` does)."""
    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"saved cache not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})["s4r"])
    except Exception as exc:  # noqa: BLE001 - any parse failure means the file is not a valid cache
        raise CacheFileError(f"not a valid s4r cache file: {path} ({type(exc).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise CacheFileError(f"unsupported cache format in {path}: {found!r}")
    return header


def load_cache(path: str | Path, cache: CompressedCache, rope: RopeFn | None,
               device: torch.device | Sequence[torch.device]) -> dict[str, Any]:
    """Fill the (fresh) `cache` from `path`; returns the saved metadata. Verifies the checksum.

    `device` is where the layers go, or one device per layer (a model whose layers accelerate spread)."""
    header = read_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open API
    except Exception as exc:  # noqa: BLE001
        raise CacheFileError(f"corrupt s4r cache file: {path} ({type(exc).__name__})") from None
    checksum = header.pop("checksum", None)
    if _checksum(tensors, header) != checksum:
        raise CacheFileError(f"corrupt s4r cache file: {path} (checksum mismatch)")
    if len(header["layers"]) != len(cache.layers):
        raise CacheFileError(f"saved cache has {len(header['layers'])} layers, the model {len(cache.layers)}")
    devices = [device] * len(cache.layers) if isinstance(device, (torch.device, str)) else list(device)
    for i, saved in enumerate(header["layers"]):
        prefix = f"{i}."
        state = {name[len(prefix):]: t.to(devices[i])
                 for name, t in tensors.items() if name.startswith(prefix)}
        layer = LAYER_KINDS[saved["kind"]].from_state(state, saved["meta"], rope=rope)
        if layer.get_seq_length() != saved["logical"]:
            raise CacheFileError(f"corrupt s4r cache file: {path} (layer {i} length mismatch)")
        cache.layers[i] = layer
    return header["meta"]
