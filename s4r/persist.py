"""Save and load a compressed cache: safetensors for the tensors, JSON metadata with a checksum."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .cache import CompressedCache
from .config import S4RConfig
from .errors import CacheFileError
from .layers import FullLayer, LowRankLayer
from .rope import RopeFn

FORMAT = "s4r-cache/1"
_LOWRANK_KEYS = ("sink_k", "sink_v", "basis_k", "basis_v", "coef_k", "coef_v", "scale_k", "scale_v",
                 "query_coef", "buf_k", "buf_v", "out_idx", "out_k", "out_v", "relevance")


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        t = tensors[name].contiguous()
        digest.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_cache(path: str | Path, cache: CompressedCache, meta: dict[str, Any]) -> None:
    """Write `cache` and `meta` to `path` atomically (a crash never leaves a half-written file)."""
    tensors: dict[str, torch.Tensor] = {}
    kinds, configs = [], []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LowRankLayer):
            kinds.append("lowrank")
            configs.append(layer.cfg.to_dict())
            for key in _LOWRANK_KEYS:
                value = getattr(layer, key)
                if value is not None:
                    tensors[f"{i}.{key}"] = value.detach().to("cpu").contiguous()
        elif isinstance(layer, FullLayer):
            kinds.append("full")
            configs.append(None)
            tensors[f"{i}.k"] = layer.keys_view.detach().to("cpu").contiguous()
            tensors[f"{i}.v"] = layer.values_view.detach().to("cpu").contiguous()
        else:
            raise CacheFileError(f"cannot save a cache layer of type {type(layer).__name__}")
    header = {"format": FORMAT, "meta": meta, "layers": kinds, "configs": configs,
              "logical": [layer.get_seq_length() for layer in cache.layers],
              "checksum": _checksum(tensors)}
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
    """The metadata of a saved cache, without loading its tensors."""
    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"saved cache not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})["s4r"])
    except Exception as exc:  # noqa: BLE001 - any parse failure means the file is not a valid cache
        raise CacheFileError(f"not a valid s4r cache file: {path} ({type(exc).__name__})") from None
    if header.get("format") != FORMAT:
        raise CacheFileError(f"unsupported cache format in {path}: {header.get('format')!r}")
    return header


def load_cache(path: str | Path, cache: CompressedCache, rope: RopeFn | None,
               device: torch.device) -> dict[str, Any]:
    """Fill the (fresh) `cache` from `path`; returns the saved metadata. Verifies the checksum."""
    header = read_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open API
    except Exception as exc:  # noqa: BLE001
        raise CacheFileError(f"corrupt s4r cache file: {path} ({type(exc).__name__})") from None
    if _checksum(tensors) != header.get("checksum"):
        raise CacheFileError(f"corrupt s4r cache file: {path} (checksum mismatch)")
    if len(header["layers"]) != len(cache.layers):
        raise CacheFileError(f"saved cache has {len(header['layers'])} layers, the model {len(cache.layers)}")
    rows = zip(header["layers"], header["configs"], header["logical"], strict=True)
    for i, (kind, cfg, logical) in enumerate(rows):

        def get(key: str, i: int = i) -> torch.Tensor | None:
            name = f"{i}.{key}"
            return tensors[name].to(device) if name in tensors else None

        if kind == "full":
            layer = FullLayer()
            layer.update(get("k"), get("v"))
        else:
            layer = LowRankLayer(cfg=S4RConfig(**cfg), **{k: get(k) for k in _LOWRANK_KEYS if k not in
                                                         ("buf_k", "buf_v")}, rope=rope)
            layer.set_buffer(get("buf_k"), get("buf_v"))
        if layer.get_seq_length() != logical:
            raise CacheFileError(f"corrupt s4r cache file: {path} (layer {i} length mismatch)")
        cache.layers[i] = layer
    return header["meta"]
